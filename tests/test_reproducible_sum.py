"""fedhpc.reproducible_sum: sums with the same bits for any grouping, order or rank count.

Checked against exact rational arithmetic (fractions.Fraction) and against the property that
motivates it: a plain float64 sum of the same terms changes with the grouping.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch

from conftest import mpiexec, run_probe
from fedhpc.reproducible_sum import BINS, MAX_TERMS, P_MIN, W, ReproducibleSum, storage_numel


class Peers:
    """Stands in for a World of several ranks inside one process: all_reduce_max_ hands back
    the maximum of the peers' digit positions, computed beforehand."""

    def __init__(self, top):
        self.size, self.top = 2, top

    def all_reduce_max_(self, tensor):
        return tensor.copy_(self.top)


def grouped_sum(terms, order, cuts):
    """The terms in ``order``, cut into consecutive groups ("ranks") at ``cuts``, each summed
    into its own ReproducibleSum, aligned and added: what the engine's all-reduce does."""
    n = terms.shape[1]
    groups = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
    accs = []
    for g in groups:
        acc = ReproducibleSum(n, len(order))
        for i in g:
            acc.add_(terms[i])
        accs.append(acc)
    top = torch.stack([a.top for a in accs]).amax(0)
    for acc in accs:
        acc.align_(Peers(top))
    total = accs[0]  # the all-reduce: every rank's bins added into rank 0's
    for acc in accs[1:]:
        total.data += acc.data
    return total.sum()


def plain_grouped_sum(terms, order, cuts):
    groups = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
    parts = []
    for g in groups:
        acc = torch.zeros(terms.shape[1], dtype=torch.float64)
        for i in g:
            acc += terms[i]
        parts.append(acc)
    return sum(parts[1:], parts[0].clone())


def adversarial(rows=14, width=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-70, 71, (rows, width), generator=g).double())
    t = torch.randn(rows, width, generator=g, dtype=torch.float64) * scale
    t[:3, 0] = torch.tensor([2.0 ** 60, 3.0, -2.0 ** 60], dtype=torch.float64)
    return t


def exact(terms, j):
    return sum(Fraction(float(v)) for v in terms[:, j])


def test_same_bits_for_every_order_and_grouping_where_float64_sums_differ():
    terms = adversarial()
    rows = terms.shape[0]
    rng = random.Random(1)
    ref = grouped_sum(terms, list(range(rows)), [])
    plain_ref = plain_grouped_sum(terms, list(range(rows)), [])
    plain_differs = 0
    for _ in range(25):
        order = rng.sample(range(rows), rows)
        cuts = sorted(rng.sample(range(1, rows), rng.randint(0, 4)))
        assert torch.equal(grouped_sum(terms, order, cuts), ref), (order, cuts)
        plain_differs += int((plain_grouped_sum(terms, order, cuts) != plain_ref).sum())
    # the data is a real test: plain float64 sums of it depend on the grouping
    assert plain_differs > 100


def test_result_is_the_exact_sum_to_within_the_documented_truncation():
    terms = adversarial(seed=3)
    got = grouped_sum(terms, list(range(terms.shape[0])), [])
    for j in range(0, terms.shape[1], 7):
        true = exact(terms, j)
        largest = max(abs(Fraction(float(v))) for v in terms[:, j])
        # each term loses less than 2**-(2W) of the largest term's digit position, and the
        # three bins' final float64 additions round twice
        bound = terms.shape[0] * largest * Fraction(2) ** (-2 * W) + abs(true) * Fraction(2) ** -51
        assert abs(Fraction(float(got[j])) - true) <= bound, j
    # a float64 sum in order loses the 3 between +-2**60 (whose ulp is 256); this one keeps it
    # in any order: it keeps 64 bits below its largest term
    for order in ([0, 1, 2], [0, 2, 1], [1, 0, 2]):
        acc = ReproducibleSum(1, 3)
        for i in order:
            acc.add_(terms[i, :1])
        assert float(acc.sum()) == 3.0


def test_many_terms_add_exactly():
    # 4096 terms of 53 significant bits spread over two digits: every bin sum is still exact
    n = 4096
    big = float((2 ** 52 + 2 ** 51 - 1) * 2 ** 40)  # 53 significant bits spanning two digits
    small = float((2 ** 53 - 1)) * 2.0 ** -30
    terms = torch.tensor([[big, small, -big]] * n, dtype=torch.float64)
    acc = ReproducibleSum(3, n)
    for row in terms:
        acc.add_(row)
    assert acc.sum().tolist() == [float(Fraction(big) * n), float(Fraction(small) * n), -float(Fraction(big) * n)]


def test_alpha_start_and_float32_terms():
    acc = ReproducibleSum(5, 10)
    x = torch.tensor([0.1, -3.0], dtype=torch.float32)
    acc.add_(x, alpha=7.0, start=2)
    acc.add_(x, alpha=0.5, start=3)
    expected = torch.zeros(5, dtype=torch.float64)
    expected[2:4] += x.double() * 7.0
    expected[3:5] += x.double() * 0.5
    assert torch.equal(acc.sum(), expected)
    with pytest.raises(ValueError, match="elements 4..5"):
        acc.add_(x, start=4)


