"""Readers of the published dataset formats, exercised through the public builders.

Every fixture is a tiny file written byte for byte in the real format (IDX with
its magic number, CIFAR's protocol-2 pickles with bytes keys, TFF's
``examples/<client>/...`` HDF5 groups, LEAF JSON, a JPEG class-folder tree).
Images carry their sample id in two pixels, so tests can check where every
sample ended up without trusting the code under test.
"""

import gzip
import json
import os
import pickle
import struct

import h5py
import numpy as np
import pytest

from conftest import cfg_for, opts

from fedhpc.data import build_dataset
from fedhpc.data.partition import make_partition
from fedhpc.errors import ConfigError, DataError

# --------------------------------------------------------------------------- helpers


def write_idx(path, arr, gz):
    arr = np.ascontiguousarray(arr)
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}[arr.dtype]
    payload = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(payload)
    else:
        with open(path, "wb") as f:
            f.write(payload)


def tagged(n, shape, start=0, seed=0):
    """Random uint8 images whose first two values along the last axis encode the id."""
    rng = np.random.default_rng(seed + start)
    x = rng.integers(0, 256, size=(n,) + shape, dtype=np.uint8)
    ids = np.arange(start, start + n)
    x.reshape(n, -1)[:, 0] = ids % 256
    x.reshape(n, -1)[:, 1] = ids // 256
    return x


def ids_of(x):
    """Ids of images (N, C, H, W) tagged as in :func:`tagged` (first two values of row 0)."""
    flat = x.flatten(1).numpy().astype(np.int64)
    return flat[:, 0] + 256 * flat[:, 1]


def all_client_ids(data):
    """Sample ids of every client's train + local test rows, with the owning client."""
    ids, owner = [], []
    for k in range(data.num_clients):
        c = data.client(k)
        assert c.num_train == data.client_sizes()[k]
        for x in (c.x, c.x_test):
            got = ids_of(x)
            ids.append(got)
            owner.append(np.full(len(got), k))
    return np.concatenate(ids), np.concatenate(owner)


def label_of_id(i):
    return (i * 7 + 3) % 10


def make_mnist(root, n_train=120, n_test=30, gz_train=True, gz_test=False, sub="MNIST/raw", prefix=""):
    d = os.path.join(root, sub)
    x = tagged(n_train, (28, 28))
    y = np.array([label_of_id(i) for i in range(n_train)], dtype=np.uint8)
    xt = tagged(n_test, (28, 28), start=1000)
    yt = np.array([label_of_id(i) for i in range(1000, 1000 + n_test)], dtype=np.uint8)
    write_idx(os.path.join(d, f"{prefix}train-images-idx3-ubyte"), x, gz_train)
    write_idx(os.path.join(d, f"{prefix}train-labels-idx1-ubyte"), y, gz_train)
    write_idx(os.path.join(d, f"{prefix}t10k-images-idx3-ubyte"), xt, gz_test)
    write_idx(os.path.join(d, f"{prefix}t10k-labels-idx1-ubyte"), yt, gz_test)
    return x, y, xt, yt


def check_exact_cover(data, pool_ids, labels_by_id):
    ids, owner = all_client_ids(data)
    assert sorted(ids.tolist()) == sorted(pool_ids), "every pool sample must be in exactly one client"
    for k in range(data.num_clients):
        c = data.client(k)
        for x, y in ((c.x, c.y), (c.x_test, c.y_test)):
            assert [labels_by_id[i] for i in ids_of(x)] == y.tolist()
    return ids, owner


# --------------------------------------------------------------------------- the embedded digits


@pytest.mark.parametrize("bundled", [True, False])
def test_digits_read_from_sklearns_file_are_what_load_digits_gives(bundled, monkeypatch):
    """The embedded digits are read from scikit-learn's bundled CSV with numpy (importing
    sklearn.datasets costs seconds per process); where a version keeps the file elsewhere,
    load_digits itself. Either way: its images / 16 as float32, its labels, bit for bit."""
    from sklearn.datasets import load_digits

    import fedhpc.data.digits as digits

    assert digits.bundled_digits_csv() is not None  # the scikit-learn pinned here has it where read
    if not bundled:
        monkeypatch.setattr(digits, "bundled_digits_csv", lambda: None)
    x, y = digits.load_digits_arrays()
    d = load_digits()
    assert x.dtype == np.float32 and x.shape == (1797, 1, 8, 8) and y.dtype == np.int64
    assert np.array_equal(x[:, 0], d.images.astype(np.float32) / 16.0) and np.array_equal(y, d.target)


def test_an_unreadable_bundled_digits_file_is_left_to_load_digits(monkeypatch):
    import fedhpc.data.digits as digits

    def unreadable(*a, **k):
        raise OSError("Permission denied")

    monkeypatch.setattr(digits.np, "loadtxt", unreadable)
    assert digits.bundled_digits_csv() is None


# --------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("partition", ["iid", "dirichlet:0.5", "classes:2"])
def test_mnist_idx_gz_and_plain_every_sample_once(tmp_path, partition):
    make_mnist(tmp_path, gz_train=True, gz_test=False)
    data = build_dataset(cfg_for(tmp_path, "mnist", partition, num_clients=5), opts("mnist", store="memory"))
    assert (data.num_clients, data.num_classes, data.input_shape) == (5, 10, (1, 28, 28))
    labels = {i: label_of_id(i) for i in range(2000)}
    ids, owner = check_exact_cover(data, list(range(120)), labels)
    for k in range(5):
        c = data.client(k)
        assert c.num_test == int((c.num_train + c.num_test) * 0.2)
        if partition == "classes:2":
            assert len(set(c.y.tolist()) | set(c.y_test.tolist())) <= 2
    xt, yt = data.test_slice(0, data.num_test())
    assert ids_of(xt).tolist() == list(range(1000, 1030))
    assert yt.tolist() == [label_of_id(i) for i in range(1000, 1030)]


def test_mnist_all_plain_and_fmnist_folder(tmp_path):
    make_mnist(tmp_path, gz_train=False, gz_test=False, sub="FashionMNIST/raw")
    data = build_dataset(cfg_for(tmp_path, "fmnist", "iid", 3), opts("fmnist", store="memory"))
    check_exact_cover(data, list(range(120)), {i: label_of_id(i) for i in range(200)})


