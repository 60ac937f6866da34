"""XorMixFL family (XOR Mixup paper 003): uint8 codec, blending, balancing, MDS privacy, the server's base set.

Every equation is checked against an independent computation: Python integer loops for
blending and XOR, hand counts for balancing, a loop-by-loop classical MDS (numpy's
eigensolver on the Gram matrix of centred points) for Table 3's distance.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from fedhpc.algorithms.oneshot import balance_deficits, keep_until_balanced, split_requests
from fedhpc.algorithms.sample_codecs import EncodedSet, blend, encode_device, from_pixels, mix_encode, to_pixels, xor_chain, xor_decode
from fedhpc.analysis.privacy import classical_mds, mds_min_distances, pixel_min_distances
from fedhpc.config import parse_args
from fedhpc.data import build_dataset
from fedhpc.data.partition import make_partition, server_set_request
from fedhpc.data.base import ServerDataOptions
from fedhpc.errors import ConfigError, DataError

DIGITS = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--seed", "3"]
SERVER = ["--data-opt", "server_per_label=30", "--data-opt", "server_deficient=0,2",
          "--data-opt", "server_deficient_count=4"]


def data_of(argv):
    cfg, _, do = parse_args(argv)
    return build_dataset(cfg, do)


# ----------------------------------------------------------------------------- uint8 pixel domain

def test_pixels_are_exact_for_uint8_and_quantised_floats():
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 256, (5, 1, 4, 4), generator=g, dtype=torch.uint8)
    assert to_pixels(u) is u and from_pixels(u, torch.uint8) is u       # no float round trip at all
    f = u.float() / 255                                                   # uint8-origin floats: exact both ways
    assert torch.equal(to_pixels(f), u)
    assert torch.equal(to_pixels(from_pixels(u, torch.float32)), u)
    digits = torch.arange(17, dtype=torch.float32) / 16                   # digits' 0..16 levels
    assert to_pixels(digits).tolist() == [round(k * 255 / 16) for k in range(17)]
    with pytest.raises(DataError, match="raw pixels"):
        to_pixels(torch.tensor([-0.4, 1.2]))                              # a normalised store is refused


# ----------------------------------------------------------------------------- blending (Eq. 1)

def hand_blend(samples, alpha):
    rows = [[int(v) for v in s.reshape(-1).tolist()] for s in samples]
    out = rows[0]
    for r in rows[1:]:
        out = [max(0, min(255, math.floor(alpha * a + (1 - alpha) * b))) for a, b in zip(out, r)]
    return out


@pytest.mark.parametrize("alpha", [0.25, 0.5, 0.95])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_blend_of_m_samples_equals_a_hand_loop(alpha, m):
    g = torch.Generator().manual_seed(m)
    s = torch.randint(0, 256, (m, 3, 5), generator=g, dtype=torch.uint8)
    got = blend(s, alpha)
    assert got.dtype == torch.uint8 and got.shape == (3, 5)
    assert got.reshape(-1).tolist() == hand_blend(s, alpha)


def test_saturating_sum_blend_equals_a_hand_sum_capped_at_255():
    g = torch.Generator().manual_seed(11)
    s = torch.randint(0, 100, (4, 3, 5), generator=g, dtype=torch.uint8)   # sums of 0..396
    got = blend(s, 0.3, "saturating_sum")
    rows = [[int(v) for v in r.reshape(-1).tolist()] for r in s]
    assert got.dtype == torch.uint8 and got.reshape(-1).tolist() == [min(255, sum(c)) for c in zip(*rows)]
    assert 0 < int((got == 255).sum()) < got.numel()      # both sides of the cap are exercised
    assert torch.equal(blend(s[:1], 0.3, "saturating_sum"), s[0])
    with pytest.raises(DataError, match="unknown blend rule 'sum'"):
        blend(s, 0.3, "sum")

def test_two_sample_blend_is_the_authors_truncated_average():
    a = torch.tensor([0, 1, 255, 7], dtype=torch.uint8)
    b = torch.tensor([1, 2, 254, 8], dtype=torch.uint8)
    assert blend(torch.stack([a, b]), 0.5).tolist() == [(int(x) + int(y)) // 2 for x, y in zip(a, b)]


# ----------------------------------------------------------------------------- XOR codec (Eqs. 2-3)

def test_xor_chain_is_bitwise_and_its_own_inverse():
    g = torch.Generator().manual_seed(1)
    t, d1, d2 = (torch.randint(0, 256, (2, 6), generator=g, dtype=torch.uint8) for _ in range(3))
    e = xor_chain(t, [d1, d2])
    hand = [[a ^ b ^ c for a, b, c in zip(r0, r1, r2)] for r0, r1, r2 in zip(t.tolist(), d1.tolist(), d2.tolist())]
    assert e.tolist() == hand
    assert torch.equal(xor_chain(e, [d1, d2]), t)          # same dummy blends: bit identity
    assert torch.equal(xor_chain(e, [d2, d1]), t)          # XOR commutes
    assert not torch.equal(xor_chain(e, [d1]), t)


def toy_device(seed=0, n_per_label=6, labels=(0, 1, 2, 3)):
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor([c for c in labels for _ in range(n_per_label)])
    x = torch.randint(0, 256, (len(y), 1, 4, 4), generator=g, dtype=torch.uint8)
    return x, y


def test_encoded_sample_is_the_xor_of_blends_of_its_recorded_sources():
    x, y = toy_device()
    g = torch.Generator().manual_seed(7)
    enc = encode_device(x, y, {0: 3, 2: 2}, [0, 2], num_dummy=2, max_blend=3, alpha=0.25, generator=g, cid=4)
    assert len(enc) == 5 and enc.target.tolist() == [0, 0, 0, 2, 2] and (enc.owner == 4).all()
    for i in range(len(enc)):
        rows = enc.source_index[i].tolist()
        t_rows, d_rows = rows[:3], [rows[3:6], rows[6:9]]
        assert all(int(y[r]) == int(enc.target[i]) for r in t_rows)      # M = 3 target samples
        for d, dr in zip(enc.dummies[i].tolist(), d_rows):
            assert d not in (0, 2) and all(int(y[r]) == d for r in dr)   # dummies: non-target labels
        hand = hand_blend(x[t_rows], 0.25)
        for dr in d_rows:
            hand = [a ^ b for a, b in zip(hand, hand_blend(x[dr], 0.25))]
        assert enc.x[i].reshape(-1).tolist() == hand


def test_a_blend_takes_up_to_m_samples_of_what_the_device_holds():
    """"Up to M samples" a label: a device holding 2 target samples blends 2 at M = 5 (M's axis stops
    there), 5 of a label it holds 6 of; blend_sizes records it, the sources agree."""
    x, y = toy_device(labels=(1, 2, 3))
    x0, _ = toy_device(seed=1, n_per_label=2, labels=(0,))
    x, y = torch.cat([x0, x]), torch.cat([torch.zeros(2, dtype=torch.long), y])
    g = torch.Generator().manual_seed(9)
    enc = encode_device(x, y, {0: 4}, [0], num_dummy=2, max_blend=5, alpha=0.5, generator=g, cid=1)
    assert enc.blend_sizes.tolist() == [[2, 5, 5]] * 4
    assert ((enc.source_index >= 0).sum(1) == 12).all()
    for i in range(len(enc)):
        assert sorted(enc.source_index[i, :2].tolist()) == [0, 1]                 # both target samples
    both = EncodedSet.cat([enc, encode_device(x, y, {0: 1}, [0], num_dummy=2, max_blend=1, alpha=0.5,
                                               generator=g, cid=2)])
    assert both.blend_sizes.tolist() == [[2, 5, 5]] * 4 + [[1, 1, 1]]
    assert both.select(torch.tensor([4, 0])).blend_sizes.tolist() == [[1, 1, 1], [2, 5, 5]]

def test_a_dummy_pool_fixes_the_dummy_labels():
    x, y = toy_device()
    g = torch.Generator().manual_seed(8)
    enc = encode_device(x, y, {0: 6}, [0], num_dummy=1, max_blend=2, alpha=0.5, generator=g, cid=0, dummy_pool=[3, 0])
    assert enc.dummies.flatten().tolist() == [3] * 6          # the target is never a dummy, even when listed
    with pytest.raises(DataError, match="dummy"):
        encode_device(x, y, {0: 1}, [0], num_dummy=2, max_blend=2, alpha=0.5, generator=g, cid=0, dummy_pool=[3])


def test_decoding_is_bit_exact_when_the_server_blend_matches_and_noisy_when_not():
    x, y = toy_device(n_per_label=1)           # one sample per label: blends are the raw samples
    g = torch.Generator().manual_seed(0)
    enc = encode_device(x, y, {0: 2}, [0], num_dummy=1, max_blend=1, alpha=0.5, generator=g, cid=0)
    # the server holds the very dummy samples the device used: decoding restores the target bit for bit
    dec, rows = xor_decode(enc, x, y, 1, 0.5, torch.Generator().manual_seed(1))
    for i in range(len(enc)):
        assert torch.equal(dec[i], x[y == 0][0])
    # a server with its own (different) base samples: every decoded sample differs from every raw sample
    sx, sy = toy_device(seed=9, n_per_label=5)
    dec, rows = xor_decode(enc, sx, sy, 2, 0.5, torch.Generator().manual_seed(2))
    assert rows.shape == (2, 2) and all(int(sy[r]) == int(enc.dummies[i, 0]) for i in range(2) for r in rows[i])
    raw = torch.cat([x, sx]).reshape(len(x) + len(sx), -1)
    for d in dec.reshape(len(dec), -1):
        assert bool((raw != d).any(dim=1).all()), "a decoded sample equals a raw sample"


def test_mix_encoding_and_soft_labels_follow_the_ratio():
    x, y = toy_device()
    g = torch.Generator().manual_seed(3)
    enc = encode_device(x, y, {1: 2}, [1], num_dummy=2, max_blend=2, alpha=0.5, generator=g, cid=0, kind="mix",
                        lam=0.6, num_classes=5)
    for i in range(2):
        rows = enc.source_index[i].tolist()
        bt, bd = hand_blend(x[rows[:2]], 0.5), [hand_blend(x[rows[2:4]], 0.5), hand_blend(x[rows[4:6]], 0.5)]
        hand = [math.floor(0.6 * a + 0.2 * b + 0.2 * c) for a, b, c in zip(bt, *bd)]
        got = enc.x[i].reshape(-1).tolist()
        assert max(abs(p - q) for p, q in zip(got, hand)) <= 1     # float summation order at a floor boundary
        soft = enc.soft[i]
        assert abs(float(soft[1]) - 0.6) < 1e-12 and abs(float(soft.sum()) - 1) < 1e-12
        assert all(abs(float(soft[d]) - 0.2) < 1e-12 for d in enc.dummies[i].tolist())
    assert torch.equal(mix_encode(x[0], [x[1]], 1.0), x[0])


# ----------------------------------------------------------------------------- balancing

def test_balancing_count_against_a_hand_count():
    counts = [200, 10, 200, 37, 200]
    assert balance_deficits(counts) == {1: 190, 3: 163}
    req = split_requests(190, [5, 1, 3])
    assert req == {1: 64, 3: 63, 5: 63} and sum(req.values()) == 190
    assert split_requests(2, [0, 1, 2]) == {0: 1, 1: 1}
    assert split_requests(7, [2, 4], per_device=5) == {2: 5, 4: 5}
    target = torch.tensor([1, 3, 1, 1, 3, 3, 3])
    assert keep_until_balanced(target, {1: 2, 3: 3}).tolist() == [0, 1, 2, 4, 5]


@pytest.mark.parametrize("algo", ["xormixfl", "mixfl"])
def test_one_shot_run_balances_the_server_and_audits_the_uploads(algo, tmp_path):
    from fedhpc.engine import Engine
    from fedhpc.world import World

    argv = ["--algo", algo, *DIGITS, "--clients-per-round", "6", "--rounds", "1", "--model", "mlp",
            "--partition", "deficient:0,2:2:10", *SERVER, "--server-epochs", "1", "--threads", "1", "--quiet",
            "--no-tensorboard", "--per-label-accuracy", "--out", str(tmp_path / "r")]
    argv += ["--mix-lam", "0.7"] if algo == "mixfl" else []   # the soft label's argmax is then the target
    cfg, ao, do = parse_args(argv)
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.algo.round_begin(type("R", (), {"index": 0, "sampled": list(range(6))})())
    x, y = eng.algo.train_set
    hard = y.argmax(1) if y.is_floating_point() else y
    assert torch.bincount(hard, minlength=10).tolist() == [30] * 10     # 4 + 26 decoded for labels 0 and 2
    m = eng.algo.metrics
    assert m["decoded_added"] == 52 and m["encoded_uploaded"] == 52 and m["server_balanced"] == 1
    assert m["uploads_equal_raw"] == 0 and m["upload_linear_mix"] == (1.0 if algo == "mixfl" else 0.0)
    assert m["privacy_mds_mean"] > 0 and m["privacy_pixel_mean"] > 0
    # each device's upload is booked at its own encoded samples' bytes (a brute-force selection
    # of the collected set; devices are asked for different counts here)
    booked = dict(eng.algo.upload_bytes)
    enc, _ = eng.algo.collect(type("R", (), {"index": 0, "sampled": list(range(6))})())
    by_hand = {cid: enc.select((enc.owner == cid).nonzero().flatten()).wire_bytes() for cid in range(6)}
    assert booked == {cid: b for cid, b in by_hand.items() if b} and len(set(booked.values())) > 1
    # "up to M" (= 2) samples of the target: all a device holds where it holds fewer (a hand count)
    held = [int((eng.data.client(c).y == t).sum()) for c, t in zip(enc.owner.tolist(), enc.target.tolist())]
    assert m["blend_target_mean"] == pytest.approx(np.mean([min(2, h) for h in held])) and min(held) < 2 <= max(held)
    assert m["blend_dummy_mean"] == 2


def test_the_blend_rule_reaches_the_devices_and_the_servers_blends(tmp_path, monkeypatch):
    """--blend-rule saturating_sum through the engine: every upload is the XOR of its sources' capped
    sums (recomputed from the device's raw rows), and the server decodes with the same rule."""
    from fedhpc.algorithms.oneshot import xormixfl
    from fedhpc.engine import Engine
    from fedhpc.world import World

    seen = []
    real_decode = xormixfl.xor_decode
    monkeypatch.setattr(xormixfl, "xor_decode", lambda *a, **k: seen.append(a[6:] + tuple(k.values())) or real_decode(*a, **k))
    argv = ["--algo", "xormixfl", *DIGITS, "--clients-per-round", "6", "--rounds", "1", "--model", "mlp",
            "--partition", "deficient:0:4:10", *SERVER, "--data-opt", "server_deficient=0", "--server-epochs", "1",
            "--max-blend", "3", "--blend-rule", "saturating_sum", "--threads", "1", "--quiet", "--no-tensorboard",
            "--out", str(tmp_path / "r")]
    cfg, ao, do = parse_args(argv)
    eng = Engine(cfg, ao, do, World(threads=1))
    enc, _ = eng.algo.collect(type("R", (), {"index": 0, "sampled": list(range(6))})())
    assert len(enc) > 0 and (enc.blend_sizes[:, 1] == 3).all() and (enc.blend_sizes[:, 0] >= 2).all()
    for i in range(len(enc)):
        raw = to_pixels(eng.data.client(int(enc.owner[i])).x).to(torch.int64)
        rows, start, want = enc.source_index[i].tolist(), 0, None
        for size in enc.blend_sizes[i].tolist():  # target, then the dummy
            part = raw[rows[start: start + size]].sum(0).clamp(max=255)
            want, start = (part if want is None else want ^ part), start + size
        assert torch.equal(enc.x[i].to(torch.int64), want)
    eng.algo.round_begin(type("R", (), {"index": 0, "sampled": list(range(6))})())
    assert seen == [("saturating_sum",)]

def test_the_audit_flags_an_upload_that_is_a_raw_sample(tmp_path):
    # MixFL with lam = 1 and no blending sends the raw target sample itself: the audit must see it
    from fedhpc.engine import Engine
    from fedhpc.world import World

    argv = ["--algo", "mixfl", *DIGITS, "--clients-per-round", "6", "--rounds", "1", "--model", "mlp",
            "--partition", "iid", *SERVER, "--server-epochs", "1", "--mix-lam", "1.0", "--max-blend", "1",
            "--threads", "1", "--quiet", "--no-tensorboard"]
    cfg, ao, do = parse_args(argv)
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.algo.round_begin(type("R", (), {"index": 0, "sampled": list(range(6))})())
    m = eng.algo.metrics
    assert m["uploads_equal_raw"] == m["encoded_uploaded"] > 0 and m["privacy_pixel_mean"] == 0


def test_no_encoded_upload_names_both_causes(tmp_path):
    # no device holds a target label (A = 0); --cold-start-fraction, which holds devices out of the
    # upload, is the other way to get here, so the error names both fixes
    from fedhpc.engine import Engine
    from fedhpc.world import World

    cfg, ao, do = parse_args(["--algo", "xormixfl", *DIGITS, "--clients-per-round", "6", "--rounds", "1",
                              "--model", "mlp", "--partition", "deficient:0,2:0:10", *SERVER, "--server-epochs", "1",
                              "--threads", "1", "--quiet", "--no-tensorboard"])
    eng = Engine(cfg, ao, do, World(threads=1))
    with pytest.raises(DataError, match=r"no training device holds a target label.*--cold-start-fraction"):
        eng.algo.round_begin(type("R", (), {"index": 0, "sampled": list(range(6))})())


@pytest.mark.parametrize("algo", ["xormixfl", "mixfl"])
def test_a_dataset_without_pixels_is_refused_before_any_upload(algo):
    # the synthetic dataset's Gaussian images are no pixels: refused when built, naming the dataset
    from fedhpc.engine import Engine
    from fedhpc.world import World

    cfg, ao, do = parse_args(["--algo", algo, "--dataset", "synthetic", "--data-opt", "shape=1x8x8", "--model", "mlp",
                              "--num-clients", "4", "--clients-per-round", "2", *SERVER, "--threads", "1", "--quiet",
                              "--no-tensorboard"])
    with pytest.raises(ConfigError, match=r"encodes image pixels, which dataset 'synthetic' does not hold: .*"
                                          r"values in \[-.*--dataset digits"):
        Engine(cfg, ao, do, World(threads=1))


def test_one_shot_algorithms_need_the_server_set():
    from fedhpc.engine import Engine
    from fedhpc.world import World

    # a bare run gets the digits twin's base set (fedhpc.config.auto); one that sets the base set
    # to nothing is refused, by the option's name
    cfg, ao, do = parse_args(["--algo", "xormixfl", *DIGITS, "--clients-per-round", "2", "--quiet",
                              "--no-tensorboard", "--threads", "1"])
    assert do.server_per_label > 0
    cfg, ao, do = parse_args(["--algo", "xormixfl", *DIGITS, "--clients-per-round", "2", "--quiet",
                              "--no-tensorboard", "--threads", "1", "--data-opt", "server_per_label=0"])
    with pytest.raises(ConfigError, match="server_per_label"):
        Engine(cfg, ao, do, World(threads=1))


@pytest.mark.parametrize("algo", ["xormixfl", "mixfl"])
def test_a_balanced_server_set_is_refused_before_any_upload(algo):
    """A server set with every label at server_per_label lacks nothing: the devices would be asked for
    no sample, which round 1 used to report as 'no training device holds a target label'."""
    from fedhpc.engine import Engine
    from fedhpc.world import World

    cfg, ao, do = parse_args(["--algo", algo, *DIGITS, "--clients-per-round", "2", "--model", "mlp",
                              "--data-opt", "server_per_label=10", "--threads", "1", "--quiet", "--no-tensorboard"])
    with pytest.raises(ConfigError, match=r"holds 10 of every label, so it lacks none; name its target labels "
                                          r"with --data-opt server_deficient=L1,L2"):
        Engine(cfg, ao, do, World(threads=1))


# ----------------------------------------------------------------------------- MDS privacy (Table 3)

def brute_force_mds(points, dims):
    """Classical MDS the long way: Gram matrix of the centred points, numpy's eigensolver, loops."""
    p = [np.asarray(v, dtype=np.float64).reshape(-1) for v in points]
    n = len(p)
    mean = sum(p) / n
    c = [v - mean for v in p]
    gram = np.array([[float(np.dot(c[i], c[j])) for j in range(n)] for i in range(n)])
    w, v = np.linalg.eigh(gram)
    order = np.argsort(-w)[:dims]
    return v[:, order] * np.sqrt(np.clip(w[order], 0, None))


def test_mds_min_distance_against_brute_force():
    g = torch.Generator().manual_seed(4)
    samples = torch.randint(0, 256, (4, 1, 3, 3), generator=g, dtype=torch.uint8)
    sources = [torch.randint(0, 256, (k, 1, 3, 3), generator=g, dtype=torch.uint8) for k in (1, 2, 3, 2)]
    sources[3][0] = sources[1][1]            # a raw sample shared by two augmented samples: one point
    for dims in (1, 2, 3):
        got = mds_min_distances(samples, sources, dims=dims)
        pts, seen = [], {}
        for t in [samples[i] for i in range(4)] + [s[j] for s in sources for j in range(len(s))]:
            key = tuple(t.reshape(-1).tolist())
            if key not in seen:
                seen[key] = len(pts)
                pts.append(key)
        y = brute_force_mds(pts, dims)
        per = []
        for i in range(4):
            me = y[seen[tuple(samples[i].reshape(-1).tolist())]]
            per.append(min(math.dist(me, y[seen[tuple(s.reshape(-1).tolist())]]) for s in sources[i]))
        assert abs(got.mean - np.mean(per)) < 1e-6 * max(1, np.mean(per))
        assert abs(got.std - np.std(per)) < 1e-6 * max(1, np.std(per)) and got.count == 4


def test_full_rank_mds_is_isometric_and_equals_the_pixel_distance():
    g = torch.Generator().manual_seed(5)
    samples = torch.randint(0, 256, (3, 4), generator=g, dtype=torch.uint8)
    sources = [torch.randint(0, 256, (2, 4), generator=g, dtype=torch.uint8) for _ in range(3)]
    pix = pixel_min_distances(samples, sources)
    hand = [min(math.dist(samples[i].tolist(), s.tolist()) for s in sources[i]) for i in range(3)]
    assert abs(pix.mean - np.mean(hand)) < 1e-9 and abs(pix.std - np.std(hand)) < 1e-9
    full = mds_min_distances(samples, sources, dims=9)          # 9 points span at most 8 dimensions
    assert abs(full.mean - pix.mean) < 1e-6 and abs(full.std - pix.std) < 1e-6
    two = mds_min_distances(samples, sources, dims=2)
    assert two.mean < pix.mean                                  # a projection only shrinks distances
    y = classical_mds(torch.cat([samples, *sources]), 9)
    x = torch.cat([samples, *sources]).double()
    assert torch.allclose(torch.cdist(y, y), torch.cdist(x, x), atol=1e-6)


# ----------------------------------------------------------------------------- the server's own base set

def test_server_set_is_carved_before_the_partition_with_exact_counts():
    data = data_of(DIGITS + ["--partition", "iid", "--client-test-fraction", "0"] + SERVER)
    sx, sy = data.server_data()
    assert torch.bincount(sy, minlength=10).tolist() == [4, 30, 4, 30, 30, 30, 30, 30, 30, 30]
    plain = data_of(DIGITS + ["--partition", "iid", "--client-test-fraction", "0"])
    assert plain.server_data() is None
    # server rows and client rows are disjoint and together the whole pool
    pool = torch.cat([plain.client(c).x for c in range(6)])
    clients = torch.cat([data.client(c).x for c in range(6)])
    assert len(clients) + len(sx) == len(pool)
    rows = lambda x: sorted(tuple(r.tolist()) for r in x.reshape(len(x), -1))  # noqa: E731
    assert rows(torch.cat([clients, sx])) == rows(pool)
    assert sum(data.client_sizes()) == len(pool) - len(sx)
    # seeded: the same seed gives the same set, another seed another one
    again = data_of(DIGITS + ["--partition", "iid"] + SERVER).server_data()
    assert torch.equal(again[0], sx)
    other = data_of(DIGITS[:-1] + ["4", "--partition", "iid"] + SERVER).server_data()
    assert not torch.equal(other[0], sx)


def test_without_a_request_the_partition_is_unchanged():
    labels = np.repeat(np.arange(10), 30)
    a = make_partition("dirichlet:0.5", labels, 5, 1)
    with server_set_request(ServerDataOptions()):       # inactive options: no carve
        b = make_partition("dirichlet:0.5", labels, 5, 1)
    assert all(np.array_equal(p, q) for p, q in zip(a, b)) and getattr(b, "server_indices", None) is None
    with server_set_request(ServerDataOptions(5, "3", 1)):
        c = make_partition("dirichlet:0.5", labels, 5, 1)
    assert np.bincount(labels[c.server_indices], minlength=10).tolist() == [5, 5, 5, 1, 5, 5, 5, 5, 5, 5]
    assert sorted(np.concatenate(list(c) + [c.server_indices]).tolist()) == list(range(300))


def test_deficient_partition_gives_every_client_the_same_minority():
    labels = np.repeat(np.arange(5), 40)
    parts = make_partition("deficient:1,3:2:6", labels, 4, 0)
    for p in parts:
        assert np.bincount(labels[p], minlength=5).tolist() == [6, 2, 6, 2, 6]
    assert len(set(np.concatenate(parts).tolist())) == 4 * (3 * 6 + 2 * 2)   # no sample dealt twice
    with pytest.raises(ConfigError, match="does not hold"):
        make_partition("deficient:7:2:6", labels, 4, 0)
    with pytest.raises(DataError, match="not enough"):
        make_partition("deficient:1:2:30", labels, 4, 0)


@pytest.mark.parametrize("opts, match", [
    (["server_per_label=500"], "holds"),                                   # more than the pool has
    (["server_per_label=20", "server_deficient=11", "server_deficient_count=2"], "does not hold"),
    (["server_deficient=1"], "server_per_label > 0"),
    (["server_per_label=20", "server_deficient=1", "server_deficient_count=20"], "below"),
    (["server_per_label=20", "server_deficient=a"], "integer labels"),
])
def test_bad_server_options_name_the_problem_and_the_fix(opts, match):
    argv = list(DIGITS)
    for o in opts:
        argv += ["--data-opt", o]
    with pytest.raises(ConfigError, match=match):
        data_of(argv)


def test_server_set_on_a_file_dataset_in_memory_and_refused_for_the_store(tmp_path):
    from test_store import write_cifar10

    write_cifar10(str(tmp_path), per_batch=40)
    base = ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--num-clients", "4", "--clients-per-round", "2",
            "--partition", "iid", "--data-opt", "server_per_label=3", "--data-opt", "server_deficient=5", "--data-opt",
            "server_deficient_count=1"]
    mem = data_of(base + ["--data-opt", "store=memory"])
    sx, sy = mem.server_data()
    assert sx.dtype == torch.uint8 and torch.bincount(sy, minlength=10)[5] == 1
    assert int(torch.bincount(sy, minlength=10).max()) == 3
    assert torch.equal(to_pixels(sx), sx)                 # uint8 datasets enter XOR untouched
    with pytest.raises(ConfigError, match="store=memory"):
        data_of(base + ["--data-opt", "store=hdf5", "--data-opt", f"store_dir={tmp_path / 'st'}"])
    assert not os.path.exists(tmp_path / "st") or not any(f.endswith(".h5") for f in os.listdir(tmp_path / "st"))
    # without server options the store is built as before
    h5 = data_of(base[:-6] + ["--data-opt", "store=hdf5", "--data-opt", f"store_dir={tmp_path / 'st'}"])
    assert h5.server_data() is None
    h5.close()