def test_zeros_tiny_huge_and_non_finite_terms():
    acc = ReproducibleSum(6, 10)
    acc.add_(torch.tensor([0.0, 2.0 ** -1000, 1e300, float("inf"), float("nan"), -0.0], dtype=torch.float64))
    acc.add_(torch.tensor([0.0, 2.0 ** -1000, 1e300, 1.0, 1.0, 0.0], dtype=torch.float64))
    got = acc.sum()
    assert got[0] == 0 and got[5] == 0
    assert got[1] == 0  # far below the finest grid kept (2**-991): smaller than any float32, dropped
    assert float(got[2]) == 2e300
    assert got[3] == float("inf") and torch.isnan(got[4])
    assert int(acc.top[0]) == P_MIN and int(acc.top[2]) == 63
    # zeroed, it starts over
    acc.zero_().add_(torch.ones(6))
    assert torch.equal(acc.sum(), torch.ones(6, dtype=torch.float64))


def test_refuses_more_terms_than_its_bins_hold_and_a_wrong_buffer():
    with pytest.raises(ValueError, match=f"at most {MAX_TERMS} terms"):
        ReproducibleSum(3, MAX_TERMS + 1)
    with pytest.raises(ValueError, match="contiguous float64"):
        ReproducibleSum(3, 5, out=torch.zeros(storage_numel(3), dtype=torch.float32))
    buf = torch.zeros(storage_numel(3) + 2, dtype=torch.float64)
    acc = ReproducibleSum(3, 5, out=buf[1:-1])
    acc.add_(torch.ones(3))
    assert buf[0] == 0 and buf[-1] == 0 and bool((buf[1:-1] != 0).any())
    assert torch.equal(acc.sum(), torch.ones(3, dtype=torch.float64))
    assert storage_numel(3) == BINS * 3


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec (pip install mpich)")
def test_one_two_and_three_mpi_ranks_give_the_same_bits(tmp_path):
    got = {ranks: run_probe("reproducible_sum_probe.py", tmp_path / f"r{ranks}", ranks) for ranks in (1, 2, 3)}
    ref = got[1][0]
    assert float(ref["sum"][0]) == 3.0
    for ranks in (2, 3):
        for r in got[ranks]:
            assert r["size"] == ranks and torch.equal(r["sum"], ref["sum"])
    # and the data is such that rank-ordered float64 sums differ
    assert not torch.equal(got[3][0]["plain"], ref["plain"])


def binned_cases():
    """(terms, alpha) sequences that exercise every path: raises of the top by 1, 2 and 3+
    positions, non-finite terms, zeros, subnormal, tiny and huge terms, float32 and float64, and
    lengths that leave a tail past the CPU kernel's groups of four."""
    g = torch.Generator().manual_seed(7)
    n = 70_003  # more than one parallel task of the CPU kernel, and not a multiple of 4
    for dtype in (torch.float32, torch.float64):
        lo, hi = (-120, 120) if dtype == torch.float32 else (-1000, 1000)
        seq = []
        for r in range(9):
            scale = torch.exp2(torch.randint(lo, hi + 1, (n,), generator=g).double()).to(dtype)
            t = torch.randn(n, generator=g, dtype=dtype) * scale
            t[torch.rand(n, generator=g) < 0.05] = 0.0
            if r == 4:
                t[:5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0], dtype=dtype)
                info = torch.finfo(dtype)  # subnormals (top position P_MIN) and the largest finite terms
                t[9:13] = torch.tensor([info.smallest_normal / 8, -info.smallest_normal / 1024, info.max, -info.max],
                                       dtype=dtype)
            seq.append((t, [1.0, 37.0, 0.1][r % 3]))
        yield dtype, seq


def deposit_with(backend: str, seq, device="cpu") -> ReproducibleSum:
    """A sum after ``seq``'s adds (at an offset, then a strided view) through ``backend``."""
    from fedhpc import ops

    acc = ReproducibleSum(seq[0][0].numel() + 10, 100, device=device)
    with ops.prefer(backend):
        for t, alpha in seq:
            acc.add_(t.to(device), alpha=alpha, start=3)
        acc.add_(seq[0][0].to(device)[::7], start=10)  # a strided (non-contiguous) view
    return acc


def assert_same_bits(a: ReproducibleSum, b: ReproducibleSum, what) -> None:
    assert torch.equal(a.top.cpu(), b.top.cpu()), what
    assert torch.equal(a.data.cpu().view(torch.int64), b.data.cpu().view(torch.int64)), what  # NaNs too


@pytest.mark.parametrize("threads", [1, 2])
def test_native_deposit_equals_its_pytorch_definition(threads):
    from fedhpc import ops

    if ops.native().module is None:
        pytest.skip("no native extension here (no compiler): the reference is all that runs")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype, seq in binned_cases():
            assert_same_bits(deposit_with("native", seq), deposit_with("torch", seq), dtype)
    finally:
        torch.set_num_threads(old)
