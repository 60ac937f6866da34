"""The per-client HDF5 store: same data as the in-memory path, lazy reads, safe reuse.

Fixtures are written in the published formats (CIFAR-10 pickles, TFF HDF5) and
go through the public builders with ``store=memory`` and ``store=hdf5``.
"""

import multiprocessing as mp
import os
import pickle

import h5py
import numpy as np
import pytest

import torch

from conftest import cfg_for, opts

from fedhpc.data import ArrayFederatedData, build_dataset
from fedhpc.data.store import HDF5ClientStore, build_store_from_arrays, gather_rows
from fedhpc.errors import DataError


def write_cifar10(root, per_batch=20, n_test=16):
    """CIFAR-10 python batches: protocol-2 pickles of {b'data': uint8 (n, 3072), b'labels': [...]}."""
    d = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else per_batch
        batch = {b"batch_label": name.encode(), b"labels": rng.integers(0, 10, n).tolist(),
                 b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"f.png"] * n}
        with open(os.path.join(d, name), "wb") as f:
            pickle.dump(batch, f, protocol=2)


def write_tff_femnist(root, sizes=(5, 9, 3, 12, 7, 4, 6)):
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(1)
    for split in ("train", "test"):
        with h5py.File(os.path.join(root, f"fed_emnist_{split}.h5"), "w") as f:
            for w, n in enumerate(sizes):
                n = n if split == "train" else 2
                g = f.create_group(f"examples/f{w:04d}_00")
                g.create_dataset("pixels", data=rng.random((n, 28, 28), dtype=np.float32))
                g.create_dataset("label", data=rng.integers(0, 62, n).astype(np.int32))


def write_tff_shakespeare(root):
    os.makedirs(root, exist_ok=True)
    lines = {"A": ["Friends, Romans, countrymen, lend me your ears;"] * 3, "B": ["I come to bury Caesar."] * 4,
             "C": ["The evil that men do lives after them;", "The good is oft interred with their bones."]}
    for split in ("train", "test"):
        with h5py.File(os.path.join(root, f"shakespeare_{split}.h5"), "w") as f:
            for role, text in lines.items():
                f.create_dataset(f"examples/{role}/snippets", data=np.array(text, dtype=object),
                                 dtype=h5py.string_dtype())


def write_prepared_imagenet(root, n=120, n_val=30, classes=4):
    """The layout `python -m fedhpc.data.prepare imagenet200` writes (tested in test_formats)."""
    rng = np.random.default_rng(2)
    with h5py.File(os.path.join(root, "imagenet200.h5"), "w") as f:
        f["train/x"] = rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8)
        f["train/y"] = rng.integers(0, classes, n)
        f["val/x"] = rng.integers(0, 256, (n_val, 3, 8, 8), dtype=np.uint8)
        f["val/y"] = rng.integers(0, classes, n_val)
        f.create_dataset("classes", data=np.array([f"n{i:08d}" for i in range(classes)], dtype=object),
                         dtype=h5py.string_dtype())
        f.attrs.update(format="fedhpc-image-subset", num_classes=classes, size=8, seed=0, source="test")


def assert_same_clients(a, b):
    assert a.num_clients == b.num_clients
    assert np.array_equal(a.client_sizes(), b.client_sizes())
    assert (a.name, a.num_classes, a.task, tuple(a.input_shape), a.default_model()) == \
           (b.name, b.num_classes, b.task, tuple(b.input_shape), b.default_model())
    for k in range(a.num_clients):
        ca, cb = a.client(k), b.client(k)
        for field in ("x", "y", "x_test", "y_test"):
            ta, tb = getattr(ca, field), getattr(cb, field)
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), (k, field)
    # the local test splits, one client or several laid end to end (evaluation's batches)
    sizes = np.array([int(a.client(k).y_test.shape[0]) for k in range(a.num_clients)])
    assert np.array_equal(a.client_test_sizes(), sizes) and np.array_equal(b.client_test_sizes(), sizes)
    last = a.num_clients - 1
    for cids in ([], [0], [last, 0], [0, 1, 2], [0, 1, last], [1, last]):
        want = [torch.cat([getattr(a.client(k), f) for k in cids]) if cids else None for f in ("x_test", "y_test")]
        for d in (a, b):
            got = d.client_test_rows(cids)
            assert got[0].shape[0] == got[1].shape[0] == sizes[cids].sum(), (cids, d)
            if cids:
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (cids, d)
    assert a.num_test() == b.num_test()
    for start, stop in ((0, a.num_test()), (3, 7), (a.num_test() - 2, a.num_test() + 5)):
        for ta, tb in zip(a.test_slice(start, stop), b.test_slice(start, stop)):
            assert torch.equal(ta, tb)