def test_idx_missing_file_names_path_format_and_source(tmp_path):
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "mnist"), None)
    msg = str(e.value)
    assert os.path.join(str(tmp_path), "MNIST", "raw", "train-images-idx3-ubyte") + "[.gz]" in msg
    assert "IDX" in msg and "yann.lecun.com/exdb/mnist" in msg


def test_idx_no_data_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--data-dir"):
        build_dataset(cfg_for("", "mnist"), None)


def test_idx_bad_magic_truncated_and_mismatched(tmp_path):
    make_mnist(tmp_path, gz_train=False, gz_test=False)
    images = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    good = images.read_bytes()

    images.write_bytes(b"<html>not found</html>")
    with pytest.raises(DataError, match="bad magic number") as e:
        build_dataset(cfg_for(tmp_path, "mnist"), opts("mnist", store="memory"))
    assert str(images) in str(e.value)

    images.write_bytes(good[:-100])
    with pytest.raises(DataError, match="truncated"):
        build_dataset(cfg_for(tmp_path, "mnist"), opts("mnist", store="memory"))

    images.write_bytes(good)
    labels = tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    write_idx(str(labels), np.zeros(119, np.uint8), gz=False)
    with pytest.raises(DataError, match="different downloads"):
        build_dataset(cfg_for(tmp_path, "mnist"), opts("mnist", store="memory"))


def test_idx_corrupt_gzip(tmp_path):
    make_mnist(tmp_path, gz_train=True)
    gz = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:50])
    with pytest.raises(DataError, match="cannot be read"):
        build_dataset(cfg_for(tmp_path, "mnist"), opts("mnist", store="memory"))


def test_emnist_letters_transposed_and_shifted(tmp_path):
    n = 60
    upright = tagged(n, (28, 28))
    labels = np.array([1 + (i % 26) for i in range(n)], np.uint8)  # letters are labelled 1..26
    d = tmp_path / "EMNIST" / "raw"
    write_idx(str(d / "emnist-letters-train-images-idx3-ubyte"), upright.transpose(0, 2, 1), gz=True)
    write_idx(str(d / "emnist-letters-train-labels-idx1-ubyte"), labels, gz=True)
    write_idx(str(d / "emnist-letters-test-images-idx3-ubyte"), upright[:10].transpose(0, 2, 1), gz=True)
    write_idx(str(d / "emnist-letters-test-labels-idx1-ubyte"), labels[:10], gz=True)
    data = build_dataset(cfg_for(tmp_path, "emnist", "iid", 3), opts("emnist", split="letters", store="memory"))
    assert data.num_classes == 26
    check_exact_cover(data, list(range(n)), {i: i % 26 for i in range(n)})
    c = data.client(0)
    ids = ids_of(c.x)
    assert np.array_equal(c.x[:, 0].numpy(), upright[ids]), "EMNIST images must come back upright"

    with pytest.raises(ConfigError, match="split"):
        opts("emnist", split="bogus").validate()
    with pytest.raises(DataError, match="emnist-balanced-train-images-idx3-ubyte"):
        build_dataset(cfg_for(tmp_path, "emnist"), opts("emnist", store="memory"))


# --------------------------------------------------------------------------- CIFAR


def cifar_rows(n, start):
    """(n, 3072) rows in CIFAR's plane order; channel 0 pixel 0 / channel 1 pixel 0 carry the id."""
    x = tagged(n, (3, 32, 32), start=start)
    ids = np.arange(start, start + n)
    x[:, 0, 0, 0] = ids % 256
    x[:, 1, 0, 0] = ids // 256
    return x, x.reshape(n, 3072)


def cifar_ids(x):
    x = x.numpy().astype(np.int64)
    return x[:, 0, 0, 0] + 256 * x[:, 1, 0, 0]


def write_cifar10(root, per_batch=12, n_test=10):
    d = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(d, exist_ok=True)
    for b in range(5):
        start = b * per_batch
        _, rows = cifar_rows(per_batch, start)
        batch = {b"batch_label": f"training batch {b + 1} of 5".encode(), b"labels": [i % 10 for i in range(start, start + per_batch)],
                 b"data": rows, b"filenames": [f"img_{i}.png".encode() for i in range(per_batch)]}
        with open(os.path.join(d, f"data_batch_{b + 1}"), "wb") as f:
            pickle.dump(batch, f, protocol=2)
    _, rows = cifar_rows(n_test, 5000)
    with open(os.path.join(d, "test_batch"), "wb") as f:
        pickle.dump({b"batch_label": b"testing batch 1 of 1", b"labels": [i % 10 for i in range(5000, 5000 + n_test)],
                     b"data": rows, b"filenames": [b"x"] * n_test}, f, protocol=2)
    return d


def test_cifar10_pickles_planes_and_partitions(tmp_path):
    write_cifar10(tmp_path)
    for partition in ("iid", "dirichlet:0.3", "classes:3"):
        data = build_dataset(cfg_for(tmp_path, "cifar10", partition, 4), opts("cifar10", store="memory"))
        assert data.input_shape == (3, 32, 32) and data.num_classes == 10
        ids = []
        for k in range(data.num_clients):
            c = data.client(k)
            for x, y in ((c.x, c.y), (c.x_test, c.y_test)):
                got = cifar_ids(x)
                assert (got % 10).tolist() == y.tolist()
                ids.extend(got.tolist())
        assert sorted(ids) == list(range(60))
    xt, yt = data.test_slice(2, 7)
    assert cifar_ids(xt).tolist() == list(range(5002, 5007))
    expected, _ = cifar_rows(10, 5000)
    assert np.array_equal(data.test_slice(0, 10)[0].numpy(), expected)


def write_cifar100(root, n_train=40, n_test=8, test_start=500):
    """cifar-100-python/{train,test} pickles; fine label = id % 100, coarse = id % 20."""
    d = os.path.join(root, "cifar-100-python")
    os.makedirs(d, exist_ok=True)
    for name, n, start in (("train", n_train, 0), ("test", n_test, test_start)):
        _, rows = cifar_rows(n, start)
        with open(os.path.join(d, name), "wb") as f:
            pickle.dump({b"data": rows, b"fine_labels": [i % 100 for i in range(start, start + n)],
                         b"coarse_labels": [i % 20 for i in range(start, start + n)], b"filenames": [b"a"] * n}, f, protocol=2)
    return d


