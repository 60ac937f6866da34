"""Seed samples of FLD / MixFLD / Mix2FLD (fedhpc/exchanges/seed_samples.py, inverse_mixup.py).

Expected values are computed here from the raw data: mixtures by direct sums of
raw samples, inverse ratios by torch.linalg.solve on the mixing matrix written
out in the test (Mix2FLD Eq. 8) or built from the parent seeds' soft labels,
lambda_hat for N = 2 from its closed form (Eqs. 9-10).
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_probe
from fedhpc.algorithms.base import derive_seed
from fedhpc.errors import ConfigError, DataError
from fedhpc.exchanges.inverse_mixup import inverse_mixup, inverse_ratios
from fedhpc.exchanges.seed_samples import SeedSampleOptions, SeedSet, collect_seeds, mixed_seeds, mixing_ratios, raw_seeds

C = 10


def gen(*keys):
    return torch.Generator().manual_seed(derive_seed(5, *keys))


def device_data(cid, n=60, classes=C):
    g = gen("data", cid)
    return torch.rand(n, 1, 4, 4, generator=g, dtype=torch.float64).float(), torch.randint(0, classes, (n,), generator=g)


class OneRank:
    rank, size = 0, 1

    def all_gather_object(self, obj):
        return [obj]


class FakeRanks:
    """Rank ``rank`` of ``size``: the other ranks' payloads are fed in, to emulate one gather in-process."""

    def __init__(self, rank, size, payloads):
        self.rank, self.size, self.payloads = rank, size, payloads

    def all_gather_object(self, obj):
        self.payloads[self.rank] = obj
        return [self.payloads[r] for r in range(self.size)]


def make_devices(n_dev, n_seeds, lam, pairing="shared", raw_store=None):
    sets = {}
    for cid in range(n_dev):
        x, y = device_data(cid)
        if raw_store is not None:
            raw_store[cid] = (x, y)
        sets[cid] = mixed_seeds(x, y, n_seeds, lam, C, gen("mix", cid), cid=cid, pairing=pairing, schedule_seed=5)
    return sets


# ----------------------------------------------------------------------------- device side

@pytest.mark.parametrize("pairing", ["shared", "random"])
@pytest.mark.parametrize("lam", [0.1, 0.4])
def test_mixed_seeds_mix_two_different_labels_with_eq6_soft_labels(pairing, lam):
    x, y = device_data(3)
    s = mixed_seeds(x, y, 25, lam, C, gen("m"), cid=3, pairing=pairing)
    assert s.kind == "mixed" and len(s) == 25 and s.ratios == (lam, 1 - lam)
    i, j = s.source_index[:, 0], s.source_index[:, 1]
    assert torch.equal(s.labels[:, 0], y[i]) and torch.equal(s.labels[:, 1], y[j])
    assert bool((y[i] != y[j]).all())                                 # different labels, so i != j
    # Eq. 6: s_hat = lam * s_i + (1 - lam) * s_j, the first sample gets lam.
    want = lam * x[i].double() + (1 - lam) * x[j].double()
    assert torch.allclose(s.x.double(), want, atol=1e-6)
    rows = torch.arange(25)
    assert torch.allclose(s.y[rows, y[i]], torch.full((25,), lam))
    assert torch.allclose(s.y[rows, y[j]], torch.full((25,), 1 - lam))
    assert int((s.y > 0).sum(1).min()) == 2 and torch.allclose(s.y.sum(1), torch.ones(25))
    assert bool((s.owner == 3).all()) and torch.equal(s.index, rows)
    assert bool((s.source_cid == 3).all())


def test_raw_samples_are_not_reused_before_their_label_is_exhausted():
    x, y = device_data(1)
    s = mixed_seeds(x, y, 20, 0.2, C, gen("m"), cid=1, pairing="random")
    for c in range(C):
        used = s.source_index[s.labels == c].tolist()
        have = int((y == c).sum())
        assert len(used) - len(set(used)) <= max(0, len(used) - have)


