// Declarations shared by the binding (ops.cpp), the CPU kernels (cpu/) and the
// torch-facing CUDA binding (cuda/ops_cuda.cpp). The maths, the shapes and the
// pure-PyTorch reference every kernel must agree with are in fedhpc/ops/.
//
// Every entry point takes contiguous (rows, ...) tensors the Python wrapper has already
// checked, which the kernels read as (rows, cols) with cols the product of the trailing
// sizes: no reshape on the way in, outputs allocated in their final shape (each view or
// reshape is a dispatcher call, a microsecond that a small FedMix batch notices). The
// kernels only see float32 / float64.
#pragma once

// ATen's Tensor only: the kernels do not pay for torch/extension.h (pybind, the C++ frontend),
// which only the binding (ops.cpp) includes.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

namespace fedhpc {

using at::Tensor;

// Columns of a (rows, ...) tensor read as (rows, cols): from the shape, so that an empty batch
// keeps its row length.
inline int64_t cols_of(const Tensor& t) {
  int64_t cols = 1;
  for (int64_t d = 1; d < t.dim(); ++d) cols *= t.size(d);
  return cols;
}

// Input and label mixing of FedMix / NaiveMix (one call, both pairs):
//   xm = (1-lam) x + lam xbar   (xbar undefined: xm = (1-lam) x, FedMix's x')
//   ym = (1-lam) y + lam ybar
// x (B, Nx), xbar (1 or B, Nx); y (B, Ny), ybar (1 or B, Ny); outputs shaped as x and y.
std::tuple<Tensor, Tensor> mix_forward_cpu(const Tensor& x, const Tensor& xbar, const Tensor& y,
                                           const Tensor& ybar, double lam);

// Its transpose: gx = (1-lam) gxm, gxbar = lam gxm summed over the rows xbar was broadcast to
// (xbar_rows 0: no xbar), same for the labels. need = {x, xbar, y, ybar}; unneeded outputs are undefined,
// as are those of an undefined (zero) gxm or gym. gx, gy are shaped as gxm, gym; gxbar, gybar (rows, cols).
std::tuple<Tensor, Tensor, Tensor, Tensor> mix_backward_cpu(const Tensor& gxm, const Tensor& gym,
                                                            int64_t xbar_rows, int64_t ybar_rows, double lam,
                                                            std::array<bool, 4> need);

// Per-sample FedMix l3: s_i = lam <g_i, xbar_{r(i)}>, g (B, N), xbar (1 or B, N) -> s (B,).
Tensor l3_forward_cpu(const Tensor& g, const Tensor& xbar, double lam);

// Its backward: grad_g_ij = lam go_i xbar_{r(i)j}; grad_xbar = lam go_i g_ij, summed over i when xbar has 1 row.
std::tuple<Tensor, Tensor> l3_backward_cpu(const Tensor& go, const Tensor& g, const Tensor& xbar, double lam,
                                           bool need_g, bool need_xbar);

// Segmented mixup out[c, p] = l * a[c, p] + (1 - l) * b[c, p], l = lam[c, s] for offsets[s] <= p < offsets[s+1].
// a, b, out (C, P) with unit column stride (any row stride; b may have row stride 0); lam (C or 1, S)
// contiguous, same dtype; offsets (S+1,) int64 on the CPU. out may be a or b exactly.
void segment_mix_cpu(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& lam, Tensor& out);

// fedhpc.reproducible_sum's deposit (reference: fedhpc/ops/reference.py binned_add_): alpha * terms
// into elements start .. start + n - 1 of bins (kBinnedBins, N) float64 and top (N,) int8, both
// contiguous; terms (n,) float32 or float64, contiguous, on the same device (CPU here; the CUDA
// twin is binned_add_cuda).
constexpr int kBinnedBins = 3;
void binned_add_cpu(const Tensor& terms, double alpha, Tensor& bins, Tensor& top, int64_t start);

// The CPU kernels' vector paths are picked once per process from what the processor has (AVX2 for
// binned_add_cpu, AVX for segment_mix's streamed stores), unless FEDHPC_NO_SIMD is set (as
// fedhpc.ops._sources.env_flag reads it: anything but '', 0, false, no, off), which keeps the
// baseline loops: the tests run them on machines that would never take them, and a user can rule
// the vector paths out. Every path gives the same bits.
inline bool cpu_simd_allowed() {
  static const bool allowed = [] {
    const char* raw = std::getenv("FEDHPC_NO_SIMD");
    std::string v;  // stripped at both ends, lower case
    for (const char* c = raw ? raw : ""; *c; ++c) v += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    const char* blank = " \t\n\r\f\v";
    v.erase(v.find_last_not_of(blank) + 1);
    v.erase(0, std::min(v.find_first_not_of(blank), v.size()));
    return v.empty() || v == "0" || v == "false" || v == "no" || v == "off";
  }();
  return allowed;
}
// The path each CPU kernel takes here ("avx2", "avx", "sse2", "scalar"): python -m fedhpc.ops reports them.
const char* binned_add_cpu_isa();
const char* segment_mix_stream_cpu_isa();

// Device dispatch with the layout checks (ops.cpp): what the autograd Functions call.
std::tuple<Tensor, Tensor> mix_forward(const Tensor& x, const std::optional<Tensor>& xbar, const Tensor& y,
                                       const Tensor& ybar, double lam);
std::tuple<Tensor, Tensor, Tensor, Tensor> mix_backward(const Tensor& gxm, const Tensor& gym, int64_t xbar_rows,
                                                        int64_t ybar_rows, double lam, bool need_x, bool need_xbar,
                                                        bool need_y, bool need_ybar);
Tensor l3_forward(const Tensor& g, const Tensor& xbar, double lam);
std::tuple<Tensor, Tensor> l3_backward(const Tensor& go, const Tensor& g, const Tensor& xbar, double lam,
                                       bool need_g, bool need_xbar);

// Autograd-aware ops on (B, ...) tensors (autograd.cpp), differentiable to any order:
//   mix(x, xbar, y, ybar, lam) -> (xm, ym)  as mix_forward;   l3(g, xbar, lam) -> s (B,)  as l3_forward.
std::tuple<Tensor, Tensor> mix(const Tensor& x, const std::optional<Tensor>& xbar, const Tensor& y,
                               const Tensor& ybar, double lam);
Tensor l3(const Tensor& g, const Tensor& xbar, double lam);

#ifdef FEDHPC_WITH_CUDA
std::tuple<Tensor, Tensor> mix_forward_cuda(const Tensor& x, const Tensor& xbar, const Tensor& y,
                                            const Tensor& ybar, double lam);
std::tuple<Tensor, Tensor, Tensor, Tensor> mix_backward_cuda(const Tensor& gxm, const Tensor& gym,
                                                             int64_t xbar_rows, int64_t ybar_rows, double lam,
                                                             std::array<bool, 4> need);
Tensor l3_forward_cuda(const Tensor& g, const Tensor& xbar, double lam);
std::tuple<Tensor, Tensor> l3_backward_cuda(const Tensor& go, const Tensor& g, const Tensor& xbar, double lam,
                                            bool need_g, bool need_xbar);
// offsets: int64 on the device of a.
void segment_mix_cuda(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& lam, Tensor& out);
void binned_add_cuda(const Tensor& terms, double alpha, Tensor& bins, Tensor& top, int64_t start);
#endif

}  // namespace fedhpc