def test_metrics_and_per_label_accuracy_reach_the_files(tmp_path):
    from fedhpc.launch import main

    out = tmp_path / "run"
    rc = main(["--algo", "standalone", *DIGITS, "--clients-per-round", "6", "--rounds", "1", "--model", "mlp",
               *SERVER, "--server-epochs", "1", "--per-label-accuracy", "--quiet", "--threads", "1",
               "--out", str(out)])
    assert rc in (0, None)
    row = json.loads(open(out / "metrics.jsonl").read().splitlines()[-1])
    assert "test_accuracy_label0" in row and row["server_base_samples"] == 8 * 30 + 2 * 4


def test_xormixfl_on_a_uint8_dataset_keeps_the_pixels_and_trains(tmp_path):
    """CIFAR-style uint8 data: encoded and decoded samples stay uint8 end to end (no float round trip),
    and the server trains through the dataset's own normalising transform."""
    from fedhpc.engine import Engine
    from fedhpc.world import World
    from test_store import write_cifar10

    write_cifar10(str(tmp_path), per_batch=60)
    argv = ["--algo", "xormixfl", "--dataset", "cifar10", "--data-dir", str(tmp_path), "--num-clients", "3",
            "--clients-per-round", "3", "--rounds", "1", "--partition", "iid", "--model", "mlp", "--data-opt",
            "store=memory", "--data-opt", "crop_padding=0", "--data-opt", "flip=false", "--data-opt",
            "server_per_label=6", "--data-opt", "server_deficient=1", "--data-opt", "server_deficient_count=1",
            "--server-epochs", "1", "--threads", "1", "--quiet", "--no-tensorboard"]
    cfg, ao, do = parse_args(argv)
    eng = Engine(cfg, ao, do, World(threads=1))
    eng.algo.round_begin(type("R", (), {"index": 0, "sampled": [0, 1, 2]})())
    x, y = eng.algo.train_set
    assert x.dtype == torch.uint8 and int((y == 1).sum()) == 6
    sx, _ = eng.data.server_data()
    assert torch.equal(x[:len(sx)], sx)
    before = eng.global_state.clone()
    eng.run_round(0)
    assert not torch.equal(before, eng.global_state)