def test_cifar100_fine_and_coarse(tmp_path):
    write_cifar100(str(tmp_path))
    fine = build_dataset(cfg_for(tmp_path, "cifar100", "iid", 2), opts("cifar100", store="memory"))
    coarse = build_dataset(cfg_for(tmp_path, "cifar100", "iid", 2), opts("cifar100", coarse=True, store="memory"))
    assert (fine.num_classes, coarse.num_classes) == (100, 20)
    c, cc = fine.client(1), coarse.client(1)
    assert (cifar_ids(c.x) % 100).tolist() == c.y.tolist()
    assert (cifar_ids(cc.x) % 20).tolist() == cc.y.tolist()


def test_cifar_missing_malformed_and_unsafe(tmp_path):
    d = write_cifar10(tmp_path)
    os.remove(os.path.join(d, "data_batch_3"))
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "cifar10"), opts("cifar10", store="memory"))
    assert os.path.join(d, "data_batch_3") in str(e.value) and "cs.toronto.edu" in str(e.value)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(os.path.join(d, "data_batch_3"), "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f, protocol=2)
    with pytest.raises(DataError, match="not allowed"):
        build_dataset(cfg_for(tmp_path, "cifar10"), opts("cifar10", store="memory"))

    with open(os.path.join(d, "data_batch_3"), "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8)}, f, protocol=2)
    with pytest.raises(DataError, match="'labels'"):
        build_dataset(cfg_for(tmp_path, "cifar10"), opts("cifar10", store="memory"))

    with open(os.path.join(d, "data_batch_3"), "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f, protocol=2)
    with pytest.raises(DataError, match=r"\(N, 3072\)"):
        build_dataset(cfg_for(tmp_path, "cifar10"), opts("cifar10", store="memory"))


# --------------------------------------------------------------------------- TFF HDF5 + LEAF JSON (FEMNIST)

def femnist_label(i):
    """A few classes with several samples each (labels stay below FEMNIST's 62)."""
    return (np.asarray(i) * 7 + 40) % 50 // 5


WRITER_SIZES = {"f0000_14": 7, "f0001_41": 3, "f0002_02": 12, "f0003_33": 5, "f0004_11": 1, "f0005_20": 9}


def femnist_images(writer_index, n, start):
    """uint8 images tagged with sample id (pixels 0,1) and writer (pixel 2)."""
    x = tagged(n, (28, 28), start=start)
    x.reshape(n, -1)[:, 2] = writer_index
    return x


def write_tff_femnist(root, name="fed_emnist", sizes=None):
    """TFF layout: examples/<writer>/pixels float32 in [0, 1] with white background, label int32."""
    os.makedirs(root, exist_ok=True)
    truth = {"train": {}, "test": {}}
    start = 0
    for split in ("train", "test"):
        with h5py.File(os.path.join(root, f"{name}_{split}.h5"), "w") as f:
            ex = f.create_group("examples")
            for w, (writer, n) in enumerate((sizes or WRITER_SIZES).items()):
                n = n if split == "train" else 2
                img = femnist_images(w, n, start)
                g = ex.create_group(writer)
                g.create_dataset("pixels", data=1.0 - img.astype(np.float32) / 255.0)
                g.create_dataset("label", data=femnist_label(np.arange(start, start + n)).astype(np.int32))
                truth[split][writer] = list(range(start, start + n))
                start += n
    return truth


def femnist_check_natural(data, truth, chosen_writers):
    assert data.num_clients == len(chosen_writers)
    names = list(WRITER_SIZES)
    for k in range(data.num_clients):
        c = data.client(k)
        x = np.concatenate([c.x.numpy(), c.x_test.numpy()])
        writer_idx = set(x.reshape(len(x), -1)[:, 2].tolist())
        assert len(writer_idx) == 1, "a natural client holds exactly one writer"
        writer = names[writer_idx.pop()]
        assert writer == chosen_writers[k]
        got = sorted(ids_of(c.x).tolist() + ids_of(c.x_test).tolist())
        assert got == truth["train"][writer]
        assert (femnist_label(ids_of(c.x)) == c.y.numpy()).all()


def test_femnist_tff_natural_partition_one_client_per_writer(tmp_path):
    truth = write_tff_femnist(tmp_path / "femnist")
    eligible = [w for w, n in WRITER_SIZES.items() if n >= 2]  # the 1-sample writer cannot train and test
    data = build_dataset(cfg_for(tmp_path, "femnist", "natural", len(eligible)), opts("femnist", store="memory"))
    assert data.num_classes == 62 and data.input_shape == (1, 28, 28)
    femnist_check_natural(data, truth, eligible)
    # inversion: TFF stores 1 - ink; the tags only survive if the reader inverts correctly
    xt, yt = data.test_slice(0, data.num_test())
    assert sorted(ids_of(xt).tolist()) == sorted(i for v in truth["test"].values() for i in v)

    # the default partition of a naturally federated dataset is 'natural'; subsets are seeded draws
    sub = build_dataset(cfg_for(tmp_path, "femnist", "", 3, seed=4), opts("femnist", store="memory"))
    again = build_dataset(cfg_for(tmp_path, "femnist", "auto", 3, seed=4), opts("femnist", store="memory"))
    writers = []
    for k in range(3):
        x = sub.client(k).x.numpy()
        writers.append(int(x.reshape(len(x), -1)[0, 2]))
        assert np.array_equal(x, again.client(k).x.numpy())
    assert len(set(writers)) == 3 and all(list(WRITER_SIZES)[w] in eligible for w in writers)
    subsets = set()
    for seed in range(6):
        d = build_dataset(cfg_for(tmp_path, "femnist", "natural", 3, seed=seed), opts("femnist", store="memory"))
        subsets.add(tuple(int(d.client(k).x.flatten(1)[0, 2]) for k in range(3)))
    assert len(subsets) > 1, "the subset of writers is a seeded draw, not the first writers"

    with pytest.raises(DataError, match=f"has {len(eligible)} writers"):
        build_dataset(cfg_for(tmp_path, "femnist", "natural", len(eligible) + 1), opts("femnist", store="memory"))


def test_femnist_natural_with_no_writer_large_enough_says_to_check_the_files(tmp_path):
    write_tff_femnist(tmp_path / "femnist", sizes={"f0000_14": 1, "f0001_41": 1, "f0002_02": 1})
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))
    msg = str(e.value)
    assert "femnist has no writer with at least 2 samples (3 writer(s), 1 sample(s) at most" in msg
    assert os.path.join(str(tmp_path), "femnist", "fed_emnist_train.h5") in msg
    assert "--data-dir" in msg and "--partition iid" in msg
    assert "--num-clients 0" not in msg, "no number of clients can help"


@pytest.mark.parametrize("partition", ["iid", "dirichlet:1.0", "classes:5"])
def test_femnist_tff_synthetic_partitions_pool_all_writers(tmp_path, partition):
    truth = write_tff_femnist(tmp_path / "femnist")
    data = build_dataset(cfg_for(tmp_path, "femnist", partition, 4), opts("femnist", store="memory"))
    pool = sorted(i for v in truth["train"].values() for i in v)
    check_exact_cover(data, pool, {i: int(femnist_label(i)) for i in pool})


def test_femnist_tff_errors(tmp_path):
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), None)
    msg = str(e.value)
    assert os.path.join(str(tmp_path), "femnist", "fed_emnist_train.h5") in msg
    assert "tff-datasets-public/fed_emnist.tar.bz2" in msg and "leaf" in msg.lower()

    root = tmp_path / "femnist"
    write_tff_femnist(root)
    with h5py.File(root / "fed_emnist_train.h5", "a") as f:
        del f["examples/f0002_02/pixels"]
    with pytest.raises(DataError, match="no dataset 'pixels'"):
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))
    with h5py.File(root / "fed_emnist_train.h5", "w") as f:
        f.create_group("something_else")
    with pytest.raises(DataError, match="no 'examples' group"):
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))
    (root / "fed_emnist_train.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(DataError, match="cannot be opened as HDF5"):
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))


