// Python binding of fedhpc's native ops: checks the layout contract, then sends each call to
// the CPU kernels (cpu/) or, in a build with CUDA, the CUDA ones (cuda/). The Python wrappers in
// fedhpc/ops/ flatten and validate user inputs; the checks here only guard the contract.
#include "fedhpc_ops.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <map>
#include <mutex>
#include <set>
#include <string>

// FEDHPC_SOURCES_HASH: hex digest of csrc/ given unquoted by the build (quotes do not survive
// every shell between setup.py, ninja and the compiler), turned into a string here.
#ifndef FEDHPC_SOURCES_HASH
#define FEDHPC_SOURCES_HASH unknown
#endif
#define FEDHPC_STR_(x) #x
#define FEDHPC_STR(x) FEDHPC_STR_(x)

namespace fedhpc {
namespace {

// Bumped whenever a signature below changes; fedhpc/ops/_loader.py refuses another value.
constexpr int kAbiVersion = 6;

// A (rows, ...) tensor the kernels read as (rows, cols): dtype and device of `like`, float32/64.
void check_rows(const Tensor& t, const char* name, const Tensor& like) {
  TORCH_CHECK(t.dim() >= 1, "fedhpc ops: ", name, " needs a batch (row) dimension, got a 0-D tensor");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "fedhpc ops: ", name, " has dtype ", t.scalar_type(),
              ", expected ", like.scalar_type());
  TORCH_CHECK(t.device() == like.device(), "fedhpc ops: ", name, " is on ", t.device(), ", expected ",
              like.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
              "fedhpc ops: only float32 and float64 are built, got ", t.scalar_type());
}

void check_2d(const Tensor& t, const char* name, const Tensor& like) {
  TORCH_CHECK(t.dim() == 2, "fedhpc ops: ", name, " must be 2-D (rows, cols), got ", t.dim(), "-D");
  check_rows(t, name, like);
}

// b (1 or a's rows, ...) against a (rows, ...), both read as (rows, cols).
void check_broadcast_rows(const Tensor& b, const Tensor& a, const char* name) {
  TORCH_CHECK(b.size(0) == 1 || b.size(0) == a.size(0), "fedhpc ops: ", name, " must have 1 or ", a.size(0),
              " rows, got ", b.size(0));
  TORCH_CHECK(cols_of(b) == cols_of(a), "fedhpc ops: ", name, " has ", cols_of(b), " elements per row, expected ",
              cols_of(a));
}

// out may be exactly `in` (same memory, same layout: an in-place mix reads each element before
// writing it) or disjoint from it; anything in between could race in a parallel kernel. ATen's
// overlap check gives up on strided views, hence this byte-range test (conservative for
// interleaved views, which are refused although they might not collide).
void check_alias(const Tensor& out, const Tensor& in, const char* name) {
  if (out.numel() == 0 || in.numel() == 0) return;
  bool same = out.data_ptr() == in.data_ptr() && out.sizes() == in.sizes();
  for (int64_t d = 0; same && d < out.dim(); ++d) same = out.size(d) <= 1 || out.stride(d) == in.stride(d);
  if (same) return;
  auto span = [](const Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const char* lo = static_cast<const char*>(t.data_ptr());
    return std::make_pair(lo, lo + (last + 1) * t.element_size());
  };
  const auto [o0, o1] = span(out);
  const auto [i0, i1] = span(in);
  TORCH_CHECK(o1 <= i0 || i1 <= o0, "fedhpc ops: out overlaps ", name,
              " without being it exactly; pass out=", name, " itself (in place) or a separate buffer");
}

[[noreturn]] void no_cuda() {
  TORCH_CHECK(false, "fedhpc ops: this build of the extension has no CUDA kernels");
}

bool with_cuda() {
#ifdef FEDHPC_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

std::tuple<Tensor, Tensor> mix_forward(const Tensor& x_, const std::optional<Tensor>& xbar_, const Tensor& y_,
                                       const Tensor& ybar_, double lam) {
  const Tensor x = x_.contiguous(), y = y_.contiguous(), ybar = ybar_.contiguous();
  const Tensor xbar = xbar_.has_value() && xbar_->defined() ? xbar_->contiguous() : Tensor();
  check_rows(x, "x", x);
  check_rows(y, "y", x);
  check_rows(ybar, "ybar", x);
  TORCH_CHECK(y.size(0) == x.size(0), "fedhpc ops: x and y have different batch sizes");
  check_broadcast_rows(ybar, y, "ybar");
  if (xbar.defined()) {
    check_rows(xbar, "xbar", x);
    check_broadcast_rows(xbar, x, "xbar");
  }
  if (x.is_cuda()) {
#ifdef FEDHPC_WITH_CUDA
    return mix_forward_cuda(x, xbar, y, ybar, lam);
#else
    no_cuda();
#endif
  }
  return mix_forward_cpu(x, xbar, y, ybar, lam);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mix_backward(const Tensor& gxm_, const Tensor& gym_, int64_t xbar_rows,
                                                        int64_t ybar_rows, double lam, bool need_x,
                                                        bool need_xbar, bool need_y, bool need_ybar) {
  // An undefined incoming gradient is zero: its pair gets no gradients (autograd reads undefined as 0).
  if (!gxm_.defined() && !gym_.defined()) return {};
  if (!gxm_.defined()) need_x = need_xbar = false, xbar_rows = 0;
  if (!gym_.defined()) need_y = need_ybar = false, ybar_rows = 1;
  const Tensor gxm = gxm_.defined() ? gxm_.contiguous() : Tensor();
  const Tensor gym = gym_.defined() ? gym_.contiguous() : Tensor();
  const Tensor& like = gxm.defined() ? gxm : gym;
  if (gxm.defined()) check_rows(gxm, "grad_xm", like);
  if (gym.defined()) check_rows(gym, "grad_ym", like);
  TORCH_CHECK(xbar_rows == 0 || xbar_rows == 1 || xbar_rows == gxm.size(0), "fedhpc ops: bad xbar_rows");
  TORCH_CHECK(!gym.defined() || ybar_rows == 1 || ybar_rows == gym.size(0), "fedhpc ops: bad ybar_rows");
  TORCH_CHECK(!gxm.defined() || !gym.defined() || gxm.size(0) == gym.size(0), "fedhpc ops: batch sizes differ");
  const std::array<bool, 4> need{need_x, need_xbar, need_y, need_ybar};
  if (like.is_cuda()) {
#ifdef FEDHPC_WITH_CUDA
    // The CUDA launcher takes both pairs; a zero gradient is an empty one there.
    const auto none = at::empty({0, 0}, like.options());
    return mix_backward_cuda(gxm.defined() ? gxm : none, gym.defined() ? gym : none, xbar_rows, ybar_rows, lam,
                             need);
#else
    no_cuda();
#endif
  }
  return mix_backward_cpu(gxm, gym, xbar_rows, ybar_rows, lam, need);
}

Tensor l3_forward(const Tensor& g_, const Tensor& xbar_, double lam) {
  const Tensor g = g_.contiguous(), xbar = xbar_.contiguous();
  check_rows(g, "g", g);
  check_rows(xbar, "xbar", g);
  check_broadcast_rows(xbar, g, "xbar");
  if (g.is_cuda()) {
#ifdef FEDHPC_WITH_CUDA
    return l3_forward_cuda(g, xbar, lam);
#else
    no_cuda();
#endif
  }
  return l3_forward_cpu(g, xbar, lam);
}

std::tuple<Tensor, Tensor> l3_backward(const Tensor& go_, const Tensor& g_, const Tensor& xbar_, double lam,
                                       bool need_g, bool need_xbar) {
  const Tensor go = go_.contiguous(), g = g_.contiguous(), xbar = xbar_.contiguous();
  check_rows(g, "g", g);
  check_rows(xbar, "xbar", g);
  check_broadcast_rows(xbar, g, "xbar");
  TORCH_CHECK(go.dim() == 1 && go.size(0) == g.size(0) && go.scalar_type() == g.scalar_type() &&
                  go.device() == g.device(),
              "fedhpc ops: grad_s must be (rows,) like g");
  if (g.is_cuda()) {
#ifdef FEDHPC_WITH_CUDA
    return l3_backward_cuda(go, g, xbar, lam, need_g, need_xbar);
#else
    no_cuda();
#endif
  }
  return l3_backward_cpu(go, g, xbar, lam, need_g, need_xbar);
}

// a, b: (C, P) (b may be an expanded (P,) with row stride 0); offsets (S+1,) int64; lam (1 or C, S).
// out: (C, P), written in place; may be a or b exactly, never a partial overlap of them.
namespace {

Tensor segment_mix(const Tensor& a_, const Tensor& b_, const Tensor& offsets_, const Tensor& lam_, Tensor out) {
  auto unit_cols = [](const Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous(); };
  const Tensor a = unit_cols(a_), b = unit_cols(b_);
  check_2d(a, "a", out);
  check_2d(b, "b", out);
  check_2d(out, "out", out);
  TORCH_CHECK(a.sizes() == out.sizes() && b.sizes() == out.sizes(), "fedhpc ops: a, b and out must be (C, P)");
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1, "fedhpc ops: out must have unit column stride");
  at::assert_no_internal_overlap(out);
  check_alias(out, a, "a");
  check_alias(out, b, "b");
  const Tensor lam = lam_.contiguous();
  check_2d(lam, "lam", out);
  const int64_t nseg = offsets_.numel() - 1;
  TORCH_CHECK(offsets_.dim() == 1 && nseg >= 1 && offsets_.scalar_type() == at::kLong,
              "fedhpc ops: offsets must be a 1-D int64 tensor of S+1 >= 2 boundaries");
  TORCH_CHECK(lam.size(1) == nseg && (lam.size(0) == 1 || lam.size(0) == out.size(0)),
              "fedhpc ops: lam must be (1 or C, S) with S = len(offsets) - 1");
  Tensor offsets = offsets_;
  if (offsets.is_cpu()) {  // device offsets are the caller's word (checking them would sync)
    offsets = offsets.contiguous();
    const int64_t* o = offsets.data_ptr<int64_t>();
    TORCH_CHECK(o[0] == 0 && o[nseg] == out.size(1), "fedhpc ops: offsets must run from 0 to P = ", out.size(1),
                ", got ", o[0], " .. ", o[nseg]);
    for (int64_t s = 0; s < nseg; ++s) {
      TORCH_CHECK(o[s] <= o[s + 1], "fedhpc ops: offsets must be non-decreasing (at ", s, ")");
    }
  }
  if (out.is_cuda()) {
#ifdef FEDHPC_WITH_CUDA
    segment_mix_cuda(a, b, offsets.to(out.device(), /*non_blocking=*/true).contiguous(), lam, out);
    return out;
#else
    no_cuda();
#endif
  }
  TORCH_CHECK(offsets.is_cpu(), "fedhpc ops: offsets for CPU tensors must be on the CPU");
  segment_mix_cpu(a, b, offsets, lam, out);
  return out;
}

// The deposit of fedhpc.reproducible_sum: one pass on the CPU, one launch on a GPU, where the
// reference is about fifteen kernels and their temporaries per client upload.
void binned_add(const Tensor& terms, double alpha, Tensor bins, Tensor top, int64_t start) {
  TORCH_CHECK(terms.device() == bins.device() && top.device() == bins.device(),
              "fedhpc ops: binned_add terms, bins and top must be on one device");
  TORCH_CHECK(terms.dim() == 1 && terms.is_contiguous() &&
                  (terms.scalar_type() == at::kFloat || terms.scalar_type() == at::kDouble),
              "fedhpc ops: binned_add terms must be a contiguous 1-D float32 or float64 tensor");
  TORCH_CHECK(bins.dim() == 2 && bins.size(0) == kBinnedBins && bins.is_contiguous() &&
                  bins.scalar_type() == at::kDouble,
              "fedhpc ops: binned_add bins must be a contiguous (", kBinnedBins, ", N) float64 tensor");
  const int64_t n = bins.size(1);
  TORCH_CHECK(top.dim() == 1 && top.size(0) == n && top.is_contiguous() && top.scalar_type() == at::kChar,
              "fedhpc ops: binned_add top must be a contiguous (N,) int8 tensor");
  TORCH_CHECK(start >= 0 && start + terms.numel() <= n, "fedhpc ops: binned_add elements ", start, "..",
              start + terms.numel() - 1, " are outside 0..", n - 1);
  if (bins.is_cuda()) {
#ifdef FEDHPC_WITH_CUDA
    binned_add_cuda(terms, alpha, bins, top, start);
    return;
#else
    no_cuda();
#endif
  }
  TORCH_CHECK(bins.is_cpu(), "fedhpc ops: binned_add runs on CPU or CUDA tensors");
  binned_add_cpu(terms, alpha, bins, top, start);
}

}  // namespace

}  // namespace fedhpc

namespace {
// How many threads at::parallel_for really used for 64 one-element tasks: a build without
// OpenMP compiles the pragma away and answers 1 whatever torch.get_num_threads() says.
int64_t parallel_threads() {
  std::mutex lock;
  std::set<int> seen;
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    seen.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(seen.size());
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedhpc native ops: fused FedMix mixing / l3, segmented mixup, binned sums (see fedhpc.ops)";
  m.attr("abi_version") = fedhpc::kAbiVersion;
  m.attr("sources_hash") = FEDHPC_STR(FEDHPC_SOURCES_HASH);
  m.attr("with_cuda") = fedhpc::with_cuda();
  m.def("mix", &fedhpc::mix, "xm, ym = (1-l) x [+ l xbar], (1-l) y + l ybar on (B, ...) tensors, differentiable");
  m.def("l3", &fedhpc::l3, "s_i = l <g_i, xbar_i> on (B, ...) tensors, differentiable to any order");
  // The raw kernels on 2-D (rows, cols) tensors, no autograd (benchmarks, tests).
  m.def("mix_forward", &fedhpc::mix_forward, "xm, ym = (1-l) x [+ l xbar], (1-l) y + l ybar");
  m.def("mix_backward", &fedhpc::mix_backward, "transpose of mix_forward");
  m.def("l3_forward", &fedhpc::l3_forward, "s_i = l <g_i, xbar_i>");
  m.def("l3_backward", &fedhpc::l3_backward, "grad_g, grad_xbar of l3_forward");
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for used for 64 tasks (1 = built without OpenMP)");
  m.def("segment_mix", &fedhpc::segment_mix, "out = l_seg a + (1 - l_seg) b, in place into out");
  m.def("binned_add", &fedhpc::binned_add, "fedhpc.reproducible_sum's deposit: alpha * terms into the bins, in place");
  m.def("cpu_isa", [] {
    return std::map<std::string, std::string>{{"binned_add", fedhpc::binned_add_cpu_isa()},
                                              {"segment_mix", fedhpc::segment_mix_stream_cpu_isa()}};
  }, "the instruction set each CPU kernel's vector path uses here (FEDHPC_NO_SIMD=1: the baseline)");
}
