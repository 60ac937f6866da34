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


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.3", "dirichlet:5", "dirichlet_capped:0.3", "dirichlet_capped:5",
                                  "dirichlet_capped:0.1:1", "classes:2", "classes:3", "classes:10"])
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


# ----------------------------------------------------------------- classes:K (random draw)

import functools
import hashlib
import itertools
from collections import Counter
from math import gcd

POOL = np.repeat(np.arange(10), 30)  # 300 samples, 10 classes of 30
np.random.default_rng(7).shuffle(POOL)


def class_sets(parts, labels):
    return [tuple(np.unique(labels[p]).tolist()) for p in parts]


@functools.lru_cache(maxsize=1)
def fedmix_cifar10_shape_over_seeds(seeds=400):
    """Client class sets of classes:2 with N = 60, C = 10 for seeds 0..seeds-1."""
    return [class_sets(make_partition("classes:2", POOL, 60, seed), POOL) for seed in range(seeds)]


def check_classes_partition(parts, labels, n, k):
    """The contract of both classes variants, checked from the output alone."""
    c = len(np.unique(labels))
    assert len(parts) == n
    assert_exact_cover(parts, len(labels))
    sets = class_sets(parts, labels)
    assert all(len(s) == k for s in sets), "K distinct classes per client"
    holders = Counter(cl for s in sets for cl in s)
    assert sorted(holders) == list(range(c)), "every class has a holder"
    assert sum(holders.values()) == n * k
    assert max(holders.values()) - min(holders.values()) <= 1, holders
    for cl in range(c):  # each class split evenly over its holders
        sizes = [int((labels[p] == cl).sum()) for p in parts if (labels[p] == cl).any()]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("spec", ["classes", "classes_cyclic"])
@pytest.mark.parametrize("n,k", [(60, 2), (7, 3), (10, 10), (5, 2), (1, 10), (13, 4)])
def test_classes_contract(spec, n, k):
    parts = make_partition(f"{spec}:{k}", POOL, n, seed=11)
    check_classes_partition(parts, POOL, n, k)