def test_general_n_seed_is_the_ratio_weighted_sum_of_n_different_labels():
    ratios = (0.1, 0.3, 0.6)
    x, y = device_data(2)
    s = mixed_seeds(x, y, 12, ratios, C, gen("m3"), cid=2)
    assert s.labels.shape == (12, 3) and s.ratios == ratios
    for row in range(12):
        assert len(set(s.labels[row].tolist())) == 3
        want = sum(r * x[int(k)].double() for r, k in zip(ratios, s.source_index[row]))
        assert torch.allclose(s.x[row].double(), want, atol=1e-6)
        assert torch.allclose(s.y[row, s.labels[row]], torch.tensor(ratios, dtype=torch.float32))
    # A number lam for N > 2 means (lam, ..., lam, 1 - (N-1) lam).
    assert mixing_ratios(0.1, 4) == pytest.approx((0.1, 0.1, 0.1, 0.7))


def test_shared_pairing_gives_neighbouring_devices_mirrored_label_pairs():
    s0 = mixed_seeds(*device_data(0), 8, 0.1, C, gen("a"), cid=0, schedule_seed=9)
    s1 = mixed_seeds(*device_data(1), 8, 0.1, C, gen("b"), cid=1, schedule_seed=9)
    s2 = mixed_seeds(*device_data(2), 8, 0.1, C, gen("c"), cid=2, schedule_seed=9)
    assert torch.equal(s0.labels, s1.labels.flip(1))
    assert torch.equal(s0.labels, s2.labels)
    # Samples stay the device's own random draw: different generators give different picks.
    assert not torch.equal(s0.source_index, s2.source_index)


def test_shared_pairing_falls_back_to_the_next_held_labels_consistently():
    x, y = device_data(4)
    y = y % 3  # this device holds labels 0, 1, 2 only
    a = mixed_seeds(x, y, 10, 0.1, C, gen("a"), cid=4, schedule_seed=2)
    b = mixed_seeds(x, y, 10, 0.1, C, gen("b"), cid=7, schedule_seed=2)  # another device, same labels
    assert set(a.labels.flatten().tolist()) <= {0, 1, 2}
    assert torch.equal(a.labels, b.labels.flip(1))


def test_device_errors_are_clear():
    x, y = device_data(0)
    with pytest.raises(DataError, match="holds 1 label"):
        mixed_seeds(x, torch.zeros_like(y), 5, 0.1, C, gen("e"), cid=0)
    with pytest.raises(ConfigError, match=r"\(0, 0.5\)"):
        mixed_seeds(x, y, 5, 0.5, C, gen("e"), cid=0)
    with pytest.raises(ConfigError, match="sum to 1"):
        mixed_seeds(x, y, 5, (0.2, 0.2, 0.2), C, gen("e"), cid=0)
    with pytest.raises(ConfigError, match="model-input space"):
        mixed_seeds((x * 255).long(), y, 5, 0.1, C, gen("e"), cid=0)
    with pytest.raises(DataError, match="fewer than N_S = 61 .*lower --seeds-per-device to 60"):
        raw_seeds(x, y, 61, gen("e"), cid=0, num_classes=C)
    with pytest.raises(DataError, match="no training samples"):
        raw_seeds(x[:0], y[:0], 1, gen("e"), cid=0, num_classes=C)
    with pytest.raises(ConfigError, match="seed-pairing"):
        SeedSampleOptions(seed_pairing="nearest").validate()


def test_raw_seeds_draw_without_replacement_with_one_hot_labels():
    x, y = device_data(6)
    s = raw_seeds(x, y, 30, gen("r"), cid=6, num_classes=C)
    idx = s.source_index[:, 0]
    assert len(set(idx.tolist())) == 30
    assert torch.equal(s.x, x[idx]) and torch.equal(s.labels[:, 0], y[idx])
    assert torch.equal(s.y, torch.nn.functional.one_hot(y[idx], C).float())