def write_leaf_femnist(root):
    """LEAF layout: train/*.json and test/*.json, pixels as 784 floats (white background)."""
    names = list(WRITER_SIZES)
    truth, start = {"train": {}, "test": {}}, 0
    for split, files in (("train", [names[:3], names[3:]]), ("test", [names])):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for f_i, writers in enumerate(files):
            doc = {"users": [], "num_samples": [], "user_data": {}}
            for writer in writers:
                n = WRITER_SIZES[writer] if split == "train" else 1
                img = femnist_images(names.index(writer), n, start)
                doc["users"].append(writer)
                doc["num_samples"].append(n)
                doc["user_data"][writer] = {
                    "x": (1.0 - img.reshape(n, 784) / 255.0).tolist(),
                    "y": femnist_label(np.arange(start, start + n)).tolist(),
                }
                truth[split][writer] = list(range(start, start + n))
                start += n
            with open(os.path.join(root, split, f"all_data_{f_i}_niid_0_keep_0_{split}_9.json"), "w") as fh:
                json.dump(doc, fh)
    return truth


def test_femnist_leaf_natural_and_synthetic(tmp_path):
    truth = write_leaf_femnist(tmp_path / "femnist")
    eligible = [w for w, n in WRITER_SIZES.items() if n >= 2]
    data = build_dataset(cfg_for(tmp_path, "femnist", "natural", len(eligible)), opts("femnist", store="memory"))
    femnist_check_natural(data, truth, eligible)
    xt, _ = data.test_slice(0, 100)
    assert sorted(ids_of(xt).tolist()) == sorted(i for v in truth["test"].values() for i in v)
    pool = sorted(i for v in truth["train"].values() for i in v)
    data = build_dataset(cfg_for(tmp_path, "femnist", "dirichlet:0.5", 3), opts("femnist", store="memory"))
    check_exact_cover(data, pool, {i: int(femnist_label(i)) for i in pool})


def test_femnist_only_digits_never_falls_back_to_leaf(tmp_path):
    """LEAF has no digits-only release: with only_digits, LEAF files (or TFF's full files) beside
    a missing digits-only file must be refused, not read as all 62 classes."""
    write_leaf_femnist(tmp_path / "femnist")
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory", only_digits=True))
    msg = str(e.value)
    assert "fed_emnist_digitsonly_train.h5 is missing" in msg and "drop only_digits" in msg
    write_tff_femnist(tmp_path / "femnist")  # the full TFF files: still not the digits-only ones
    with pytest.raises(DataError, match="fed_emnist_digitsonly_train.h5 is missing"):
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory", only_digits=True))
    data = build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))
    assert data.num_classes == 62


def test_leaf_malformed(tmp_path):
    root = tmp_path / "femnist"
    write_leaf_femnist(root)
    bad = root / "train" / "all_data_0_niid_0_keep_0_train_9.json"
    doc = json.loads(bad.read_text())
    doc["num_samples"][0] += 1
    bad.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="num_samples"):
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))
    bad.write_text("{not json")
    with pytest.raises(DataError, match="cannot be parsed as JSON") as e:
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))
    assert "github.com/TalwalkarLab/leaf" in str(e.value)


# --------------------------------------------------------------------------- TFF CIFAR-100


def test_cifar100_tff_natural_hwc_to_chw(tmp_path):
    root = tmp_path / "cifar100_tff"
    root.mkdir()
    truth, start = {}, 0
    for split, clients in (("train", {"0": 6, "1": 4, "2": 5}), ("test", {"0": 3, "7": 2})):
        with h5py.File(root / f"fed_cifar100_{split}.h5", "w") as f:
            for cid, n in clients.items():
                chw = tagged(n, (3, 32, 32), start=start)
                chw[:, 0, 0, 0] = np.arange(start, start + n) % 256
                chw[:, 1, 0, 0] = np.arange(start, start + n) // 256
                g = f.create_group(f"examples/{cid}")
                g.create_dataset("image", data=chw.transpose(0, 2, 3, 1))
                g.create_dataset("label", data=np.arange(start, start + n) % 100)
                g.create_dataset("coarse_label", data=np.arange(start, start + n) % 20)
                if split == "train":
                    truth[cid] = (list(range(start, start + n)), chw)
                start += n
    data = build_dataset(cfg_for(tmp_path, "cifar100_tff", "", 3), opts("cifar100_tff", store="memory"))
    assert data.num_clients == 3 and data.num_classes == 100 and data.input_shape == (3, 32, 32)
    for k, cid in enumerate(["0", "1", "2"]):
        c = data.client(k)
        got = cifar_ids(c.x)
        assert sorted(got.tolist() + cifar_ids(c.x_test).tolist()) == truth[cid][0]
        ids, chw = truth[cid]
        assert np.array_equal(c.x.numpy(), chw[[ids.index(i) for i in got]])
        assert (got % 100).tolist() == c.y.tolist()
    assert data.num_test() == 5
    data = build_dataset(cfg_for(tmp_path, "cifar100_tff", "iid", 2), opts("cifar100_tff", coarse=True, store="memory"))
    assert data.num_classes == 20
    ids = []
    for k in range(2):
        c = data.client(k)
        assert (cifar_ids(c.x) % 20).tolist() == c.y.tolist()
        ids += cifar_ids(c.x).tolist() + cifar_ids(c.x_test).tolist()
    assert sorted(ids) == list(range(15))