def test_every_dataset_takes_the_server_options_and_they_pickle():
    import pickle

    from fedhpc.data import DATASETS, load_dataset_modules

    load_dataset_modules()
    for name in DATASETS.names():
        spec = DATASETS.get(name)
        assert issubclass(spec.options, ServerDataOptions), name
        opts = spec.options(server_per_label=3)
        assert pickle.loads(pickle.dumps(opts)) == opts
        if spec.own_options is not None:
            assert isinstance(opts, spec.own_options)


def test_a_device_that_cannot_encode_stops_every_rank_with_its_error(tmp_path):
    """Device 3 (hosted by rank 1 of 2) holds no dummy label: its rank alone finds out, between two
    collectives; every rank must stop with that error at once, not wait for the collective timeout."""
    from conftest import launch

    args = ["--algo", "xormixfl", "--dataset", "digits", "--num-clients", "4", "--clients-per-round", "4",
            "--seed", "3", "--partition", "classes:3", "--data-opt", "server_per_label=30",
            "--data-opt", "server_deficient=0", "--data-opt", "server_deficient_count=4", "--num-dummy", "2",
            "--dummy-labels", "3,9", "--server-epochs", "1", "--rounds", "1", "--quiet", "--no-tensorboard",
            "--threads", "1", "--collective-timeout", "120", "--out", str(tmp_path / "r")]
    one = launch(args, ranks=1)
    assert one.returncode == 2 and "device 3 holds 0 usable non-target label(s)" in one.stderr
    two = launch(args, ranks=2, timeout=100)  # well under the collective timeout
    assert two.returncode == 2, two.stderr
    assert "device 3 holds 0 usable non-target label(s)" in two.stderr and "raised on rank 1" in two.stderr