def test_wire_bytes_count_8_bit_pixels_and_label_ids():
    x = torch.rand(20, 1, 28, 28)
    y = torch.arange(20) % 10
    mixed = mixed_seeds(x, y, 10, 0.1, 10, gen("w"), cid=0)
    raw = raw_seeds(x, y, 10, gen("w"), cid=0, num_classes=10)
    assert raw.wire_bytes() == 10 * (6272 // 8 + 1)      # the paper's b_s = 6,272 bits, plus a label id
    assert mixed.wire_bytes() == 10 * (784 + 2)
    assert mixed.wire_bytes(pixel_bits=32) == 10 * (4 * 784 + 2)


def test_seeds_are_determined_by_the_generator():
    x, y = device_data(0)
    for pairing in ("shared", "random"):
        a = mixed_seeds(x, y, 10, 0.1, C, gen("same"), cid=0, pairing=pairing)
        b = mixed_seeds(x, y, 10, 0.1, C, gen("same"), cid=0, pairing=pairing)
        c = mixed_seeds(x, y, 10, 0.1, C, gen("other"), cid=0, pairing=pairing)
        assert torch.equal(a.x, b.x) and torch.equal(a.source_index, b.source_index)
        assert not torch.equal(a.source_index, c.source_index)
    col = collect_seeds(OneRank(), make_devices(6, 8, 0.1))
    i1 = inverse_mixup(col, 40, 2, gen("inv"))
    i2 = inverse_mixup(col, 40, 2, gen("inv"))
    i3 = inverse_mixup(col, 40, 2, gen("inv2"))
    assert torch.equal(i1.x, i2.x) and torch.equal(i1.parents, i2.parents)
    assert not torch.equal(i1.parents, i3.parents)


# ----------------------------------------------------------------------------- collection

def test_collect_orders_by_device_and_position_whatever_the_rank_split():
    sets = make_devices(5, 4, 0.2)
    one = collect_seeds(OneRank(), sets)
    assert one.owner.tolist() == sum(([c] * 4 for c in range(5)), [])
    assert one.index.tolist() == list(range(4)) * 5
    for split in ({0: [0, 2, 4], 1: [1, 3]}, {0: [3, 4], 1: [0, 1, 2]}):
        # Rank 1 runs first and leaves its payload (its own result is partial: ignore it).
        payloads = {0: ([], None)}  # a rank's payload: its devices and their joined seeds
        collect_seeds(FakeRanks(1, 2, payloads), {c: sets[c] for c in split[1]})
        two = collect_seeds(FakeRanks(0, 2, payloads), {c: sets[c] for c in split[0]})
        for k, v in vars(one).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, getattr(two, k)), k


def test_collect_refuses_inconsistent_uploads():
    sets = make_devices(2, 3, 0.2)
    with pytest.raises(ConfigError, match="belongs to client"):
        collect_seeds(OneRank(), {5: sets[0]})
    with pytest.raises(ConfigError, match="more than one rank"):
        collect_seeds(FakeRanks(0, 2, {1: ([0], sets[0])}), {0: sets[0]})
    with pytest.raises(DataError, match="no device uploaded"):
        collect_seeds(OneRank(), {})
    other = mixed_seeds(*device_data(1), 3, 0.3, C, gen("x"), cid=1)
    with pytest.raises(ConfigError, match="same seed settings"):
        collect_seeds(OneRank(), {0: sets[0], 1: other})


def test_collect_is_identical_on_one_and_two_mpi_ranks(tmp_path):
    outs = {ranks: run_probe("seed_probe.py", tmp_path / f"r{ranks}", ranks) for ranks in (1, 2)}
    ref = outs[1][0]
    assert ref["size"] == 1 and [o["size"] for o in outs[2]] == [2, 2]
    assert len(ref["sets"]["inverse"]["x"]) == 84
    for o in outs[2]:
        for name, tensors in ref["sets"].items():
            for k, v in tensors.items():
                assert torch.equal(v, o["sets"][name][k]), (name, k)


# ----------------------------------------------------------------------------- inverse mixup