# --------------------------------------------------------------------------- Shakespeare

ROLES = {
    "THE_TRAGEDY_OF_KING_LEAR_KENT": ["Good my lord, I do not know.", "Sir, I am too old to learn!"],
    "ALLS_WELL_HELENA": ["O, were that all! I think not on my father;" * 3],
    "HAMLET_HORATIO": ["Hail to your lordship!", "A truant disposition, good my lord. " * 4, "x"],
    "TINY_ROLE": ["Ay."],
}
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def write_tff_shakespeare(root, roles=None):
    """TFF layout: examples/<role>/snippets strings; the test split holds each role's first line six times."""
    os.makedirs(root, exist_ok=True)
    for split in ("train", "test"):
        with h5py.File(os.path.join(root, f"shakespeare_{split}.h5"), "w") as f:
            for role, lines in (roles or ROLES).items():
                lines = lines if split == "train" else [lines[0] * 6]
                f.create_dataset(f"examples/{role}/snippets", data=np.array(lines, dtype=object),
                                 dtype=h5py.string_dtype())


def test_shakespeare_tff_next_char_sequences(tmp_path):
    write_tff_shakespeare(tmp_path / "shakespeare")
    L = 10
    data = build_dataset(cfg_for(tmp_path, "shakespeare", "natural", 3, client_test_fraction=0.25),
                         opts("shakespeare", seq_len=L, store="memory"))
    assert data.task == "next_char" and data.num_classes == 80 and data.input_shape == (L,)
    assert data.transform(data.client(0).x, True, None).dtype.is_floating_point is False
    roles = sorted(r for r, lines in ROLES.items() if (len("\n".join(lines)) - 1) // L >= 2)
    assert data.num_clients == len(roles) == 3
    for k, role in enumerate(roles):
        c = data.client(k)
        text = "\n".join(ROLES[role])
        n_seq = (len(text) - 1) // L
        assert c.num_train + c.num_test == n_seq
        windows = []
        for x, y in ((c.x, c.y), (c.x_test, c.y_test)):
            assert (y[:, :-1] == x[:, 1:].long()).all(), "targets are the inputs shifted by one"
            windows += [decode(rx) + decode(ry)[-1] for rx, ry in zip(x.tolist(), y.tolist())]
        expected = [text[i * L:i * L + L + 1] for i in range(n_seq)]
        assert sorted(windows) == sorted(expected), "non-overlapping chunks of the role's text"
    with pytest.raises(DataError, match="writers"):
        build_dataset(cfg_for(tmp_path, "shakespeare", "natural", 4), opts("shakespeare", seq_len=L, store="memory"))
    pooled = build_dataset(cfg_for(tmp_path, "shakespeare", "iid", 2), opts("shakespeare", seq_len=L, store="memory"))
    total = sum(pooled.client(k).num_train + pooled.client(k).num_test for k in range(2))
    assert total == sum(max((len("\n".join(v)) - 1) // L, 0) for v in ROLES.values())


def test_shakespeare_leaf_json(tmp_path):
    root = tmp_path / "shakespeare"
    text = {"u1": "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
            "u2": "Now is the winter of our discontent Made glorious summer by this sun of York;"}
    for split in ("train", "test"):
        os.makedirs(root / split)
        doc = {"users": list(text), "num_samples": [], "user_data": {}}
        for u, t in text.items():
            xs = [(t * 2)[i:i + 80] for i in range(3)]
            ys = [(t * 2)[i + 80] for i in range(3)]
            doc["user_data"][u] = {"x": xs, "y": ys}
            doc["num_samples"].append(3)
        (root / split / f"all_data_niid_0_keep_0_{split}_9.json").write_text(json.dumps(doc))
    data = build_dataset(cfg_for(tmp_path, "shakespeare", "natural", 2, client_test_fraction=0.0),
                         opts("shakespeare", store="memory"))
    assert data.input_shape == (80,)
    for k, u in enumerate(sorted(text)):
        c = data.client(k)
        src = text[u] * 2
        for i in range(3):
            assert decode(c.x[i].tolist()) == src[i:i + 80]
            assert decode(c.y[i].tolist()) == src[i + 1:i + 81]
    with pytest.raises(ConfigError, match="seq_len"):
        build_dataset(cfg_for(tmp_path, "shakespeare", "natural", 2), opts("shakespeare", seq_len=90, store="memory"))


# --------------------------------------------------------------------------- partitions


def test_natural_partition_needs_a_natural_dataset(tmp_path):
    make_mnist(tmp_path)
    with pytest.raises(DataError, match="naturally federated"):
        build_dataset(cfg_for(tmp_path, "mnist", "natural", 2), opts("mnist", store="memory"))


def test_mix2fld_and_skewed_partitions(tmp_path):
    labels = np.repeat(np.arange(10), 200)
    np.random.default_rng(1).shuffle(labels)
    parts = make_partition("mix2fld", labels, 3, seed=0)
    seen = np.concatenate(parts)
    assert len(seen) == len(set(seen.tolist())) == 3 * (2 * 2 + 8 * 62), "each sample at most once"
    for p in parts:
        counts = np.bincount(labels[p], minlength=10)
        assert sorted(counts.tolist()) == [2, 2] + [62] * 8
    assert make_partition("skewed:2:2:62", labels, 3, seed=0)[1].tolist() == parts[1].tolist()
    parts = make_partition("skewed:1:0:5", labels, 4, seed=3)
    for p in parts:
        assert sorted(np.bincount(labels[p], minlength=10).tolist()) == [0] + [5] * 9
    with pytest.raises(DataError, match="not enough"):
        make_partition("mix2fld", labels, 4, seed=0)
    with pytest.raises(ConfigError, match="M:A:B"):
        make_partition("skewed:2:2", labels, 3, seed=0)

    make_mnist(tmp_path, n_train=400)
    data = build_dataset(cfg_for(tmp_path, "mnist", "skewed:2:1:3", 4, client_test_fraction=0.0),
                         opts("mnist", store="memory"))
    ids, _ = all_client_ids(data)
    assert len(ids) == len(set(ids.tolist())) == 4 * (2 * 1 + 8 * 3)


# --------------------------------------------------------------------------- ImageNet-style tree


def write_image_tree(root, classes=("n01", "n02", "n03"), n_train=4, n_val=2, flat_val=False):
    from PIL import Image

    for split, n in (("train", n_train), ("val", n_val)):
        for c_i, wnid in enumerate(classes):
            d = os.path.join(root, split) if (flat_val and split == "val") else os.path.join(root, split, wnid)
            os.makedirs(d, exist_ok=True)
            for j in range(n):
                colour = (40 + 80 * c_i, 30 + 40 * j, 128)
                Image.new("RGB", (10, 8), colour).save(os.path.join(d, f"{wnid}_{split}_{j}.JPEG"), quality=95)


def test_prepare_imagenet_subset_and_read_it(tmp_path):
    from fedhpc.data.prepare import choose_classes, main

    src, out = tmp_path / "imagenet", tmp_path / "data" / "imagenet200.h5"
    write_image_tree(src)
    assert main(["imagenet200", "--src", str(src), "--out", str(out), "--size", "4", "--seed", "3",
                 "--num-classes", "2", "--workers", "2"]) == 0
    chosen = choose_classes(["n01", "n02", "n03"], 2, 3)
    with h5py.File(out, "r") as f:
        assert [c.decode() for c in f["classes"][()]] == chosen
        x, y = f["train/x"][()], f["train/y"][()]
        assert x.shape == (8, 3, 4, 4) and x.dtype == np.uint8 and f["val/x"].shape == (4, 3, 4, 4)
    # the red channel identifies the class folder, green the image within it
    for img, label in zip(x, y):
        c_i = int(chosen[label][-1]) - 1
        assert abs(int(img[0].mean()) - (40 + 80 * c_i)) <= 6
    assert not [p for p in os.listdir(out.parent) if ".tmp" in p]

    data = build_dataset(cfg_for(tmp_path / "data", "imagenet200", "iid", 2, client_test_fraction=0.0),
                         opts("imagenet200", store="memory"))
    assert data.num_classes == 2 and data.input_shape == (3, 4, 4)
    got = [tuple(int(v) for v in img.float().mean(dim=(1, 2)).round()) for k in range(2) for img in data.client(k).x]
    want = [tuple(int(v) for v in np.round(img.astype(float).mean(axis=(1, 2)))) for img in x]
    assert sorted(got) == sorted(want), "every prepared image in exactly one client"


def test_prepare_errors(tmp_path, capsys):
    from fedhpc.data.prepare import main

    src = tmp_path / "imagenet"
    assert main(["imagenet200", "--src", str(src), "--out", str(tmp_path / "o.h5"), "--workers", "1"]) != 0
    assert os.path.join(str(src), "train") in capsys.readouterr().err
    write_image_tree(src, flat_val=True)
    assert main(["imagenet200", "--src", str(src), "--out", str(tmp_path / "o.h5"), "--workers", "1"]) != 0
    assert "valprep" in capsys.readouterr().err
    src2 = tmp_path / "imagenet2"
    write_image_tree(src2)
    assert main(["imagenet200", "--src", str(src2), "--out", str(tmp_path / "o.h5"), "--workers", "1"]) != 0
    assert "--num-classes" in capsys.readouterr().err
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "imagenet200"), None)
    assert "fedhpc.data.prepare imagenet200" in str(e.value) and "image-net.org" in str(e.value)


# --------------------------------------------------------------------------- malformed values in the published formats


def write_leaf_shakespeare(root):
    """LEAF layout: x an 80-character string, y the character after it; returns the train file."""
    text = {"u1": "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
            "u2": "Now is the winter of our discontent Made glorious summer by this sun of York;"}
    for split in ("train", "test"):
        os.makedirs(root / split)
        doc = {"users": list(text), "num_samples": [3, 3], "user_data": {}}
        for u, t in text.items():
            doc["user_data"][u] = {"x": [(t * 2)[i:i + 80] for i in range(3)], "y": [(t * 2)[i + 80] for i in range(3)]}
        (root / split / f"all_data_niid_0_keep_0_{split}_9.json").write_text(json.dumps(doc))
    return root / "train" / "all_data_niid_0_keep_0_train_9.json"


def _edit_json(path, edit):
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("field, value", [("y", [["a"], ["b"], ["c"]]), ("x", [5, 6, 7]), ("y", ["ab", "c", "d"]),
                                          ("x", [None, "a", "b"]), ("y", [1, 2, 3])])
def test_shakespeare_leaf_values_of_other_types_are_refused(tmp_path, field, value):
    train = write_leaf_shakespeare(tmp_path / "shakespeare")
    _edit_json(train, lambda d: d["user_data"]["u2"].__setitem__(field, value))
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "shakespeare", "natural", 2), opts("shakespeare", store="memory"))
    msg = str(e.value)
    assert str(train) in msg and "user 'u2'" in msg and f"'{field}'[0]" in msg and "TalwalkarLab/leaf" in msg


