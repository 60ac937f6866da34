"""Native ops (csrc/, fedhpc.ops) against the pure-PyTorch reference and independent loops.

* the reference itself against brute-force per-sample / per-segment loops;
* each native op against the reference: float32 and float64, random shapes, non-contiguous
  inputs, broadcast and per-sample means, 1..1000 segments, batches of clients, in place;
* gradcheck / gradgradcheck of the FedMix ops in float64 (the native autograd Functions);
* fedmix_loss, and whole `python -m fedhpc.launch` runs of FedMix and pMixFed, with and without
  the extension; results independent of the thread count; a stale prebuilt module is refused;
  setup.py installs without a compiler;
* the CUDA kernels compile with nvcc (compile-only, no GPU needed); the native-vs-reference
  tests and gradcheck also run the CUDA kernels and binding under the CPU emulation of
  tests/cuda_emulation/ (device "cuda-emulated"), and on a real GPU when there is one.

Native tests skip, saying why, when this machine has no extension (no compiler and no prebuilt).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from fedhpc import ops
from fedhpc.ops import _loader, _sources, reference

DTYPES = (torch.float32, torch.float64)


def native_or_skip():
    nat = ops.native()
    if nat.module is None:
        pytest.skip("no native extension here: " + "; ".join(n for n in nat.notes if n))
    return nat


def devices():
    """Where the native-vs-reference tests run: the CPU kernels; the CUDA kernels and binding
    under the CPU emulation of tests/cuda_emulation/ (wherever a compiler is); a real GPU."""
    out = ["cpu", "cuda-emulated"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


@pytest.fixture(params=devices())
def device(request, monkeypatch):
    """The torch device of a test's tensors. "cuda-emulated": CPU tensors, with fedhpc.ops's
    extension swapped for csrc/ built as a CUDA build against the emulation, so every op takes
    the CUDA branch of ops.cpp and runs the CUDA kernels. A build error fails the test: only a
    machine without the tools to build skips it."""
    if request.param != "cuda-emulated":
        return request.param
    use_emulated_cuda(monkeypatch)
    return "cpu"


def use_emulated_cuda(monkeypatch):
    """Swap fedhpc.ops's extension for the emulated CUDA build (skips without the build tools,
    or where FEDHPC_TEST_NO_CUDA_EMULATION=1: benchmarks/gpu/checks.sh sets it, a real GPU runs
    these kernels there and its device time is better spent than on a second build)."""
    if _sources.env_flag("FEDHPC_TEST_NO_CUDA_EMULATION"):
        pytest.skip("FEDHPC_TEST_NO_CUDA_EMULATION is set")
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the CUDA kernels cannot run under the emulation here")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        pytest.skip("ninja is missing: the emulated CUDA build needs it")
    from cuda_emulation import emulated_native

    monkeypatch.setattr(_loader, "_native", emulated_native())


def rand(shape, dtype, gen, device="cpu"):
    return torch.rand(shape, generator=gen, dtype=dtype).to(device)


def non_contiguous(t):
    """Same values in a strided layout: every other element of a buffer twice as long."""
    out = torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    assert torch.equal(out, t) and (t.numel() < 2 or not out.is_contiguous())
    return out


# --------------------------------------------------------------------------- the reference is the maths

def test_reference_matches_brute_force_loops():
    gen = torch.Generator().manual_seed(0)
    g, xbar = rand((5, 3, 4), torch.float64, gen), rand((1, 3, 4), torch.float64, gen)
    per_sample = rand((5, 3, 4), torch.float64, gen)
    lam = 0.3
    for mean in (xbar, per_sample):
        loop = [lam * float(sum(g[i].flatten()[k] * mean[min(i, mean.shape[0] - 1)].flatten()[k]
                                for k in range(12))) for i in range(5)]
        assert torch.allclose(reference.fedmix_l3(g, mean, lam), torch.tensor(loop, dtype=torch.float64), rtol=1e-14)
    y, ybar = rand((5, 4), torch.float64, gen), rand((1, 4), torch.float64, gen)
    xm, ym = reference.mix_inputs_labels(g, y, ybar, lam, xbar)
    for i in range(5):
        assert torch.allclose(xm[i], (1 - lam) * g[i] + lam * xbar[0], rtol=1e-15)
        assert torch.allclose(ym[i], (1 - lam) * y[i] + lam * ybar[0], rtol=1e-15)

    # Segments: a Python loop over clients and segments, empty segments included.
    lengths = [3, 0, 5, 1, 0, 7]
    off = ops.segment_offsets(lengths)
    assert off.tolist() == [0, 3, 3, 8, 9, 9, 16]
    a, b = rand((4, 16), torch.float64, gen), rand(16, torch.float64, gen)
    lam_cs = rand((4, 6), torch.float64, gen)
    out = reference.segment_mix(a, b, off, lam_cs)
    for c in range(4):
        for s in range(6):
            lo, hi = int(off[s]), int(off[s + 1])
            l_ = lam_cs[c, s]
            assert torch.allclose(out[c, lo:hi], l_ * a[c, lo:hi] + (1 - l_) * b[lo:hi], rtol=1e-15)


# --------------------------------------------------------------------------- native == reference

@pytest.mark.parametrize("dtype", DTYPES)
def test_mix_inputs_labels_native_equals_reference(dtype, device):
    native_or_skip()
    gen = torch.Generator().manual_seed(1)
    for trial in range(12):
        b = int(torch.randint(1, 9, (1,), generator=gen))
        xs = (b,) + tuple(int(v) for v in torch.randint(1, 7, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                                        generator=gen))
        ys = (b, int(torch.randint(1, 12, (1,), generator=gen)))
        lam = float(torch.rand(1, generator=gen))
        x, y = rand(xs, dtype, gen, device), rand(ys, dtype, gen, device)
        ybar = rand((1 if trial % 2 else b,) + ys[1:], dtype, gen, device)
        xbar = [None, rand((1,) + xs[1:], dtype, gen, device), rand(xs, dtype, gen, device)][trial % 3]
        if trial % 4 == 3:
            x, y = non_contiguous(x), non_contiguous(y)
        leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (x, xbar, y, ybar)]
        with ops.prefer("native"):
            got = ops.mix_inputs_labels(leaves[0], leaves[2], leaves[3], lam, leaves[1])
        want = reference.mix_inputs_labels(leaves[0], leaves[2], leaves[3], lam, leaves[1])
        for g_, w_ in zip(got, want):  # elementwise: the same roundings, bit for bit
            assert torch.equal(g_, w_)
        probes = [rand(t.shape, dtype, gen, device) for t in want]
        inputs = [t for t in leaves if t is not None]
        g_native = torch.autograd.grad(got, inputs, probes)
        g_ref = torch.autograd.grad(want, inputs, probes)
        tol = 1e-6 if dtype == torch.float32 else 1e-14  # mean gradients are sums over the batch
        for gn, gr in zip(g_native, g_ref):
            assert torch.allclose(gn, gr, rtol=tol, atol=tol), (trial, (gn - gr).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fedmix_l3_native_equals_reference(dtype, device):
    native_or_skip()
    gen = torch.Generator().manual_seed(2)
    # 9000 columns: several of the CPU kernel's fixed reduction blocks per sample.
    for shape in [(1, 1), (5,), (0, 6), (3, 5), (10, 64), (7, 3, 8, 8), (4, 9000), (64, 3, 4, 4)]:
        for per_sample in (False, True):
            g = rand(shape, dtype, gen, device) - 0.5
            xbar = rand((shape[0] if per_sample else 1,) + shape[1:], dtype, gen, device)
            if shape[0] > 2:
                g = non_contiguous(g)
            gl, xl = g.clone().requires_grad_(True), xbar.clone().requires_grad_(True)
            with ops.prefer("native"):
                s = ops.fedmix_l3(gl, xl, 0.15)
            r = reference.fedmix_l3(gl, xl, 0.15)
            tol = 2e-6 if dtype == torch.float32 else 1e-13
            assert s.shape == (shape[0],)
            scale = float(r.detach().abs().max()) if r.numel() else 0.0
            assert torch.allclose(s, r, rtol=tol, atol=tol * scale), (shape, (s - r).abs().max())
            probe = rand((shape[0],), dtype, gen, device)
            gn = torch.autograd.grad(s, (gl, xl), probe)
            gr = torch.autograd.grad(r, (gl, xl), probe)
            assert torch.equal(gn[0], gr[0])  # grad_g is elementwise: bit-identical
            assert torch.allclose(gn[1], gr[1], rtol=tol, atol=tol)


def segment_cases(gen):
    """(P, lengths) with 1..2500 segments, empty ones, one-element ones, one huge one. Past
    2047 segments the CUDA kernel reads its offsets from global memory, not shared memory."""
    yield 1, [1]
    yield 37, [37]
    for nseg in (2, 7, 100, 1000, 2500):
        lengths = torch.randint(0, 40, (nseg,), generator=gen)
        lengths[torch.randint(nseg, (max(1, nseg // 10),), generator=gen)] = 0
        lengths[-1] += 1
        yield int(lengths.sum()), lengths.tolist()
    yield 70001, [1, 0, 70000]


@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_mix_native_equals_reference(dtype, device):
    native_or_skip()
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for p, lengths in segment_cases(gen):
        off = ops.segment_offsets(lengths)
        s = len(lengths)
        # (clients, which inputs have a client dimension): one state, one client, C clients against
        # one global state (and the reverse), C against C; lam per client or shared.
        for clients, batched in ((None, ""), (1, "a"), (5, "a"), (5, "b"), (5, "ab")):
            a = rand((clients, p) if "a" in batched else (p,), dtype, gen, device)
            b = rand((clients, p) if "b" in batched else (p,), dtype, gen, device)
            lam = rand((s,) if clients in (None, 1) else (clients, s), torch.float64, gen, device)
            want = reference.segment_mix(a, b, off.to(device), lam)
            with ops.prefer("native"):
                assert torch.equal(ops.segment_mix(a, b, off, lam), want)
                # in place into a and into b (where shapes allow), and into a strided buffer
                for name, t in (("a", a), ("b", b)):
                    if t.shape == want.shape:
                        t2 = t.clone()
                        args = (t2, b, off, lam) if name == "a" else (a, t2, off, lam)
                        assert ops.segment_mix(*args, out=t2) is t2 and torch.equal(t2, want)
                if clients and "a" in batched:
                    # rows of a larger buffer (row stride 2P) and a column-strided output
                    big = torch.zeros((clients, 2 * p), dtype=dtype, device=device)
                    view = big[:, p:]
                    view.copy_(a)
                    ops.segment_mix(view, b, off, lam, out=view)
                    assert torch.equal(view, want) and not big[:, :p].any()
                    col = torch.zeros((p, clients), dtype=dtype, device=device).t()
                    ops.segment_mix(non_contiguous(a), b, off, lam, out=col)
                    assert torch.equal(col, want)
            checked += 1
    assert checked == 5 * 8


def test_each_cuda_op_is_one_kernel_launch_whatever_the_segments_and_clients(monkeypatch):
    """The issue's "one launch per call": counted by the CUDA emulation, which runs the real
    launchers of mix_kernels.cu (FedMix's input and label pairs share one launch each way)."""
    use_emulated_cuda(monkeypatch)
    from cuda_emulation import launches

    gen = torch.Generator().manual_seed(4)

    def count(fn):
        before = launches()
        with ops.prefer("native"):
            out = fn()
        return launches() - before, out

    for clients, nseg in ((1, 1), (16, 1000), (3, 2500)):
        off = ops.segment_offsets([7] * nseg)
        a, b = rand((clients, 7 * nseg), torch.float32, gen), rand((7 * nseg,), torch.float32, gen)
        lam = rand((clients, nseg), torch.float64, gen)
        assert count(lambda: ops.segment_mix(a, b, off, lam))[0] == 1
        assert count(lambda: ops.segment_mix(a, b, off, lam, out=a))[0] == 1
    for batch, per_sample in ((2, False), (300, True)):
        x = rand((batch, 3, 8, 8), torch.float32, gen).requires_grad_(True)
        xbar = rand((batch if per_sample else 1, 3, 8, 8), torch.float32, gen).requires_grad_(True)
        y, ybar = rand((batch, 10), torch.float32, gen), rand((1, 10), torch.float32, gen).requires_grad_(True)
        n, (xm, ym) = count(lambda: ops.mix_inputs_labels(x, y, ybar, 0.3, xbar))
        assert n == 1
        assert count(lambda: torch.autograd.grad((xm.sum() + ym.sum()), (x, xbar, ybar)))[0] == 1
        n, s = count(lambda: ops.fedmix_l3(x, xbar, 0.2))
        assert n == 1
        assert count(lambda: torch.autograd.grad(s.sum(), (x, xbar)))[0] == 1


@pytest.mark.parametrize("where", ["cuda-emulated", "cuda"])
def test_binned_add_cuda_kernel_equals_its_pytorch_definition(where, monkeypatch):
    """The CUDA deposit of fedhpc.reproducible_sum (the engine's rank-independent upload sum)
    against its reference, bit for bit (NaN payloads too): float32 and float64 terms, raises of
    the top position by 1, 2 and 3+, non-finite terms, alpha, an offset and a strided view; one
    launch per add. Under the emulation also with 1 and 132 multiprocessors: the grid-stride
    loop and a grid larger than the data give the same bits."""
    from test_reproducible_sum import assert_same_bits, binned_cases, deposit_with

    if where == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if where == "cuda-emulated":
        use_emulated_cuda(monkeypatch)
        from cuda_emulation import launches
    device = "cuda" if where == "cuda" else "cpu"
    for dtype, seq in binned_cases():
        want = deposit_with("torch", seq, device)
        for sms in ("1", "132") if where == "cuda-emulated" else (None,):
            if sms is not None:
                monkeypatch.setenv("FEDHPC_EMU_SMS", sms)
                before = launches()
            assert_same_bits(deposit_with("native", seq, device), want, (dtype, sms))
            if sms is not None:
                assert launches() - before == len(seq) + 1


def test_cuda_results_do_not_depend_on_the_gpus_size(monkeypatch):
    """The CUDA kernels size their grids from the GPU's multiprocessor count, cap them (4096
    blocks for the reducing kernels, CUDA's 65535 for gridDim.y) and loop over the rest;
    reductions sum in an order fixed by the shapes. So a model is bit-identical on any GPU:
    checked under the emulation with 1, 3 and 132 (an H100's) multiprocessors, and with the caps
    lowered to 2 and 3 so that the row and tile loops a GPU runs only past 4096 rows or tiles, or
    65535 rows, run here; forward and backward, with and without column sums, and segment_mix
    with a shared global split into row groups of 7, 3 + 3 + 1 and 1 clients, also in place."""
    use_emulated_cuda(monkeypatch)
    from cuda_emulation import blocks

    gen = torch.Generator().manual_seed(6)
    # rows long enough that the grids need more blocks than a small GPU gives them
    x = rand((4, 3, 32, 32), torch.float32, gen)
    xbar, y, ybar = rand((1, 3, 32, 32), torch.float32, gen), rand((4, 10), torch.float32, gen), rand((1, 10), torch.float32, gen)
    xbar_each = rand((4, 3, 32, 32), torch.float32, gen)
    a, b = rand((3, 100000), torch.float32, gen), rand((100000,), torch.float32, gen)
    off, lam = ops.segment_offsets([1000, 0, 3, 98997]), rand((3, 4), torch.float64, gen)
    a7, b7 = rand((7, 32768), torch.float32, gen), rand((32768,), torch.float32, gen)
    off7, lam7 = ops.segment_offsets([5000, 27768]), rand((7, 2), torch.float64, gen)
    probes = [rand((4, 3, 32, 32), torch.float32, gen), rand((4, 10), torch.float32, gen), rand((4,), torch.float32, gen)]

    def everything():
        leaves = [t.clone().requires_grad_(True) for t in (x, xbar, y, ybar)]
        each = [t.clone().requires_grad_(True) for t in (x, xbar_each, y)]
        with ops.prefer("native"):
            # a mean per batch: its gradient is a column sum (the tile kernels)
            xm, ym = ops.mix_inputs_labels(leaves[0], leaves[2], leaves[3], 0.3, leaves[1])
            s = ops.fedmix_l3(leaves[0], leaves[1], 0.2)
            grads = torch.autograd.grad([xm, ym, s], leaves, probes)
            # a mean per sample, ybar without a gradient: elementwise backward kernels only
            xe, ye = ops.mix_inputs_labels(each[0], each[2], ybar, 0.3, each[1])
            se = ops.fedmix_l3(each[0], each[1], 0.2)
            grads_each = torch.autograd.grad([xe, ye, se], each, probes)
            in_place = a7.clone()  # a row or group mixed twice shows only in place
            ops.segment_mix(in_place, b7, off7, lam7, out=in_place)
            return [xm, ym, s, *grads, xe, ye, se, *grads_each, ops.segment_mix(a, b, off, lam), in_place,
                    ops.segment_mix(a7, b7, off7, lam7)]

    runs, grid_blocks = {}, {}
    for sms, cap in (("1", ""), ("3", ""), ("132", ""), ("3", "2"), ("132", "3")):
        monkeypatch.setenv("FEDHPC_EMU_SMS", sms)
        monkeypatch.setenv("FEDHPC_EMU_GRID_CAP", cap)
        before = blocks()
        runs[sms, cap] = everything()
        grid_blocks[sms, cap] = blocks() - before
    assert grid_blocks["1", ""] < grid_blocks["3", ""] < grid_blocks["132", ""]  # the grids did change
    assert grid_blocks["3", "2"] < grid_blocks["3", ""] and grid_blocks["132", "3"] < grid_blocks["132", ""]
    for key in runs:
        assert all(torch.equal(u, v) for u, v in zip(runs["1", ""], runs[key])), key
    with ops.prefer("torch"):
        assert torch.equal(runs["1", ""][-1], ops.segment_mix(a7, b7, off7, lam7))
        assert torch.equal(runs["1", ""][-2], runs["1", ""][-1])


def test_segment_mix_against_a_shared_global_fills_the_gpu(monkeypatch):
    """With one global row for every client, segment_mix reads each global vector once for a
    group of clients (blockIdx.y). Clients whose rows alone fill the GPU form one group (the
    global read once); shorter rows split the clients into as many groups as fill it, and no
    more. On an H100, one group at 16 clients x 1M parameters was a 256-block grid at 0.77 of
    copy bandwidth, where the ~1024-block grids of larger states reached 0.88-0.91."""
    use_emulated_cuda(monkeypatch)
    from cuda_emulation import last_grid

    gen = torch.Generator().manual_seed(8)
    monkeypatch.setenv("FEDHPC_EMU_SMS", "3")  # 24 resident blocks of 256 threads
    monkeypatch.setenv("FEDHPC_EMU_GRID_CAP", "")

    def grid(clients, p):
        a, b = rand((clients, p), torch.float32, gen), rand((p,), torch.float32, gen)
        off, lam = ops.segment_offsets([p // 3, p - p // 3]), rand((clients, 2), torch.float64, gen)
        with ops.prefer("native"):
            ops.segment_mix(a, b, off, lam)
        return last_grid()

    # a row of 8192 vectors is 8 blocks of 1024: 16 clients in 3 groups (6, 6 and 4 clients)
    assert grid(16, 4 * 8192) == (8, 3)
    assert grid(2, 4 * 8192) == (8, 2)  # no more groups than clients
    # a row of 24 blocks or more fills the GPU alone: one group, the global read once
    assert grid(16, 4 * 24 * 1024) == (24, 1)
    assert grid(16, 4 * 40 * 1024) == (24, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_mix_of_large_states_streams_its_output(dtype):
    """Outputs of 16 MiB and more take the non-temporal-store path (CPU): still bit-identical,
    with an output that starts off the 16-byte grid and a length that is not a multiple of 4."""
    native_or_skip()
    gen = torch.Generator().manual_seed(7)
    p = (17 << 20) // torch.tensor([], dtype=dtype).element_size() + 3
    off = ops.segment_offsets([5, p // 2, 0, p - p // 2 - 5])
    a, b = rand((1, p), dtype, gen), rand(p, dtype, gen)
    lam = rand((1, 4), dtype, gen)
    want = reference.segment_mix(a, b, off, lam)
    buf = torch.empty(p + 1, dtype=dtype)
    out = buf[1:].view(1, p)  # one element past an aligned allocation
    with ops.prefer("native"):
        ops.segment_mix(a, b, off, lam, out=out)
        assert torch.equal(out, want)
        assert torch.equal(ops.segment_mix(a, b, off, lam), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_mix_of_many_clients_against_a_large_shared_state(dtype):
    """A shared state over 8 MB takes the column-tiled path (CPU): bit-identical, with a
    ragged tail tile and segments that cross tile boundaries."""
    native_or_skip()
    gen = torch.Generator().manual_seed(11)
    p = (9 << 20) // torch.tensor([], dtype=dtype).element_size() + 5
    lengths = [70001, 3, p - 70001 - 3 - 131072, 131072]
    off = ops.segment_offsets(lengths)
    a, b = rand((3, p), dtype, gen), rand(p, dtype, gen)
    lam = rand((3, 4), dtype, gen)
    with ops.prefer("native"):
        assert torch.equal(ops.segment_mix(a, b, off, lam), reference.segment_mix(a, b, off, lam))
        assert torch.equal(ops.segment_mix(b, a, off, lam), reference.segment_mix(b, a, off, lam))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [True, False])
def test_streamed_segment_mix_with_segments_shorter_than_a_vector(dtype, shared):
    """The streamed path (outputs of 16 MiB and more) keeps whole-vector stores across segment
    boundaries, assembling a vector lane by lane where segments end inside it: runs of empty,
    1..9-element and long segments, per-client coefficients, rows off the vector grid (odd row
    length, output one element past an aligned allocation), tiled (one shared state) and flat."""
    native_or_skip()
    gen = torch.Generator().manual_seed(13)
    size = torch.tensor([], dtype=dtype).element_size()
    p = (9 << 20) // size + 7
    tiny = torch.randint(0, 10, (3000,), generator=gen).tolist()
    lengths = tiny[:1500] + [p // 3] + tiny[1500:]
    lengths.append(p - sum(lengths))
    off = ops.segment_offsets(lengths)
    rows = 3
    a = rand((rows, p), dtype, gen)
    b = rand(p, dtype, gen) if shared else rand((rows, p), dtype, gen)
    lam = rand((rows, len(lengths)), dtype, gen)
    buf = torch.empty(rows * p + 1, dtype=dtype)
    out = buf[1:].view(rows, p)
    with ops.prefer("native"):
        ops.segment_mix(a, b, off, lam, out=out)
    assert torch.equal(out, reference.segment_mix(a, b, off, lam))


def test_segment_mix_rejects_bad_input():
    off = ops.segment_offsets([2, 3])
    a, b = torch.rand(2, 5), torch.rand(5)
    for backend in ("torch", "native"):
        if backend == "native" and ops.native().module is None:
            continue
        with ops.prefer(backend):
            for bad_off, msg in ((torch.tensor([1, 2, 5]), "from 0 to P"), (torch.tensor([0, 4, 3, 5]), "decreasing"),
                                 (torch.tensor([0, 2, 6]), "from 0 to P")):
                with pytest.raises(ValueError, match=msg):
                    ops.segment_mix(a, b, bad_off, torch.rand(len(bad_off) - 1))
            with pytest.raises(ValueError, match="coefficients per client"):
                ops.segment_mix(a, b, off, torch.rand(3))
            with pytest.raises(ValueError, match="number of clients"):
                ops.segment_mix(a, torch.rand(3, 5), off, torch.rand(2))
            with pytest.raises(ValueError, match="out must be"):
                ops.segment_mix(a, b, off, torch.rand(2), out=torch.empty(5))
            # offsets are checked once per content: an in-place change after a good call is caught
            changed = off.clone()
            ops.segment_mix(a, b, changed, torch.rand(2))
            changed[1] = 6
            with pytest.raises(ValueError, match="from 0 to P"):
                ops.segment_mix(a, b, changed, torch.rand(2))
            changed[1] = 2
            ops.segment_mix(a, b, changed, torch.rand(2))
            with pytest.raises(ValueError, match="from 0 to P"):  # the same, checked tensor on a smaller state
                ops.segment_mix(torch.rand(2, 4), torch.rand(4), changed, torch.rand(2))
    if ops.native().module is not None:  # a partial overlap would race in the parallel kernel
        buf = torch.rand(2, 6)
        with ops.prefer("native"), pytest.raises(RuntimeError, match="overlap"):
            ops.segment_mix(buf[:, :5], b, off, torch.rand(2), out=buf[:, 1:])


def test_the_cpu_kernels_really_run_on_several_threads():
    """at::parallel_for is an OpenMP pragma in torch's headers: built without -fopenmp the
    kernels silently ran on one thread (2 threads gained nothing in benchmarks/bench_ops.py)."""
    native_or_skip()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ops.native().module.parallel_threads() == 2
        torch.set_num_threads(1)
        assert ops.native().module.parallel_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_results_do_not_depend_on_the_thread_count():
    native_or_skip()
    gen = torch.Generator().manual_seed(4)
    g, xbar = rand((16, 40000), torch.float32, gen), rand((1, 40000), torch.float32, gen)
    y, ybar = rand((16, 10), torch.float32, gen), rand((1, 10), torch.float32, gen)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            gl, xl = g.clone().requires_grad_(True), xbar.clone().requires_grad_(True)
            with ops.prefer("native"):
                s = ops.fedmix_l3(gl, xl, 0.2)
                xm, _ = ops.mix_inputs_labels(gl, y, ybar, 0.2, xl)
            grads = torch.autograd.grad((s.sum() + xm.sum()), (gl, xl))
            results.append([s.detach(), *grads])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(u, v) for u, v in zip(*results))


# --------------------------------------------------------------------------- autograd to second order

@pytest.mark.parametrize("per_sample", [False, True])
def test_gradcheck_and_gradgradcheck_native_fedmix_ops(per_sample, device):
    native_or_skip()
    gen = torch.Generator().manual_seed(5)
    b = 3
    g = rand((b, 2, 3), torch.float64, gen, device).requires_grad_(True)
    xbar = rand((b if per_sample else 1, 2, 3), torch.float64, gen, device).requires_grad_(True)
    y = rand((b, 4), torch.float64, gen, device).requires_grad_(True)
    ybar = rand((b if per_sample else 1, 4), torch.float64, gen, device).requires_grad_(True)
    with ops.prefer("native"):
        def l3(g_, x_):
            return ops.fedmix_l3(g_, x_, 0.35)

        def mix(x_, xb_, y_, yb_):
            return ops.mix_inputs_labels(x_, y_, yb_, 0.35, xb_)

        def mix_fedmix(x_, y_, yb_):  # FedMix's x' = (1-l) x, no mean in the input
            return ops.mix_inputs_labels(x_, y_, yb_, 0.35)

        assert torch.autograd.gradcheck(l3, (g, xbar))
        assert torch.autograd.gradgradcheck(l3, (g, xbar))
        assert torch.autograd.gradcheck(mix, (g, xbar, y, ybar))
        assert torch.autograd.gradgradcheck(mix, (g, xbar, y, ybar))
        assert torch.autograd.gradgradcheck(mix_fedmix, (g, y, ybar))
        # a native Function really ran (not the reference's plain autograd graph)
        assert "L3Fn" in l3(g, xbar).grad_fn.name()


# --------------------------------------------------------------------------- FedMix with and without

def tiny_problem(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    gen = torch.Generator().manual_seed(6)
    x = rand((8, 12), dtype, gen)
    y = torch.nn.functional.one_hot(torch.randint(4, (8,), generator=gen), 4).to(dtype)
    xbar, ybar = rand((1, 12), dtype, gen) + 0.5, torch.softmax(torch.randn(1, 4, generator=gen, dtype=dtype), -1)
    return net, x, y, xbar, ybar


@pytest.mark.parametrize("inputs_need_grad", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fedmix_loss_and_its_second_order_gradient_match_without_the_extension(dtype, inputs_need_grad):
    """Images (raw inputs) and, with inputs_need_grad, text: there x and xbar are embeddings that
    carry gradients to the embedding table, through both ops' backwards."""
    from fedhpc.algorithms.mixing import fedmix_loss

    native_or_skip()
    net, x, y, xbar, ybar = tiny_problem(dtype)
    if inputs_need_grad:
        x, xbar = x.requires_grad_(True), xbar.requires_grad_(True)
    wrt = list(net.parameters()) + ([x, xbar] if inputs_need_grad else [])
    out = {}
    for backend in ("native", "torch"):
        with ops.prefer(backend):
            total, terms = fedmix_loss(net, x, y, xbar, ybar, 0.2, return_terms=True)
            grads = torch.autograd.grad(total, wrt, retain_graph=True)
            g3 = torch.autograd.grad(terms["l3"], wrt)  # l3 alone: second order in the weights
        out[backend] = (total.detach(), [g.detach() for g in grads], [g.detach() for g in g3])
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    (tn, gn, g3n), (tr, gr, g3r) = out["native"], out["torch"]
    assert torch.allclose(tn, tr, rtol=tol)
    assert float(sum(g.abs().sum() for g in g3n)) > 1e-4  # l3 moves the weights on both backends
    for a, b in zip(gn + g3n, gr + g3r):
        assert torch.allclose(a, b, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def run_envs():
    """Launcher environments with and without the extension, checked to resolve as named."""
    from conftest import clean_env

    native_or_skip()
    envs = {"native": clean_env(), "torch": clean_env(FEDHPC_NO_EXT="1")}
    # A child of this environment finds the extension too (FEDHPC_NO_EXT=1 is tested elsewhere).
    report = subprocess.run([sys.executable, "-m", "fedhpc.ops", "--json"], env=envs["native"], cwd=_sources.REPO,
                            capture_output=True, text=True, timeout=300)
    assert json.loads(report.stdout)["extension"] != "none", report.stdout
    return envs


@pytest.mark.parametrize("algo", ["fedmix", "pmixfed"])
def test_runs_give_the_same_model_with_and_without_the_extension(algo, run_envs, tmp_path):
    """Image FedMix and pMixFed touch the ops only elementwise (the mean needs no gradient), so
    the two runs agree bit for bit; the bound leaves room for summation order elsewhere."""
    from conftest import FAST, final_weights, launch, max_diff

    from fedhpc.algorithms import ALGORITHMS, load_algorithm_modules
    load_algorithm_modules()
    if algo not in ALGORITHMS:  # pMixFed arrives with its own issue
        pytest.skip(f"{algo} is not in this tree yet")
    extra = ["--lam", "0.1", "--select", "sample"] if algo == "fedmix" else []
    args = FAST + ["--rounds", "2", "--algo", algo, "--seed", "3"] + extra
    outs = {}
    for name, env in run_envs.items():
        out = str(tmp_path / name)
        proc = launch(args + ["--out", out], env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[name] = final_weights(out)
    diff = max_diff(outs["native"], outs["torch"])
    print(f"{algo}: max |native - torch| over the final weights: {diff:.3g}")
    assert diff < 1e-5
    moved = max(float(v.abs().max()) for v in outs["torch"].values())
    assert moved > 1e-2  # the comparison is over a trained model, not two zero tensors


@pytest.mark.parametrize("algo", ["fedmix", "pmixfed"])
def test_runs_give_the_same_model_through_the_cuda_kernels(algo, monkeypatch):
    """The test above for the CUDA build, under the emulation and in this process: two rounds with
    every op on the CUDA kernels against two on the pure-PyTorch reference."""
    use_emulated_cuda(monkeypatch)
    from conftest import FAST
    from cuda_emulation import launches

    from fedhpc.config import parse_args
    from fedhpc.engine import Engine
    from fedhpc.world import World
    extra = ["--lam", "0.1", "--select", "sample"] if algo == "fedmix" else []
    argv = FAST + ["--algo", algo, "--seed", "3"] + extra
    finals, ran = {}, {}
    for backend in ("native", "torch"):
        eng = Engine(*parse_args(argv), World(threads=1))
        start = eng.global_state.clone()
        before = launches()
        with ops.prefer(backend):
            for t in range(2):
                eng.run_round(t)
        ran[backend] = launches() - before
        finals[backend] = eng.global_state
    assert ran["native"] > 0 and ran["torch"] == 0  # the CUDA kernels really ran, and only there
    assert float((finals["native"] - finals["torch"]).abs().max()) < 1e-5
    assert float((finals["torch"] - start).abs().max()) > 1e-2  # a trained model, not the initial one


# --------------------------------------------------------------------------- loader and report

def test_backend_report_and_disable_switch():
    env = {k: v for k, v in os.environ.items() if k not in (_sources.ENV_DISABLE, _sources.ENV_NO_JIT)}
    off = subprocess.run([sys.executable, "-m", "fedhpc.ops", "--json"], capture_output=True, text=True,
                         env={**env, _sources.ENV_DISABLE: "1"}, cwd=_sources.REPO, timeout=120)
    assert off.returncode == 0, off.stderr
    report = json.loads(off.stdout)
    assert report["extension"] == "none" and any(_sources.ENV_DISABLE in n for n in report["notes"])
    assert {w["cpu"] for w in report["ops"].values()} == {"torch"} and set(report["ops"]) == set(ops.OPS)
    nat = ops.native()
    if nat.module is not None:  # the module in use was built from the sources on disk
        assert nat.module.sources_hash == _sources.sources_hash()
        assert nat.module.abi_version == _loader.ABI_VERSION
        assert ops.backends()["segment_mix"]["cpu"] == f"native ({nat.origin})"
    # Outside native kernels' reach (float16), every op quietly runs the reference...
    h = torch.rand(2, 3, dtype=torch.float16)
    assert torch.equal(ops.fedmix_l3(h, h[:1], 0.5), reference.fedmix_l3(h, h[:1], 0.5))
    # ...and prefer('native') says so instead.
    with ops.prefer("native"), pytest.raises(RuntimeError, match="no native kernel"):
        ops.fedmix_l3(h, h[:1], 0.5)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# Run in a child with FEDHPC_NO_SIMD=1: the baseline loops against the reference.
_BASELINE_CHILD = """
import json, sys
import torch
sys.path.insert(0, "tests")
from test_reproducible_sum import assert_same_bits, binned_cases, deposit_with
from fedhpc import ops
from fedhpc.ops import reference
torch.set_num_threads(1)
for dtype, seq in binned_cases():
    assert_same_bits(deposit_with("native", seq), deposit_with("torch", seq), dtype)
gen = torch.Generator().manual_seed(5)
p = (17 << 20) // 4 + 3  # a streamed output (16 MiB and more), off the vector grid
off = ops.segment_offsets([5, p // 2, 1, 2, 0, p - p // 2 - 8])
a, b, lam = torch.rand(1, p, generator=gen), torch.rand(p, generator=gen), torch.rand(1, 6, generator=gen)
out = torch.empty(p + 1)[1:].view(1, p)
with ops.prefer("native"):
    ops.segment_mix(a, b, off, lam, out=out)
assert torch.equal(out, reference.segment_mix(a, b, off, lam))
print(json.dumps(ops.native().module.cpu_isa()))
"""


def test_baseline_cpu_loops_equal_the_reference_and_are_reported():
    """The CPU kernels pick AVX2 / AVX paths where the processor has them, so the baseline loops
    (scalar deposit, SSE2 streamed stores) would never run on such a machine: FEDHPC_NO_SIMD=1
    keeps them, and in a child they give the reference's bits. Here, the vector paths are what
    runs where the processor has them (the other tests then cover them)."""
    from conftest import clean_env

    native_or_skip()
    isa = ops.native().module.cpu_isa()
    if not _sources.env_flag(_sources.ENV_NO_SIMD):
        flags = _cpu_flags()
        if "avx2" in flags:
            assert isa["binned_add"] == "avx2", isa
        if "avx" in flags:
            assert isa["segment_mix"] == "avx", isa
    child = subprocess.run([sys.executable, "-c", _BASELINE_CHILD], env=clean_env(**{_sources.ENV_NO_SIMD: " 1 "}),
                           cwd=_sources.REPO, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    baseline = json.loads(child.stdout.strip().splitlines()[-1])
    assert baseline["binned_add"] == "scalar" and baseline["segment_mix"] in ("sse2", "none (ordinary stores)"), baseline


def test_a_stale_or_foreign_prebuilt_extension_is_refused(monkeypatch):
    """A prebuilt module from other sources (csrc/ edited since pip install) or another ABI is not used."""
    import types

    import fedhpc.ops as pkg
    current = _sources.sources_hash()
    for fake, needle in ((types.SimpleNamespace(abi_version=_loader.ABI_VERSION, sources_hash="0" * 16), "older"),
                         (types.SimpleNamespace(abi_version=-1, sources_hash=current), "ABI")):
        monkeypatch.setitem(sys.modules, "fedhpc.ops._ext", fake)
        monkeypatch.setattr(pkg, "_ext", fake, raising=False)
        module, why = _loader._prebuilt(current)
        assert module is None and needle in why
    fresh = types.SimpleNamespace(abi_version=_loader.ABI_VERSION, sources_hash=current)
    monkeypatch.setitem(sys.modules, "fedhpc.ops._ext", fresh)
    monkeypatch.setattr(pkg, "_ext", fresh, raising=False)
    assert _loader._prebuilt(current)[0] is fresh


def test_setup_py_installs_without_a_compiler_or_with_the_switch():
    """The decision part of setup.py (no build is run: `--version` only)."""
    for extra, needle in (({"CXX": "/nonexistent/c++"}, "no C++ compiler"), ({_sources.ENV_DISABLE: "1"}, "is set")):
        env = {**{k: v for k, v in os.environ.items() if k != _sources.ENV_DISABLE}, **extra}
        proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=_sources.REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("0.1.0"), proc.stderr[-2000:]
        assert needle in proc.stderr


# --------------------------------------------------------------------------- CUDA sources

def test_the_cuda_emulation_itself(tmp_path):
    """The emulation behind device "cuda-emulated" (tests/cuda_emulation/) on small kernels of its
    own: barriers order shared memory and a missing one is caught, a launch covers its grid once,
    bad launches and divergent barriers are errors, intrinsics round once (self_check.cpp)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip("no C++ compiler")
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emulation")
    exe = str(tmp_path / "self_check")
    build = subprocess.run([compiler, "-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Werror",
                            f"-I{os.path.join(here, 'include')}", os.path.join(here, "self_check.cpp"), "-o", exe],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
    assert "different numbers of __syncthreads() barriers" in run.stderr


def test_cuda_kernels_compile_with_nvcc(tmp_path):
    """Compile-only: mix_kernels.cu needs no torch header, so it builds wherever nvcc is."""
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("nvcc not found: the CUDA kernels cannot be compile-checked on this machine")
    src = os.path.join(_sources.CSRC, "cuda", "mix_kernels.cu")
    obj = str(tmp_path / "mix_kernels.o")
    proc = subprocess.run([nvcc, *_sources.NVCC_FLAGS, "-arch=sm_80", "-Werror", "all-warnings", "-c", src, "-o", obj],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    symbols = subprocess.run(["nm", "-C", obj], capture_output=True, text=True).stdout
    for name in ("launch_mix_forward<float>", "launch_l3_backward<double>", "launch_segment_mix<float>"):
        assert name in symbols, name


def test_cuda_binding_compiles(tmp_path):
    """Syntax-checks the torch-facing CUDA side, built only where torch has CUDA: cuda/ops_cuda.cpp
    (about 5 s of CPU) and, with FEDHPC_TEST_CUDA_BINDING=1, ops.cpp's CUDA branches too (8 s more).

    A CPU torch wheel lacks one generated header (c10/cuda/impl/cuda_cmake_macros.h): an empty
    stand-in is used for it.
    """
    import sysconfig

    from torch.utils.cpp_extension import include_paths
    cuda_inc = "/usr/local/cuda/include"
    if not os.path.exists(os.path.join(cuda_inc, "cuda_runtime.h")) or shutil.which("c++") is None:
        pytest.skip("no C++ compiler or no CUDA headers under /usr/local/cuda/include")
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    incs = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_inc}",
                                                  f"-idirafter{tmp_path / 'stub'}"]
    cmd = ["c++", "-std=c++20", "-fsyntax-only", "-Wall", "-DFEDHPC_WITH_CUDA", "-DTORCH_EXTENSION_NAME=x", *incs]
    files = ["cuda/ops_cuda.cpp"] + (["ops.cpp"] if _sources.env_flag("FEDHPC_TEST_CUDA_BINDING") else [])
    procs = [subprocess.Popen(cmd + [os.path.join(_sources.CSRC, f)], stderr=subprocess.PIPE, text=True)
             for f in files]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-4000:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_vectorised_and_misaligned_paths_equal_the_reference(dtype, device):
    """Rows long enough for the CUDA kernels' 16-byte vectors, and the same data one element off
    alignment (a storage offset of 1), which must take the scalar path with the same numbers."""
    native_or_skip()
    gen = torch.Generator().manual_seed(9)

    def shifted(t):  # same values, data pointer one element past a 16-byte boundary
        buf = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out

    for make in (lambda t: t, shifted):
        x, y = make(rand((300, 3, 8, 8), dtype, gen, device)), make(rand((300, 10), dtype, gen, device))
        ybar = rand((1, 10), dtype, gen, device)
        for xbar in (rand((300, 3, 8, 8), dtype, gen, device), rand((1, 3, 8, 8), dtype, gen, device)):
            leaves = [t.clone().requires_grad_(True) for t in (x, make(xbar), y, ybar)]
            with ops.prefer("native"):
                got = ops.mix_inputs_labels(leaves[0], leaves[2], leaves[3], 0.3, leaves[1])
            want = reference.mix_inputs_labels(leaves[0], leaves[2], leaves[3], 0.3, leaves[1])
            assert all(torch.equal(g_, w_) for g_, w_ in zip(got, want))
            probes = [rand(t.shape, dtype, gen, device) for t in want]
            tol = 1e-5 if dtype == torch.float32 else 1e-13
            for gn, gr in zip(torch.autograd.grad(got, leaves, probes), torch.autograd.grad(want, leaves, probes)):
                assert torch.allclose(gn, gr, rtol=tol, atol=tol)
            g, xl = make(rand((300, 3, 8, 8), dtype, gen, device)).requires_grad_(True), make(xbar).requires_grad_(True)
            with ops.prefer("native"):
                s = ops.fedmix_l3(g, xl, 0.2)
            r = reference.fedmix_l3(g, xl, 0.2)
            probe = rand((300,), dtype, gen, device)
            gn, gr = torch.autograd.grad(s, (g, xl), probe), torch.autograd.grad(r, (g, xl), probe)
            assert torch.equal(gn[0], gr[0]) and torch.allclose(gn[1], gr[1], rtol=tol, atol=tol)
        off = ops.segment_offsets([1000, 3, 0, 5093])
        a, b = make(rand((3, 6096), dtype, gen, device)), make(rand((6096,), dtype, gen, device))
        lam = rand((3, 4), torch.float64, gen, device)
        want = reference.segment_mix(a, b, off.to(device), lam)
        with ops.prefer("native"):
            assert torch.equal(ops.segment_mix(a, b, off, lam), want)
            assert ops.segment_mix(a, b, off, lam, out=a) is a and torch.equal(a, want)