@pytest.mark.parametrize("lam", [0.1, 0.3, 0.45])
def test_n2_inverse_ratio_is_lambda_over_2lambda_minus_1(lam):
    w = inverse_ratios(mixing_ratios(lam, 2))
    hat = lam / (2 * lam - 1)
    assert w[0].tolist() == pytest.approx([hat, 1 - hat], abs=1e-12)
    assert w[1].tolist() == pytest.approx([1 - hat, hat], abs=1e-12)  # "alternating lambda_hat"
    assert hat < 0
    # Eqs. 9-10 hold for it: a hard label {1, 0} from soft labels {lam, 1-lam} and {1-lam, lam}.
    assert hat * lam + (1 - hat) * (1 - lam) == pytest.approx(1)
    assert hat * (1 - lam) + (1 - hat) * lam == pytest.approx(0)


def eq8_matrix(ratios):
    """Eq. 8's right-hand matrix written out: row r = (lam_{r+1}, ..., lam_N, lam_1, ..., lam_r)."""
    n = len(ratios)
    return torch.tensor([[ratios[(r + col) % n] for col in range(n)] for r in range(n)], dtype=torch.float64)


@pytest.mark.parametrize("ratios", [(0.2, 0.8), (0.1, 0.3, 0.6), (0.05, 0.15, 0.3, 0.5)])
def test_inverse_mixup_gives_hard_labels_and_the_linear_solve_combination(ratios):
    n = len(ratios)
    raw = {}
    col = collect_seeds(OneRank(), make_devices(2 * n + 1, 6, ratios, raw_store=raw))
    out = inverse_mixup(col, 7 * n, n, gen("inv", n))
    assert out.kind == "inverse" and len(out) == 7 * n
    # Exactly one-hot labels.
    assert bool(((out.y == 0) | (out.y == 1)).all()) and torch.equal(out.y.sum(1), torch.ones(len(out)))
    assert torch.equal(out.y.argmax(1), out.labels[:, 0])
    lam_solve = torch.linalg.solve(eq8_matrix(ratios), torch.eye(n, dtype=torch.float64))
    for row in range(len(out)):
        par = out.parents[row]
        owners = col.owner[par]
        assert len(set(owners.tolist())) == n                             # N different devices
        cycle = col.labels[par[0]]                                        # the rotation-0 tuple
        a = col.y[par][:, cycle].double()                                 # (seed, label of the cycle)
        target = (cycle == out.labels[row, 0]).double()
        w = torch.linalg.solve(a.T, target)                               # sum_r w_r y_r = e_label
        assert torch.allclose(out.coef[row], w, atol=1e-5)
        assert torch.allclose(w, lam_solve[:, int(target.argmax())], atol=1e-5)  # Eq. 8, M symmetric
        assert torch.allclose((w[:, None] * col.y[par].double()).sum(0),
                              torch.nn.functional.one_hot(out.labels[row, 0], C).double(), atol=1e-5)
        # The raw-sample combination: sum_r w_r sum_m lam_m raw(source_rm).
        want = sum(w[r] * ratios[m] * raw[int(col.owner[par[r]])][0][int(col.source_index[par[r], m])].double()
                   for r in range(n) for m in range(n))
        assert torch.allclose(out.x[row].double(), want, atol=1e-4)
        # Provenance agrees with the same sum.
        prov = sum(out.weights[row, s] * raw[int(out.source_cid[row, s])][0][int(out.source_index[row, s])].double()
                   for s in range(n * n))
        assert torch.allclose(prov, want, atol=1e-9)


def test_inverse_mixup_uses_seeds_evenly_and_never_repeats_a_combination():
    col = collect_seeds(OneRank(), make_devices(10, 10, 0.1))
    out = inverse_mixup(col, 200, 2, gen("even"))                 # N_I = 2 N_S
    combos = out.parents[::2]
    assert len({tuple(c) for c in combos.tolist()}) == len(combos) == 100
    uses = torch.bincount(combos.flatten(), minlength=len(col))
    assert int(uses.max()) <= 3 and int(uses.min()) >= 1
    assert bool((col.owner[out.parents[:, 0]] != col.owner[out.parents[:, 1]]).all())


