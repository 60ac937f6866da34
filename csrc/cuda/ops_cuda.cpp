// Torch-facing side of the CUDA kernels: allocates outputs, picks the current stream and device,
// and calls the plain-CUDA launchers of mix_kernels.cu. Built only when torch has CUDA
// (FEDHPC_WITH_CUDA); the shapes arrive checked by ops.cpp, as (rows, ...) tensors read as (rows, cols).
#include "../fedhpc_ops.h"
#include "mix_kernels.cuh"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace fedhpc {
namespace {

template <typename T>
cuda::MixPair<T> pair(const Tensor& out, const Tensor& a, const Tensor& b) {
  return {out.data_ptr<T>(), a.data_ptr<T>(), b.defined() ? b.data_ptr<T>() : nullptr, a.size(0), cols_of(a),
          b.defined() ? b.size(0) : 0};
}

template <typename T>
cuda::MixPairT<T> pair_t(const Tensor& g, const Tensor& ga, const Tensor& gb, int64_t b_rows) {
  return {g.data_ptr<T>(), ga.defined() ? ga.data_ptr<T>() : nullptr, gb.defined() ? gb.data_ptr<T>() : nullptr,
          g.size(0), cols_of(g), b_rows};
}

cudaStream_t stream_of(const Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

}  // namespace

std::tuple<Tensor, Tensor> mix_forward_cuda(const Tensor& x, const Tensor& xbar, const Tensor& y,
                                            const Tensor& ybar, double lam) {
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor xm = at::empty_like(x), ym = at::empty_like(y);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fedhpc_mix_forward_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_mix_forward<scalar_t>(pair<scalar_t>(xm, x, xbar), pair<scalar_t>(ym, y, ybar),
                                                      static_cast<scalar_t>(1.0 - lam), static_cast<scalar_t>(lam),
                                                      stream_of(x)));
  });
  return {xm, ym};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mix_backward_cuda(const Tensor& gxm, const Tensor& gym,
                                                             int64_t xbar_rows, int64_t ybar_rows, double lam,
                                                             std::array<bool, 4> need) {
  const c10::cuda::CUDAGuard guard(gxm.device());
  Tensor gx = need[0] ? at::empty_like(gxm) : Tensor();
  Tensor gxbar = need[1] && xbar_rows > 0 ? at::empty({xbar_rows, cols_of(gxm)}, gxm.options()) : Tensor();
  Tensor gy = need[2] ? at::empty_like(gym) : Tensor();
  Tensor gybar = need[3] ? at::empty({ybar_rows, cols_of(gym)}, gym.options()) : Tensor();
  AT_DISPATCH_FLOATING_TYPES(gxm.scalar_type(), "fedhpc_mix_backward_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_mix_backward<scalar_t>(
        pair_t<scalar_t>(gxm, gx, gxbar, xbar_rows), pair_t<scalar_t>(gym, gy, gybar, ybar_rows),
        static_cast<scalar_t>(1.0 - lam), static_cast<scalar_t>(lam), stream_of(gxm)));
  });
  return {gx, gxbar, gy, gybar};
}

Tensor l3_forward_cuda(const Tensor& g, const Tensor& xbar, double lam) {
  const c10::cuda::CUDAGuard guard(g.device());
  Tensor s = at::empty({g.size(0)}, g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "fedhpc_l3_forward_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_l3_forward<scalar_t>(g.data_ptr<scalar_t>(), xbar.data_ptr<scalar_t>(),
                                                     s.data_ptr<scalar_t>(), g.size(0), cols_of(g), xbar.size(0),
                                                     static_cast<scalar_t>(lam), stream_of(g)));
  });
  return s;
}

std::tuple<Tensor, Tensor> l3_backward_cuda(const Tensor& go, const Tensor& g, const Tensor& xbar, double lam,
                                            bool need_g, bool need_xbar) {
  const c10::cuda::CUDAGuard guard(g.device());
  Tensor gg = need_g ? at::empty_like(g) : Tensor();
  Tensor gx = need_xbar ? at::empty_like(xbar) : Tensor();
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "fedhpc_l3_backward_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_l3_backward<scalar_t>(
        go.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), xbar.data_ptr<scalar_t>(),
        need_g ? gg.data_ptr<scalar_t>() : nullptr, need_xbar ? gx.data_ptr<scalar_t>() : nullptr, g.size(0),
        cols_of(g), xbar.size(0), static_cast<scalar_t>(lam), stream_of(g)));
  });
  return {gg, gx};
}

void segment_mix_cuda(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& lam, Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(offsets.is_cuda() && offsets.is_contiguous(), "fedhpc ops: offsets must be contiguous on the GPU");
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "fedhpc_segment_mix_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_segment_mix<scalar_t>(
        a.data_ptr<scalar_t>(), a.stride(0), b.data_ptr<scalar_t>(), b.stride(0), out.data_ptr<scalar_t>(),
        out.stride(0), offsets.data_ptr<int64_t>(), offsets.numel() - 1, lam.data_ptr<scalar_t>(), lam.size(0),
        out.size(0), out.size(1), stream_of(out)));
  });
}

void binned_add_cuda(const Tensor& terms, double alpha, Tensor& bins, Tensor& top, int64_t start) {
  const c10::cuda::CUDAGuard guard(bins.device());
  AT_DISPATCH_FLOATING_TYPES(terms.scalar_type(), "fedhpc_binned_add_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_binned_add<scalar_t>(terms.data_ptr<scalar_t>(), alpha, bins.data_ptr<double>() + start,
                                                     bins.stride(0), top.data_ptr<int8_t>() + start, terms.numel(),
                                                     kBinnedBins, stream_of(bins)));
  });
}

}  // namespace fedhpc