def test_shakespeare_tff_snippets_that_are_not_strings_are_refused(tmp_path):
    root = tmp_path / "shakespeare"
    write_tff_shakespeare(root)
    with h5py.File(root / "shakespeare_train.h5", "a") as f:
        del f["examples/HAMLET_HORATIO/snippets"]
        f.create_dataset("examples/HAMLET_HORATIO/snippets", data=np.arange(40, dtype=np.int64))
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "shakespeare", "natural", 3), opts("shakespeare", seq_len=10, store="memory"))
    msg = str(e.value)
    assert str(root / "shakespeare_train.h5") in msg and "'HAMLET_HORATIO'" in msg and "'snippets'" in msg
    assert "byte strings" in msg and "tff-datasets-public/shakespeare" in msg


def test_fractional_labels_are_refused_not_truncated(tmp_path):
    root = tmp_path / "femnist"
    write_leaf_femnist(root)
    train = root / "train" / "all_data_0_niid_0_keep_0_train_9.json"
    # whole numbers written as floats are exact: read as they are
    _edit_json(train, lambda d: d["user_data"]["f0000_14"].__setitem__(
        "y", [float(v) for v in d["user_data"]["f0000_14"]["y"]]))
    build_dataset(cfg_for(tmp_path, "femnist", "natural", 5), opts("femnist", store="memory"))
    _edit_json(train, lambda d: d["user_data"]["f0000_14"]["y"].__setitem__(2, 1.7))
    with pytest.raises(DataError, match=r"label 1\.7") as e:
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 5), opts("femnist", store="memory"))
    assert str(train) in str(e.value) and "'f0000_14'" in str(e.value)

    tff = tmp_path / "tff" / "femnist"
    write_tff_femnist(tff)
    with h5py.File(tff / "fed_emnist_train.h5", "a") as f:
        n = len(f["examples/f0002_02/label"])
        del f["examples/f0002_02/label"]
        f.create_dataset("examples/f0002_02/label", data=np.full(n, 2.5, np.float32))
    with pytest.raises(DataError, match=r"label 2\.5") as e:
        build_dataset(cfg_for(tmp_path / "tff", "femnist", "natural", 5), opts("femnist", store="memory"))
    assert "'f0002_02'" in str(e.value)