def test_inverse_mixup_never_combines_seeds_of_one_device():
    x, y = device_data(0)
    # One device holding both orientations of every pair: only same-device partners exist.
    a = mixed_seeds(x, y, 6, 0.1, C, gen("a"), cid=0, schedule_seed=3)
    b = mixed_seeds(x, y, 6, 0.1, C, gen("b"), cid=1, schedule_seed=3)
    both = SeedSet.cat([a, b])
    both.owner[:] = 0
    both.index = torch.arange(len(both))
    with pytest.raises(DataError, match="no valid inverse-mixup combination.* Raise --seeds-per-device"):
        inverse_mixup(both, 2, 2, gen("x"))
    both.owner[6:] = 1                                            # now two devices: it works
    out = inverse_mixup(both, 12, 2, gen("x"))
    assert bool((both.owner[out.parents[:, 0]] != both.owner[out.parents[:, 1]]).all())


def test_inverse_mixup_errors():
    col = collect_seeds(OneRank(), make_devices(4, 3, 0.2))
    with pytest.raises(DataError, match=r"distinct inverse-mixup combinations .* lower --inverse-per-device "
                                         r"\(these seeds give \d+ per device\) or upload more seeds \(--seeds-per-device"):
        inverse_mixup(col, 10_000, 2, gen("x"))
    with pytest.raises(ConfigError, match="N = 3"):
        inverse_mixup(col, 4, 3, gen("x"))
    raw = collect_seeds(OneRank(), {0: raw_seeds(*device_data(0), 3, gen("r"), cid=0, num_classes=C)})
    with pytest.raises(ConfigError, match="got raw seeds"):
        inverse_mixup(raw, 4, 2, gen("x"))
    with pytest.raises(ConfigError, match="singular"):
        inverse_ratios((1 / 3, 1 / 3, 1 / 3))
    col.y[0] = col.y[0].flip(0)
    with pytest.raises(DataError, match="soft labels"):
        inverse_mixup(col, 4, 2, gen("x"))


def test_inverse_mixup_of_a_thinned_out_set_gives_what_it_has_instead_of_failing():
    """strict=False (Mix2FLD under --seed-delivery channel): the same samples as a strict call when
    there are enough combinations, every combination when there are too few, and an empty set
    (right shapes) when there is none: one device, or no seed at all."""
    col = collect_seeds(OneRank(), make_devices(4, 3, 0.2))
    strict = inverse_mixup(col, 12, 2, gen("t"))
    loose = inverse_mixup(col, 12, 2, gen("t"), strict=False)
    assert torch.equal(strict.x, loose.x) and torch.equal(strict.parents, loose.parents)
    # too few: every distinct valid combination once, counted by brute force
    labels, owner = col.labels.tolist(), col.owner.tolist()
    valid = sum(1 for a in range(len(col)) for b in range(len(col))
                if labels[a][0] < labels[a][1] and labels[b] == labels[a][::-1] and owner[a] != owner[b])
    many = inverse_mixup(col, 10_000, 2, gen("t"), strict=False)
    assert len(many) == 2 * valid and len({tuple(p) for p in many.parents[::2].tolist()}) == valid
    assert bool((col.owner[many.parents[:, 0]] != col.owner[many.parents[:, 1]]).all())
    one = col.select((col.owner == 0).nonzero().flatten())           # one device: no partner
    for empty in (inverse_mixup(one, 6, 2, gen("t"), strict=False),
                  inverse_mixup(one.select(torch.zeros(0, dtype=torch.long)), 0, 2, gen("t"), strict=False)):
        assert len(empty) == 0 and empty.kind == "inverse"
        assert empty.x.shape == (0,) + tuple(col.x.shape[1:]) and empty.y.shape == (0, C)
        assert empty.parents.shape == (0, 2) and empty.source_cid.shape == (0, 4)
    with pytest.raises(DataError, match="no valid inverse-mixup combination"):
        inverse_mixup(one, 6, 2, gen("t"))                              # strict: a configuration error