@pytest.mark.parametrize("dataset,partition,writer", [
    ("cifar10", "dirichlet:0.5", write_cifar10),
    ("cifar10", "classes:3", write_cifar10),
    ("femnist", "natural", lambda root: write_tff_femnist(os.path.join(root, "femnist"))),
    ("femnist", "iid", lambda root: write_tff_femnist(os.path.join(root, "femnist"))),
    ("shakespeare", "natural", lambda root: write_tff_shakespeare(os.path.join(root, "shakespeare"))),
    ("imagenet200", "dirichlet:0.5", write_prepared_imagenet),
])
def test_hdf5_and_memory_paths_hand_out_identical_clients(tmp_path, dataset, partition, writer):
    writer(str(tmp_path))
    extra = {"seq_len": 8} if dataset == "shakespeare" else {}
    n = 3 if dataset == "shakespeare" else 5
    cfg = cfg_for(tmp_path, dataset, partition, n, seed=3)
    mem = build_dataset(cfg, opts(dataset, store="memory", **extra))
    h5 = build_dataset(cfg, opts(dataset, store="hdf5", store_dir=str(tmp_path / "stores"), **extra))
    assert isinstance(mem, ArrayFederatedData) and isinstance(h5, HDF5ClientStore)
    assert_same_clients(mem, h5)
    batch = h5.client(0).x
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(mem.transform(batch, True, g1), h5.transform(batch, True, g2))
    h5.close()


def test_store_reads_only_the_requested_client(tmp_path, monkeypatch):
    write_cifar10(str(tmp_path))
    cfg = cfg_for(tmp_path, "cifar10", "dirichlet:1.0", 6)
    build_dataset(cfg, opts("cifar10", store="hdf5", store_dir=str(tmp_path / "s"))).close()

    reads = []
    real = h5py.Dataset.read_direct

    def spy(self, dest, source_sel=None, dest_sel=None):
        reads.append((self.name, source_sel))
        return real(self, dest, source_sel, dest_sel)

    getitem_names = []
    real_getitem = h5py.Dataset.__getitem__

    def spy_getitem(self, args, new_dtype=None):
        getitem_names.append(self.name)
        return real_getitem(self, args, new_dtype)

    monkeypatch.setattr(h5py.Dataset, "read_direct", spy)
    monkeypatch.setattr(h5py.Dataset, "__getitem__", spy_getitem)
    store = build_dataset(cfg, opts("cifar10", store="hdf5", store_dir=str(tmp_path / "s")))
    assert isinstance(store, HDF5ClientStore)
    assert reads == [], "opening a store must not read any sample"
    assert not [n for n in getitem_names if n.endswith("/x") or n.endswith("/y")]

    sizes = store.client_sizes()
    k = 4
    c = store.client(k)
    start = int(sizes[:k].sum())
    rows = {name: (sel.start, sel.stop) for name, sel in reads}
    assert rows["/train/x"] == rows["/train/y"] == (start, start + int(sizes[k]))
    assert set(rows) == {"/train/x", "/train/y", "/client_test/x", "/client_test/y"}
    n_read = sum(stop - s for s, stop in rows.values())
    assert n_read == 2 * (c.num_train + c.num_test)

    # consecutive clients' test rows are one read per run, no training row
    reads.clear()
    test_sizes = store.client_test_sizes()
    x, _ = store.client_test_rows([1, 2, 3, 5])
    off = np.concatenate([[0], np.cumsum(test_sizes)])
    assert sorted((name, sel.start, sel.stop) for name, sel in reads) == sorted(
        (f"/client_test/{f}", int(a), int(b)) for f in "xy" for a, b in ((off[1], off[4]), (off[5], off[6])))
    assert x.shape[0] == test_sizes[[1, 2, 3, 5]].sum()
    for read in (store.client, store.client_test_split):  # never a wrapped-around offset
        for cid in (-1, 6):
            with pytest.raises(DataError, match=rf"client {cid} does not exist; the store has clients 0\.\.5"):
                read(cid)
    store.close()