def test_cifar_string_labels_are_a_data_error(tmp_path):
    d = write_cifar10(tmp_path)
    _, rows = cifar_rows(12, 0)
    with open(os.path.join(d, "data_batch_2"), "wb") as f:
        pickle.dump({b"data": rows, b"labels": ["cat"] * 12}, f, protocol=2)
    with pytest.raises(DataError, match="label 'cat'") as e:
        build_dataset(cfg_for(tmp_path, "cifar10"), opts("cifar10", store="memory"))
    assert os.path.join(d, "data_batch_2") in str(e.value) and "cs.toronto.edu" in str(e.value)


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d.__setitem__("user_data", list(d["user_data"].values())), "'user_data' must be a mapping"),
    (lambda d: d["user_data"]["f0001_41"].__setitem__("x", None), "user 'f0001_41': 'x' must be a list"),
    (lambda d: d["user_data"]["f0001_41"].__setitem__("y", 3), "user 'f0001_41': 'y' must be a list"),
    (lambda d: d.__setitem__("users", "f0000_14"), "'users' must be a list"),
])
def test_leaf_structure_of_other_types_is_a_data_error(tmp_path, edit, problem):
    train, msg = _leaf_train_file_error(tmp_path, edit)
    assert str(train) in msg and problem in msg


def _leaf_train_file_error(tmp_path, edit):
    """(the edited LEAF FEMNIST train file, the DataError its loading raises)."""
    root = tmp_path / "femnist"
    write_leaf_femnist(root)
    train = root / "train" / "all_data_0_niid_0_keep_0_train_9.json"
    _edit_json(train, edit)
    with pytest.raises(DataError) as e:
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))
    return train, str(e.value)