# ----------------------------------------------------------------------------- what the server trains on

def np_blend(rows, alpha):
    """Eq. 1 on uint8 rows (m, ...) in numpy: b_1 = s_1, b_k = floor(alpha b_{k-1} + (1 - alpha) s_k)."""
    out = rows[0].astype(np.float64)
    for s in rows[1:]:
        out = np.clip(np.floor(alpha * out + (1 - alpha) * s.astype(np.float64)), 0, 255)
    return out.astype(np.uint8)


def np_draw_blend(pixels, members, max_blend, alpha, g):
    """The documented draw: min(M, |members|) members without replacement (torch.randperm of ``g``)."""
    pick = members[torch.randperm(len(members), generator=g)[:max_blend].numpy()]
    return np_blend(pixels[pick], alpha)


def test_the_server_trains_on_the_xor_decoded_samples_labelled_with_their_target(monkeypatch):
    """Alg. 2 through the engine: the rows the server trainer receives are its base set, then the
    first deficit of each target label's samples, decoded (Eq. 3: e XOR the server's OWN blend of
    the dummy labels, chained over 2 dummies) and labelled with the target label. The expectation
    is built here from the raw data alone: numpy blends and bitwise_xor, the documented seeded draws
    (derive_seed(seed, "oneshot-encode", cid) per device, derive_seed(seed, "oneshot-decode") on
    the server), the deficit split over holders in device order; nothing of the algorithm's codecs."""
    from fedhpc.algorithms.base import derive_seed
    from fedhpc.engine import Engine
    from fedhpc.world import World

    M, alpha, D = 2, 0.5, 2
    argv = ["--algo", "xormixfl", *DIGITS, "--clients-per-round", "6", "--rounds", "1", "--model", "mlp",
            "--partition", "deficient:0,2:3:10", *SERVER, "--server-epochs", "1", "--num-dummy", str(D),
            "--max-blend", str(M), "--blend-alpha", str(alpha), "--privacy-samples", "0", "--threads", "1",
            "--quiet", "--no-tensorboard"]
    cfg, ao, do = parse_args(argv)
    eng = Engine(cfg, ao, do, World(threads=1))
    seen = {}

    def capture(x, targets, tcfg, seed, **kw):
        seen["x"], seen["y"] = x.clone(), targets.clone()
        return {"loss": 0.0}

    monkeypatch.setattr(eng.algo.trainer, "fit", capture)
    eng.run_round(0)

    def pixels(x):  # round(255 x), numpy's round-half-even as torch's
        return np.round(x.double().numpy() * 255).astype(np.uint8)

    sx, sy = eng.data.server_data()
    spix, sy_np = pixels(sx), sy.numpy()
    counts = np.bincount(sy_np, minlength=10)
    deficits = {t: int(counts.max() - n) for t, n in enumerate(counts) if n < counts.max()}
    assert deficits == {0: 26, 2: 26}
    targets = sorted(deficits)
    devices = [(pixels(eng.data.client(c).x), eng.data.client(c).y.numpy()) for c in range(6)]
    holders = {t: [c for c in range(6) if (devices[c][1] == t).any()] for t in targets}
    encoded = []  # (target, dummies, encoded uint8 sample) in (device, position) order
    for cid, (px, y) in enumerate(devices):
        asks = {}
        for t in targets:
            if cid in holders[t]:
                q, r = divmod(deficits[t], len(holders[t]))
                asks[t] = q + (1 if holders[t].index(cid) < r else 0)
        g = torch.Generator().manual_seed(derive_seed(cfg.seed, "oneshot-encode", cid))
        candidates = np.array(sorted(set(y.tolist()) - set(targets)))
        for t in sorted(asks):
            for _ in range(asks[t]):
                e = np_draw_blend(px, np.flatnonzero(y == t), M, alpha, g)
                dummies = candidates[torch.randperm(len(candidates), generator=g)[:D].numpy()]
                for d in dummies:
                    e = np.bitwise_xor(e, np_draw_blend(px, np.flatnonzero(y == d), M, alpha, g))
                encoded.append((t, dummies, e))
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, "oneshot-decode"))
    decoded = []
    for t, dummies, e in encoded:  # Eq. 3 with the server's own blends of the same dummy labels
        d = e
        for lab in dummies:
            d = np.bitwise_xor(d, np_draw_blend(spix, np.flatnonzero(sy_np == lab), M, alpha, g))
        decoded.append((t, d, e))
    kept, taken = [], {t: 0 for t in targets}
    for t, d, e in decoded:
        if taken[t] < deficits[t]:
            kept.append((t, d, e))
            taken[t] += 1
    want_x = torch.from_numpy(np.stack([d for _, d, _ in kept]).astype(np.float64) / 255).float()
    want_y = torch.tensor([t for t, _, _ in kept])
    x, y = seen["x"], seen["y"]
    n = len(sx)
    assert torch.equal(x[:n], sx) and torch.equal(y[:n], sy)           # the base set, unchanged
    assert len(y) == n + 52 and torch.equal(y[n:], want_y), "the added samples carry their target label"
    assert torch.equal(x[n:], want_x), "the server trains on the XOR-decoded samples"
    # the check can tell: the still-encoded samples are another set, as is a decode with the device's blend
    still_encoded = torch.from_numpy(np.stack([e for _, _, e in kept]).astype(np.float64) / 255).float()
    assert (still_encoded != want_x).any(dim=(1, 2, 3)).all()
