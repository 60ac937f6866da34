"""Sample privacy and the raw-sample audit (fedhpc/analysis/privacy.py).

The log-min-distance is checked against a brute-force double loop in plain
Python, and against Eq. 6's closed form ln(lam * ||s_i - s_j||).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from fedhpc.algorithms.base import derive_seed
from fedhpc.analysis.privacy import (audit_raw_leaves, log_min_distance, log_min_distances, raw_sources,
                                     sample_privacy)
from fedhpc.exchanges.inverse_mixup import inverse_mixup
from fedhpc.exchanges.seed_samples import SeedSet, mixed_seeds, raw_seeds

C = 6


def gen(*keys):
    return torch.Generator().manual_seed(derive_seed(8, *keys))


def devices(n_dev=6, n=40):
    out = {}
    for cid in range(n_dev):
        g = gen("data", cid)
        out[cid] = (torch.rand(n, 3, 3, generator=g), torch.randint(0, C, (n,), generator=g))
    return out


def mixed_set(data, n_seeds, lam, n_mix=2):
    return SeedSet.cat([mixed_seeds(x, y, n_seeds, lam, C, gen("m", cid), cid=cid, n_mix=n_mix)
                        for cid, (x, y) in sorted(data.items())])


def brute_force(samples, sources):
    vals = []
    for i in range(samples.shape[0]):
        a = samples[i].flatten().tolist()
        best = math.inf
        for k in range(sources.shape[1]):
            b = sources[i, k].flatten().tolist()
            best = min(best, math.sqrt(sum((p - q) ** 2 for p, q in zip(a, b))))
        vals.append(math.log(best))
    return vals


def test_log_min_distance_matches_a_double_loop():
    g = gen("bf")
    samples = torch.randn(13, 2, 5, generator=g, dtype=torch.float64)
    sources = torch.randn(13, 4, 2, 5, generator=g, dtype=torch.float64)
    sources[3, 2] = samples[3] + 1e-3      # a close source must be the one that counts
    want = brute_force(samples, sources)
    got = log_min_distances(samples, sources)
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    stats = log_min_distance(samples, sources)
    assert stats.count == 13
    assert stats.mean == pytest.approx(statistics.fmean(want), rel=1e-12)
    assert stats.std == pytest.approx(statistics.pstdev(want), rel=1e-10)
    assert got[3] == pytest.approx(math.log(1e-3 * math.sqrt(10)), rel=1e-6)


def test_shape_mismatch_is_refused():
    from fedhpc.errors import DataError

    with pytest.raises(DataError, match="sources must have shape"):
        log_min_distances(torch.zeros(3, 4), torch.zeros(3, 2, 5))


@pytest.mark.parametrize("lam", [0.01, 0.1, 0.4])
def test_mixup_privacy_is_log_lambda_plus_log_pair_distance(lam):
    """Eq. 6 with lam < 0.5: the nearer raw sample is s_j, at distance lam * ||s_i - s_j||."""
    data = devices()
    s = mixed_set(data, 8, lam)
    src = raw_sources(s, {c: x for c, (x, _) in data.items()})
    pair = (src[:, 0] - src[:, 1]).flatten(1).norm(dim=1)
    assert log_min_distances(s.x, src).tolist() == pytest.approx((math.log(lam) + pair.log()).tolist(), abs=1e-5)


def test_privacy_grows_by_the_log_ratio_of_lambdas_on_the_same_pairs():
    """Table II's structure: 0.1 -> 0.2 adds ln 2 (natural log), sample by sample."""
    data = devices()
    raw = {c: x for c, (x, _) in data.items()}
    lo, hi = mixed_set(data, 8, 0.1), mixed_set(data, 8, 0.2)
    assert torch.equal(lo.source_index, hi.source_index)   # same generator, same raw pairs
    diff = log_min_distances(hi.x, raw_sources(hi, raw)) - log_min_distances(lo.x, raw_sources(lo, raw))
    assert diff.tolist() == pytest.approx([math.log(2)] * len(lo), abs=1e-5)


def test_raw_sources_follow_the_provenance():
    data = devices(3)
    raw = {c: x for c, (x, _) in data.items()}
    s = mixed_set(data, 5, 0.2)
    src = raw_sources(s, raw)
    for row in range(len(s)):
        for k in range(2):
            cid, idx = int(s.source_cid[row, k]), int(s.source_index[row, k])
            assert torch.equal(src[row, k], raw[cid][idx].double())
    # A callable lookup works the same.
    assert torch.equal(raw_sources(s, lambda c: raw[c]), src)


def test_inverse_mixup_privacy_uses_all_four_raw_samples_behind_it():
    data = devices()
    raw = {c: x for c, (x, _) in data.items()}
    mixed = mixed_set(data, 6, 0.3)
    inv = inverse_mixup(mixed, 24, 2, gen("inv"))
    sources = torch.stack([torch.stack([raw[int(inv.source_cid[r, k])][int(inv.source_index[r, k])].double()
                                        for k in range(4)]) for r in range(len(inv))])
    want = brute_force(inv.x.double(), sources)
    p = sample_privacy(inv, raw)
    assert p.mean == pytest.approx(statistics.fmean(want), rel=1e-6)
    assert p.std == pytest.approx(statistics.pstdev(want), rel=1e-5)
    # Table III vs II on the same seeds: inverse mixing moves samples further from their raw samples.
    assert p.mean > sample_privacy(mixed, raw).mean


def test_audit_flags_raw_seeds_and_passes_mixed_and_inverse_samples():
    data = devices()
    raw = {c: x for c, (x, _) in data.items()}
    fld = SeedSet.cat([raw_seeds(x, y, 4, gen("r", c), cid=c, num_classes=C) for c, (x, y) in sorted(data.items())])
    a = audit_raw_leaves(fld, raw)
    assert not a.passed and a.leaked_rows == list(range(len(fld))) and a.min_distance == 0.0
    assert sample_privacy(fld, raw).mean == -math.inf
    mixed = mixed_set(data, 6, 0.1)
    for s in (mixed, inverse_mixup(mixed, 36, 2, gen("inv"))):
        b = audit_raw_leaves(s, raw)
        assert b.passed and b.checked == len(s) and b.min_distance > 1e-3
        assert b.as_dict()["leaked"] == 0


def test_audit_catches_an_upload_equal_to_any_raw_sample_of_its_device():
    data = devices(2)
    raw = {c: x.clone() for c, (x, _) in data.items()}
    s = mixed_set(data, 5, 0.2)
    # Another raw sample of device 0, not mixed into row 1, happens to equal the upload.
    used = set(s.source_index[1].tolist())
    other = next(i for i in range(len(raw[0])) if i not in used)
    raw[0][other] = s.x[1]
    audit = audit_raw_leaves(s, raw)
    assert audit.leaked_rows == [1]
    # Two identical images with different labels: their mixture equals both, a leak.
    x, y = data[1]
    x = x.clone()
    pick = torch.tensor([0, int(torch.nonzero(y != y[0]).flatten()[0])])
    x[pick[1]] = x[0]
    twins = mixed_seeds(x[pick], y[pick], 1, 0.3, C, gen("t"), cid=1)
    assert not audit_raw_leaves(twins, {1: x[pick]}).passed