def test_store_is_reused_and_rebuilt_when_its_inputs_change(tmp_path):
    write_cifar10(str(tmp_path))
    store_dir = tmp_path / "stores"
    o = opts("cifar10", store="hdf5", store_dir=str(store_dir))
    a = build_dataset(cfg_for(tmp_path, "cifar10", "iid", 4), o)
    files = sorted(p for p in os.listdir(store_dir) if p.endswith(".h5"))
    assert len(files) == 1
    stat = os.stat(store_dir / files[0])
    b = build_dataset(cfg_for(tmp_path, "cifar10", "iid", 4), o)
    stat2 = os.stat(store_dir / files[0])
    assert (stat.st_ino, stat.st_mtime_ns) == (stat2.st_ino, stat2.st_mtime_ns), "a matching store is reused"
    assert_same_clients(a, b)

    for changed in (cfg_for(tmp_path, "cifar10", "iid", 4, seed=1), cfg_for(tmp_path, "cifar10", "iid", 5),
                    cfg_for(tmp_path, "cifar10", "dirichlet:0.5", 4),
                    cfg_for(tmp_path, "cifar10", "iid", 4, client_test_fraction=0.5)):
        build_dataset(changed, o)
    assert len([p for p in os.listdir(store_dir) if p.endswith(".h5")]) == 5
    assert not [p for p in os.listdir(store_dir) if ".tmp" in p]

    # a new source file (same name, different bytes) must not be served from the old store
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    with open(batch, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    d[b"data"] = 255 - d[b"data"]
    d[b"data"] = np.concatenate([d[b"data"], d[b"data"][:1]])
    d[b"labels"] = d[b"labels"] + [0]
    with open(batch, "wb") as f:
        pickle.dump(d, f, protocol=2)
    c = build_dataset(cfg_for(tmp_path, "cifar10", "iid", 4), o)
    mem = build_dataset(cfg_for(tmp_path, "cifar10", "iid", 4), opts("cifar10", store="memory"))
    assert_same_clients(c, mem)
    assert c.client_sizes().sum() + sum(c.client(k).num_test for k in range(4)) == 101

    # a truncated store under the expected name is rebuilt, not trusted
    path = c.path
    c.close()
    with open(path, "r+b") as f:
        f.truncate(2048)
    again = build_dataset(cfg_for(tmp_path, "cifar10", "iid", 4), o)
    assert_same_clients(again, mem)


def _client_checksums(store):
    return [int(store.client(k).x.numpy().sum(dtype=np.int64)) for k in range(store.num_clients)]


def _single_threaded_torch():
    # torch's OpenMP pool does not survive fork once the parent used it (a torch limitation,
    # not the store's): forked workers run torch single-threaded.
    torch.set_num_threads(1)


def _read_all(args):
    store, order = args
    return [(k, int(store.client(k).x.numpy().sum(dtype=np.int64))) for k in order]


_INHERITED = {}


def _read_inherited(order):
    """Uses the store object the child inherited through fork (its handle is the parent's)."""
    store = _INHERITED["store"]
    inherited = store._pid != os.getpid()
    return inherited, [(k, int(store.client(k).x.numpy().sum(dtype=np.int64))) for k in order]


def test_store_survives_fork_pickle_and_concurrent_readers(tmp_path):
    write_cifar10(str(tmp_path))
    store = build_dataset(cfg_for(tmp_path, "cifar10", "iid", 8),
                          opts("cifar10", store="hdf5", store_dir=str(tmp_path / "s")))
    expected = _client_checksums(store)  # the parent has the file open before forking
    _INHERITED["store"] = store
    with mp.get_context("fork").Pool(2, initializer=_single_threaded_torch) as pool:
        inherited = pool.map(_read_inherited, [list(range(8)), list(range(7, -1, -1))] * 2)
        results = pool.map(_read_all, [(store, list(range(8))), (store, list(range(7, -1, -1)))] * 2)
    _INHERITED.clear()
    assert any(flag for flag, _ in inherited), "children started from the parent's open handle"
    results += [res for _, res in inherited]
    for res in results:
        assert sorted(res) == sorted(enumerate(expected))
    clone = pickle.loads(pickle.dumps(store))
    assert _client_checksums(clone) == expected
    assert _client_checksums(store) == expected  # the parent's handle still works
    store.close()
    clone.close()


def _build(args):
    data_dir, store_dir = args
    store = build_dataset(cfg_for(data_dir, "cifar10", "dirichlet:0.5", 6),
                          opts("cifar10", store="hdf5", store_dir=store_dir))
    return store.path, _client_checksums(store)


def test_concurrent_builders_produce_one_store(tmp_path):
    write_cifar10(str(tmp_path))
    with mp.get_context("fork").Pool(3, initializer=_single_threaded_torch) as pool:
        results = pool.map(_build, [(str(tmp_path), str(tmp_path / "s"))] * 3)
    assert len({r[0] for r in results}) == 1 and len({tuple(r[1]) for r in results}) == 1
    assert [p for p in os.listdir(tmp_path / "s") if not p.endswith(".lock")] == [os.path.basename(results[0][0])]


def test_auto_store_choice_and_unwritable_store_dir(tmp_path):
    write_cifar10(str(tmp_path))
    cfg = cfg_for(tmp_path, "cifar10", "iid", 3)
    small = build_dataset(cfg, opts("cifar10", store="auto", store_threshold_mb=100.0))
    big = build_dataset(cfg, opts("cifar10", store="auto", store_threshold_mb=0.0, store_dir=str(tmp_path / "s")))
    assert isinstance(small, ArrayFederatedData) and isinstance(big, HDF5ClientStore)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(DataError, match="store_dir"):
        build_dataset(cfg, opts("cifar10", store="hdf5", store_dir=str(blocker / "stores")))
    default = build_dataset(cfg, opts("cifar10", store="hdf5"))
    assert os.path.dirname(default.path) == os.path.join(str(tmp_path), "fedhpc_stores")


def test_auto_store_counts_targets_of_next_char_pools(tmp_path):
    """Shakespeare's y is as large as its x: a pool whose x alone fits the threshold goes to hdf5."""
    from fedhpc.data.readers.natural import ShakespeareReader

    root = tmp_path / "shakespeare"
    write_tff_shakespeare(str(root))
    cfg = cfg_for(tmp_path, "shakespeare", "natural", 3)
    reader = ShakespeareReader(cfg, opts("shakespeare", seq_len=8), str(root), "tff")
    pool = reader.load_pool()
    assert reader.estimate_bytes() == pool.x.nbytes + pool.y.nbytes
    between = (pool.x.nbytes + pool.y.nbytes // 2) / 2 ** 20  # over x, under x + y
    data = build_dataset(cfg, opts("shakespeare", seq_len=8, store="auto", store_threshold_mb=between,
                                   store_dir=str(tmp_path / "s")))
    assert isinstance(data, HDF5ClientStore)
    data.close()


def test_build_store_from_lazy_hdf5_pool(tmp_path):
    """Pools too big for memory are read from an h5py dataset by runs of rows."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (300, 3, 4, 4), dtype=np.uint8)
    y = rng.integers(0, 7, 300)
    # scattered rows (runs of several lengths) and one contiguous block
    parts = [np.sort(rng.choice(np.arange(k, 250, 5), 30, replace=False)) for k in range(5)] + [np.arange(250, 300)]
    # the two are twins for parts in any order (a client's rows are its indices in pool order)
    parts = [rng.permutation(p) for p in parts]
    with h5py.File(tmp_path / "pool.h5", "w") as f:
        f["x"], f["y"] = x, y
    with h5py.File(tmp_path / "pool.h5", "r") as f:
        store = build_store_from_arrays(str(tmp_path / "s.h5"), {"dataset": "t"}, f["x"], y, f["x"], y,
                                        parts, name="t", num_classes=7, client_test_fraction=0.25, seed=2)
    mem = ArrayFederatedData("t", x, y, x, y, parts, num_classes=7, client_test_fraction=0.25, seed=2)
    assert np.array_equal(store.test_slice(0, 300)[0].numpy(), x)
    for k in range(6):
        for field in ("x", "y", "x_test", "y_test"):
            assert torch.equal(getattr(store.client(k), field), getattr(mem.client(k), field))
    with pytest.raises(DataError, match="does not exist"):
        store.client(6)
    store.close()


@pytest.mark.parametrize("idx", [
    [0, 1, 2, 3], [2, 3, 7, 8, 9, 15],  # sorted: one slice, one slice per run
    [0, 2, 1, 3],  # spans 4 rows without being rows 0..3
    [15, 9, 8, 7, 3, 0], [5, 5, 6, 6, 2, 5], [4, 9, 4], [], [11],
])
def test_gather_rows_from_hdf5_matches_numpy_indexing(tmp_path, idx):
    rng = np.random.default_rng(6)
    x = rng.integers(0, 256, (16, 2, 3), dtype=np.uint8)
    with h5py.File(tmp_path / "rows.h5", "w") as f:
        f["x"] = x
    idx = np.array(idx, dtype=np.int64)
    with h5py.File(tmp_path / "rows.h5", "r") as f:
        got = gather_rows(f["x"], idx)
    assert got.dtype == x.dtype and np.array_equal(got, x[idx])
