import numpy as np
import pytest

from fedhpc.data.partition import make_partition
from fedhpc.errors import ConfigError, DataError

LABELS = np.repeat(np.arange(10), 50)  # 500 samples, 10 balanced classes
np.random.default_rng(0).shuffle(LABELS)


def assert_exact_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "every sample assigned"
    assert len(np.unique(allidx)) == n, "no sample assigned twice"


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.3", "dirichlet:5", "classes:2", "classes:3", "classes:10"])
def test_every_sample_exactly_once(spec):
    parts = make_partition(spec, LABELS, 10, seed=1)
    assert len(parts) == 10
    assert_exact_cover(parts, len(LABELS))


def test_iid_sizes_balanced_and_seeded():
    a = make_partition("iid", LABELS, 7, seed=3)
    b = make_partition("iid", LABELS, 7, seed=3)
    c = make_partition("iid", LABELS, 7, seed=4)
    sizes = [len(p) for p in a]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("k", [1, 2, 5])
def test_classes_k_gives_k_distinct_classes(k):
    parts = make_partition(f"classes:{k}", LABELS, 10, seed=0)
    for p in parts:
        assert len(np.unique(LABELS[p])) == k


def test_dirichlet_skew_grows_as_alpha_shrinks():
    def mean_entropy(alpha):
        ents = []
        for p in make_partition(f"dirichlet:{alpha}", LABELS, 5, seed=2):
            q = np.bincount(LABELS[p], minlength=10) / max(len(p), 1)
            q = q[q > 0]
            ents.append(-(q * np.log(q)).sum())
        return np.mean(ents)
    assert mean_entropy(0.1) < mean_entropy(1.0) < mean_entropy(100.0)
    assert mean_entropy(100.0) > 0.95 * np.log(10)


@pytest.mark.parametrize("spec,err", [
    ("classes:0", ConfigError), ("classes:11", ConfigError), ("classes:x", ConfigError),
    ("dirichlet:abc", ConfigError), ("dirichlet:-1", ConfigError), ("shards", ConfigError),
    ("iid:3", ConfigError),
])
def test_bad_specs_are_refused(spec, err):
    with pytest.raises(err) as e:
        make_partition(spec, LABELS, 10, seed=0)
    assert spec.split(":")[0] in str(e.value) or "partition" in str(e.value)


def test_partition_leaving_client_without_data_is_refused():
    with pytest.raises(DataError, match="fewer than|cannot give"):
        make_partition("iid", LABELS, 400, seed=0, min_samples=2)
    with pytest.raises(DataError, match="milder|fewer clients"):
        make_partition("dirichlet:0.01", LABELS, 50, seed=0, min_samples=2)
    with pytest.raises(DataError, match="covers only"):
        make_partition("classes:1", LABELS, 5, seed=0)