class Py2Pickler(pickle._Pickler):
    """Writes bytes with Python 2's str opcodes, as the published CIFAR batches hold them. (Python 3's
    protocol 2 writes an empty bytes object as a call of ``bytes``, which the reader rightly refuses.)"""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_str(self, obj):
        n = len(obj)
        head = pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)
        self.write(head + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_str


def _empty_test(kind, tmp_path):
    """Each format with a published test file holding no test samples; returns (dataset, options, file)."""
    if kind == "leaf_femnist":
        root = tmp_path / "femnist"
        write_leaf_femnist(root)
        path = root / "test" / "all_data_0_niid_0_keep_0_test_9.json"
        path.write_text(json.dumps({"users": [], "num_samples": [], "user_data": {}}))
        return "femnist", {}, path
    if kind == "tff_femnist":
        root = tmp_path / "femnist"
        write_tff_femnist(root)
        with h5py.File(root / "fed_emnist_test.h5", "w") as f:
            f.create_group("examples")
        return "femnist", {}, root / "fed_emnist_test.h5"
    if kind == "tff_shakespeare":  # snippets too short for one sequence
        root = tmp_path / "shakespeare"
        write_tff_shakespeare(root)
        with h5py.File(root / "shakespeare_test.h5", "w") as f:
            f.create_dataset("examples/HAMLET_HORATIO/snippets", data=np.array(["Ay."], dtype=object),
                             dtype=h5py.string_dtype())
        return "shakespeare", {"seq_len": 10}, root / "shakespeare_test.h5"
    if kind == "cifar10":
        d = write_cifar10(tmp_path)
        with open(os.path.join(d, "test_batch"), "wb") as f:
            Py2Pickler(f, protocol=2).dump({b"data": np.zeros((0, 3072), np.uint8), b"labels": []})
        return "cifar10", {}, os.path.join(d, "test_batch")
    make_mnist(tmp_path, gz_test=False)
    raw = tmp_path / "MNIST" / "raw"
    write_idx(str(raw / "t10k-images-idx3-ubyte"), np.zeros((0, 28, 28), np.uint8), gz=False)
    write_idx(str(raw / "t10k-labels-idx1-ubyte"), np.zeros(0, np.uint8), gz=False)
    return "mnist", {}, raw / "t10k-images-idx3-ubyte"


@pytest.mark.parametrize("store", ["memory", "hdf5"])
@pytest.mark.parametrize("kind", ["leaf_femnist", "tff_femnist", "tff_shakespeare", "cifar10", "mnist"])
def test_an_empty_global_test_set_is_refused_naming_the_file(tmp_path, kind, store):
    dataset, extra, path = _empty_test(kind, tmp_path)
    partitions = ["natural", "iid"] if dataset in ("femnist", "shakespeare") else ["iid"]
    for partition in partitions:
        with pytest.raises(DataError, match="global test set .* is empty") as e:
            build_dataset(cfg_for(tmp_path, dataset, partition, 2),
                          opts(dataset, store=store, store_dir=str(tmp_path / "stores"), **extra))
        assert str(path) in str(e.value)


# --------------------------------------------------------------------------- files found and checked as published


def test_shakespeare_tff_missing_test_file_is_a_data_error_with_a_store(tmp_path):
    """store=hdf5 fingerprints the source files before anything opens them: a missing one must be the
    same DataError as with store=memory (naming the file, its layout and source), not a bare FileNotFoundError."""
    root = tmp_path / "shakespeare"
    write_tff_shakespeare(root)
    (root / "shakespeare_test.h5").unlink()
    for store in ("memory", "hdf5"):
        with pytest.raises(DataError) as e:
            build_dataset(cfg_for(tmp_path, "shakespeare", "natural", 2),
                          opts("shakespeare", seq_len=10, store=store, store_dir=str(tmp_path / "stores")))
        msg = str(e.value)
        assert f"not found: expected {root / 'shakespeare_test.h5'}" in msg, store
        assert "examples/<client_id>/snippets" in msg and "tff-datasets-public/shakespeare" in msg, store


@pytest.mark.parametrize("dataset", ["femnist", "shakespeare"])
def test_leaf_json_under_a_folder_name_with_glob_characters(tmp_path, dataset):
    """The split folder is a path, not a pattern: exp[1] matches 'exp1', not itself."""
    data_dir = tmp_path / "exp[1]*?"
    if dataset == "femnist":
        write_leaf_femnist(data_dir / "femnist")
    else:
        write_leaf_shakespeare(data_dir / "shakespeare")
    data = build_dataset(cfg_for(data_dir, dataset, "natural", 2), opts(dataset, store="memory"))
    assert data.num_clients == 2 and data.num_test() > 0


@pytest.mark.parametrize("source", ["leaf", "tff"])
def test_femnist_pixels_outside_0_1_are_refused_not_clipped(tmp_path, source):
    """LEAF's pixels are greyscale / 255: a 0..255 re-export would be clipped to a black-and-white image."""
    root = tmp_path / "femnist"
    if source == "leaf":
        write_leaf_femnist(root)
        path = root / "train" / "all_data_1_niid_0_keep_0_train_9.json"
    else:
        write_tff_femnist(root)
        path = root / "fed_emnist_train.h5"
    # natural with all 5 eligible writers: TFF reads only the writers drawn as clients
    build_dataset(cfg_for(tmp_path, "femnist", "natural", 5), opts("femnist", store="memory"))  # valid: loads
    for bad, shown in ((255.0, "255"), (-0.5, "-0.5"), (float("nan"), "nan")):
        if source == "leaf":
            doc = json.loads(path.read_text())
            doc["user_data"]["f0003_33"]["x"][1][5] = bad
            path.write_text(json.dumps(doc))  # json writes NaN as NaN, as Python's json reads it
            where = f"{path} user 'f0003_33' ('x')"
        else:
            with h5py.File(path, "a") as f:
                px = f["examples/f0003_33/pixels"][()]
                px[1, 0, 5] = bad
                f["examples/f0003_33/pixels"][...] = px
            where = f"{path} client 'f0003_33' ('pixels')"
        with pytest.raises(DataError) as e:
            build_dataset(cfg_for(tmp_path, "femnist", "natural", 5), opts("femnist", store="memory"))
        msg = str(e.value)
        assert where in msg and shown in msg.lower() and "[0, 1]" in msg, msg
        assert ("TalwalkarLab/leaf" if source == "leaf" else "tff-datasets-public/fed_emnist") in msg
        if source == "leaf":
            write_leaf_femnist(root)
        else:
            write_tff_femnist(root)
    # rounding noise just outside [0, 1] is no sign of another scale: accepted
    if source == "leaf":
        _edit_json(path, lambda d: d["user_data"]["f0003_33"]["x"][1].__setitem__(5, 1.0 + 1e-9))
        build_dataset(cfg_for(tmp_path, "femnist", "natural", 5), opts("femnist", store="memory"))


@pytest.mark.parametrize("edit, problems", [
    (lambda d: d["num_samples"].pop(), ["'num_samples' has 2 entries but 'users' has 3"]),
    (lambda d: d["num_samples"].append(4), ["'num_samples' has 4 entries but 'users' has 3"]),
    (lambda d: (d["users"].pop(1), d["num_samples"].pop(1)),  # was read without writer f0001_41
     ["'user_data' holds user(s) 'f0001_41' not listed in 'users'"]),
    (lambda d: d["user_data"].pop("f0001_41"), ["'users' lists user(s) 'f0001_41' with no 'user_data' entry"]),
    (lambda d: (d["users"].__setitem__(1, "zz"), d["user_data"].__setitem__("yy", {"x": [], "y": []})),
     ["'users' lists user(s) 'zz' with no 'user_data' entry", "'user_data' holds user(s) 'f0001_41', 'yy' not "
      "listed in 'users'"]),
    (lambda d: (d["users"].__setitem__(1, "f0000_14")), ["'users' lists user(s) 'f0000_14' more than once"]),
])
def test_leaf_users_num_samples_and_user_data_must_agree(tmp_path, edit, problems):
    """LEAF writes users, num_samples and user_data in step: a user left out of one of them is refused,
    not dropped (or counted twice) without a word."""
    train, msg = _leaf_train_file_error(tmp_path, edit)
    assert str(train) in msg and "TalwalkarLab/leaf" in msg, msg
    for problem in problems:
        assert problem in msg, msg
    # num_samples is optional (the reader accepts files without it): the other two must still agree
    write_leaf_femnist(tmp_path / "femnist")
    _edit_json(train, lambda d: d.pop("num_samples"))
    build_dataset(cfg_for(tmp_path, "femnist", "natural", 2), opts("femnist", store="memory"))


@pytest.mark.parametrize("train_gz", [True, False])
def test_idx_compression_is_told_by_content_not_name(tmp_path, train_gz):
    """A browser may decompress a .gz download and keep the name, or a copy may lose the suffix."""
    _, _, _, yt = make_mnist(tmp_path, gz_train=train_gz, gz_test=not train_gz)
    raw = tmp_path / "MNIST" / "raw"
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        gz = raw / (stem + ".gz")
        if gz.exists():  # plain IDX bytes under the .gz name
            gz.write_bytes(gzip.decompress(gz.read_bytes()))
        else:  # gzipped bytes under the plain name
            (raw / stem).write_bytes(gzip.compress((raw / stem).read_bytes()))
    for store in ("memory", "hdf5"):
        data = build_dataset(cfg_for(tmp_path, "mnist", "iid", 3),
                             opts("mnist", store=store, store_dir=str(tmp_path / "stores")))
        check_exact_cover(data, list(range(120)), {i: label_of_id(i) for i in range(2000)})
        xs, ys = data.test_slice(0, data.num_test())
        assert ids_of(xs).tolist() == list(range(1000, 1030)) and ys.tolist() == yt.tolist()