def test_classes_never_gets_stuck_on_any_small_shape():
    """Every (C, K, N) with N*K >= C up to 12 classes / 12 clients: the quota invariant of
    the docstring means the draw always completes with the full contract."""
    for c in range(2, 13):
        labels = np.repeat(np.arange(c), 13)
        for k in range(1, c + 1):
            for n in range(-(-c // k), 13):
                parts = make_partition(f"classes:{k}", labels, n, seed=n * 100 + k)
                check_classes_partition(parts, labels, n, k)


def test_classes_gives_many_distinct_class_sets():
    """FedMix's CIFAR-10 shape (N=60, K=2, C=10): the cyclic deal has exactly 5 pairs
    (C/gcd(K, C)); a random draw holds about 35 of the 45 possible pairs."""
    for seed in range(8):
        cyclic = class_sets(make_partition("classes_cyclic:2", POOL, 60, seed), POOL)
        assert len(set(cyclic)) == 10 // gcd(2, 10)
        drawn = class_sets(make_partition("classes:2", POOL, 60, seed), POOL)
        assert len(set(drawn)) >= 25, (seed, len(set(drawn)))


def test_classes_draw_is_unbiased_over_seeds():
    """Every class pair is equally likely for a client (classes are exchangeable): over
    400 seeds x 60 clients each of the 45 pairs shows up 533 times in expectation (the
    spread measured over other seed ranges is about 4%). A draw that favoured some classes
    (e.g. low ids on ties, or weights other than the remaining quota) would not pass."""
    counts = Counter()
    for sets in fedmix_cifar10_shape_over_seeds():
        counts.update(sets)
    pairs = list(itertools.combinations(range(10), 2))
    expected = 400 * 60 / len(pairs)
    assert set(counts) == set(pairs)
    assert all(0.8 * expected < counts[p] < 1.2 * expected for p in pairs), counts
    # and not a fixed rotation either: client 0's pair varies with the seed
    firsts = {sets[0] for sets in fedmix_cifar10_shape_over_seeds()[:30]}
    assert len(firsts) >= 10


def test_classes_first_and_last_client_draw_every_class_alike():
    """Per client position the draw is fair too: over 400 seeds the first and the last
    client hold each class about 400 * K/C = 80 times (binomial sd 8; bounds +-30). A
    weighting that favoured a class would give it to early clients and starve late ones."""
    first, last = Counter(), Counter()
    for sets in fedmix_cifar10_shape_over_seeds():
        first.update(sets[0])
        last.update(sets[-1])
    for counts in (first, last):
        assert sorted(counts) == list(range(10))
        assert all(50 <= v <= 110 for v in counts.values()), counts


@pytest.mark.parametrize("spec,labels,n", [("classes:3", "POOL", 13), ("dirichlet_capped:0.5", "CIFAR_LIKE", 16)])
def test_random_partitions_are_seeded(spec, labels, n):
    labels = globals()[labels]
    a = make_partition(spec, labels, n, seed=5)
    b = make_partition(spec, labels, n, seed=5)
    c = make_partition(spec, labels, n, seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def _digest(parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(np.asarray(p, np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


@pytest.mark.parametrize("k,n,seed,digest", [
    (2, 60, 0, "778505bcfb4a4b91"), (2, 13, 3, "b8bd908f31efc3a8"),
    (3, 60, 0, "c57a80a5e25ff852"), (3, 13, 3, "31d314766c105a29"),
])
def test_classes_cyclic_is_the_old_classes_scheme_unchanged(k, n, seed, digest):
    """Digests of the partitions the former ``classes:K`` gave (computed from it before
    it became a random draw), and its round-robin structure recomputed here."""
    parts = make_partition(f"classes_cyclic:{k}", POOL, n, seed)
    assert _digest(parts) == digest
    # Round-robin over one class order: the sets repeat with period C/gcd(K, C), and one
    # period deals every class exactly K/gcd(K, C) times.
    sets = [frozenset(s) for s in class_sets(parts, POOL)]
    period = 10 // gcd(k, 10)
    assert all(sets[i] == sets[i + period] for i in range(n - period))
    if n >= period:
        assert len(set(sets)) == period
        once = Counter(cl for s in sets[:period] for cl in s)
        assert set(once.values()) == {k // gcd(k, 10)}


@pytest.mark.parametrize("spec,err", [
    ("classes_cyclic:0", ConfigError), ("classes_cyclic:11", ConfigError),
    ("classes_cyclic:x", ConfigError), ("classes:2.5", ConfigError),
])
def test_bad_classes_specs_are_refused(spec, err):
    with pytest.raises(err, match=spec.split(":")[0]):
        make_partition(spec, LABELS, 10, seed=0)
    with pytest.raises(DataError, match="covers only"):
        make_partition("classes_cyclic:1", LABELS, 5, seed=0)


@pytest.mark.parametrize("spec", ["classes:2", "classes_cyclic:2"])
def test_a_class_smaller_than_its_holders_is_refused_not_dealt_empty(spec):
    """Six clients, two classes each, three classes: each class has four holders, and a class of
    one sample would leave three of them with one class, which the contract forbids."""
    labels = np.array([0] * 20 + [1] * 20 + [2])
    with pytest.raises(DataError, match=r"class 2 has 1 sample\(s\) but 4 clients are to hold it"):
        make_partition(spec, labels, 6, seed=0)
    parts = make_partition(spec, np.array([0] * 20 + [1] * 20 + [2] * 4), 6, seed=0)
    assert all(len(np.unique(np.array([0] * 20 + [1] * 20 + [2] * 4)[p])) == 2 for p in parts)


def test_partition_help_names_both_classes_schemes():
    from fedhpc.data.partition import partition_help
    assert "classes:K" in partition_help() and "classes_cyclic:K" in partition_help()


# ----------------------------------------------------------------- dirichlet_capped (FedML's rule)

CIFAR_LIKE = np.repeat(np.arange(10), 500)  # CIFAR-10's 10 balanced classes, a tenth of the size
np.random.default_rng(3).shuffle(CIFAR_LIKE)


def capped_by_hand(labels, n, seed, alpha, minimum):
    """The rule as stated, one client and one class at a time: per class (label order) shuffle
    its indices and draw p ~ Dir(alpha); p_j = 0 where client j holds >= N/n; renormalise; cut
    at round(cumulative share * class size). Repeat the whole draw until every client holds
    >= minimum. Same generator and draw order as make_partition. Returns (parts, draws)."""
    rng = np.random.default_rng([seed, 0xDA7A])
    total = len(labels)
    draws = 0
    while True:
        draws += 1
        clients = [[] for _ in range(n)]
        for c in sorted(set(labels.tolist())):
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet([alpha] * n)
            p = [0.0 if len(clients[j]) >= total / n else float(p[j]) for j in range(n)]
            mass = sum(p)
            start, cum = 0, 0.0
            for j in range(n):
                cum += p[j] / mass
                end = len(idx) if j == n - 1 else int(round(cum * len(idx)))
                clients[j].extend(idx[start:end].tolist())
                start = end
        if min(len(c) for c in clients) >= minimum:
            return [np.array(sorted(c), dtype=np.int64) for c in clients], draws


@pytest.mark.parametrize("alpha,n,minimum,seed,redrawn", [
    (0.5, 16, 10, 0, True), (0.5, 16, 10, 1, False), (0.1, 16, 10, 1, True), (0.1, 7, 40, 5, True),
    (2.0, 13, 1, 4, False), (1.0, 20, 10, 0, True), (0.5, 10, 10, 1, False),
])
def test_dirichlet_capped_is_the_rule_as_stated(alpha, n, minimum, seed, redrawn):
    spec = f"dirichlet_capped:{alpha}" + ("" if minimum == 10 else f":{minimum}")
    parts = make_partition(spec, LABELS, n, seed)
    want, draws = capped_by_hand(LABELS, n, seed, alpha, minimum)
    assert all(np.array_equal(a, b) for a, b in zip(parts, want))
    # The cases cover both paths: a first draw kept, and draws thrown away (3 and 16 of them);
    # at 20 and 10 clients N/n is whole (25, 50) and clients land exactly on it, where the cap
    # (size >= N/n) and a strict one (size > N/n) part ways.
    assert (draws > 1) == redrawn


def capped_excess(parts, labels):
    """Per client: its size minus its chunk of the last class (in label order) it received.
    The rule only hands a class to a client under N/n, so this must stay below N/n."""
    out = []
    for p in parts:
        counts = np.bincount(labels[p], minlength=labels.max() + 1)
        held = np.flatnonzero(counts)
        out.append(len(p) - counts[held[-1]] if len(held) else 0)  # the plain rule can leave a client empty
    return np.array(out)


@pytest.mark.parametrize("alpha,n", [(0.1, 16), (0.5, 16), (0.5, 7), (2.0, 30), (1.0, 20)])
def test_dirichlet_capped_cap_minimum_and_cover(alpha, n):
    total = len(CIFAR_LIKE)
    broke_cap = False
    for seed in range(6):
        parts = make_partition(f"dirichlet_capped:{alpha}", CIFAR_LIKE, n, seed)
        assert len(parts) == n
        assert_exact_cover(parts, total)
        assert min(len(p) for p in parts) >= 10
        assert (capped_excess(parts, CIFAR_LIKE) * n < total).all()  # integer form of < N/n
        # nor can a client exceed N/n by more than one class's samples
        assert max(len(p) for p in parts) < total / n + 500
        plain = make_partition(f"dirichlet:{alpha}", CIFAR_LIKE, n, seed, min_samples=0)
        broke_cap |= bool((capped_excess(plain, CIFAR_LIKE) * n >= total).any())
    if alpha <= 0.5:  # the uncapped rule breaks the bound, so the check above can fail
        assert broke_cap


def test_dirichlet_capped_balances_sizes_more_than_the_plain_rule():
    """16 clients at alpha 0.5 on 10 balanced classes (FedAlign's CIFAR-10 setting): the mean
    coefficient of variation of client sizes over these 10 seeds is 0.25 capped and 0.43
    plain (on the full CIFAR-10 over 100 seeds: 0.27 and 0.40); per-seed sd about 0.05, so
    the mean of 10 has sd about 0.017 and the 0.8 factor leaves a margin of 5 sd."""
    def mean_cv(spec):
        cvs = []
        for seed in range(10):
            sizes = np.array([len(p) for p in make_partition(spec, CIFAR_LIKE, 16, seed, min_samples=0)])
            cvs.append(sizes.std() / sizes.mean())
        return float(np.mean(cvs))
    capped, plain = mean_cv("dirichlet_capped:0.5"), mean_cv("dirichlet:0.5")
    assert capped < 0.8 * plain, (capped, plain)
    assert 0.18 < capped < 0.33 and 0.33 < plain < 0.52, (capped, plain)


def test_dirichlet_capped_redraws_up_to_the_callers_minimum():
    """The redraw aims at max(MIN, min_samples): with MIN = 1 this seed leaves a client under 5
    samples, and the caller's min_samples = 5 gives exactly dirichlet_capped:0.1:5 instead of a
    DataError."""
    short = make_partition("dirichlet_capped:0.1:1", LABELS, 16, seed=0)
    assert min(len(p) for p in short) < 5
    floored = make_partition("dirichlet_capped:0.1:1", LABELS, 16, seed=0, min_samples=5)
    assert min(len(p) for p in floored) >= 5
    assert all(np.array_equal(x, y) for x, y in zip(floored, make_partition("dirichlet_capped:0.1:5", LABELS, 16, 0)))


@pytest.mark.parametrize("spec,words", [
    ("dirichlet_capped:abc", "positive number"), ("dirichlet_capped:-1", "positive alpha"),
    ("dirichlet_capped:inf", "finite alpha"), ("dirichlet_capped:0.5:x", "MIN a whole number"),
    ("dirichlet_capped:0.5:0", "MIN >= 1"), ("dirichlet_capped", "positive number"),
])
def test_bad_dirichlet_capped_specs_are_refused_before_any_data(spec, words):
    from fedhpc.data.partition import check_partition
    for call in (lambda: check_partition(spec), lambda: make_partition(spec, LABELS, 10, seed=0)):
        with pytest.raises(ConfigError, match="dirichlet_capped") as e:
            call()
        assert words in str(e.value)


def test_dirichlet_capped_refuses_a_minimum_it_cannot_meet(monkeypatch):
    import fedhpc.data.partition.label_skew as partition
    with pytest.raises(ConfigError, match=r"cannot give 51 clients at least 10 .*lower MIN.*fewer clients"):
        make_partition("dirichlet_capped:0.5", LABELS, 51, seed=0)
    # 50 clients x 10 = the whole pool: possible only if every client gets exactly 10, which
    # no draw achieves; the loop stops after CAPPED_ATTEMPTS draws with the fix
    draws = []
    real = partition._capped_draw
    monkeypatch.setattr(partition, "CAPPED_ATTEMPTS", 25)
    monkeypatch.setattr(partition, "_capped_draw", lambda *a: draws.append(1) or real(*a))
    with pytest.raises(ConfigError, match=r"25 draws .*fewer than 10 .*lower MIN.*fewer clients"):
        make_partition("dirichlet_capped:0.5", LABELS, 50, seed=0)
    assert len(draws) == 25


def test_partition_help_names_dirichlet_capped():
    from fedhpc.data.partition import partition_help
    assert "dirichlet_capped:ALPHA[:MIN]" in partition_help() and "dirichlet:ALPHA" in partition_help()


#: one split per rule as PARTITION_RULES 2 deals it, on an unbalanced pool (so that every rule's
#: per-class arithmetic matters); the same from the single-file rules (f340a80) and from fedhpc/data/partition/
RULES_2_DIGESTS = {
    "iid": "d9189104fac349e5", "dirichlet:0.5": "41860b4d60c9dac4", "dirichlet_capped:0.5:5": "f76b38f1d38c4465",
    "classes:2": "edd6d45b5b46f170", "classes_cyclic:3": "30627e0f96a0c680", "skewed:1:3:9": "7ded976f26ec2064",
    "mix2fld": "43292f342fc31a3e", "deficient:0,2:2:9": "0ad7cae808f606bb",
}
UNBALANCED = np.repeat(np.arange(10), [540, 420, 450, 600, 384, 480, 396, 570, 426, 528])


def _rules_digest(spec):
    return _digest(make_partition(spec, UNBALANCED, 6, seed=11))  # mix2fld: 6 x 62 of each label


def test_every_rule_deals_what_partition_rules_promises():
    """A run's identity holds PARTITION_RULES, so that a checkpoint or a finished sweep point is
    not taken for a split its spec no longer deals. That only works if every change to what a
    spec deals bumps it: this pins one split per rule. If you changed a rule on purpose, bump
    PARTITION_RULES in fedhpc/data/partition/ and write the new digests here."""
    from fedhpc.data.partition import PARTITION_RULES, partition_names
    assert PARTITION_RULES == 2, "PARTITION_RULES changed: write this test's digests for the new rules"
    pooled = {n for n in partition_names() if n != "natural"}
    assert pooled == {s.partition(":")[0] for s in RULES_2_DIGESTS}, \
        "a partition rule was added or removed: give it a digest here"
    assert {spec: _rules_digest(spec) for spec in RULES_2_DIGESTS} == RULES_2_DIGESTS
