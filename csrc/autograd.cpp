// The FedMix ops as C++ autograd Functions (torch::autograd::Function, the C++ twin of
// torch.autograd.Function: a fraction of the Python one's per-call overhead, which matters for
// the small batches FedMix trains on).
//
// Both ops are linear (mixing) or bilinear (l3) in their tensors, so each backward is again one
// of these Functions and everything is differentiable to any order:
//   Mix  : (x, xbar, y, ybar) -> ((1-l) x + l xbar, (1-l) y + l ybar)      backward = MixT
//   MixT : its transpose                                                     backward = Mix
//   L3   : (g, xbar) -> s_i = l <g_i, xbar_i>                                backward = L3T
//   L3T  : (gs, g, xbar) -> (l gs_i xbar_i, l sum_i gs_i g_i | l gs_i g_i)   backward = L3 + L3 and L3T
// FedMix itself needs only first derivatives of these (its second order runs through the model);
// the higher ones are what gradgradcheck exercises.
#include "fedhpc_ops.h"

#include <ATen/ops/_unsafe_view.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fedhpc {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

// A kernel output in its final shape. The kernels read (B, ...) tensors as (B, N) and give the
// per-sample outputs their input's shape already; only a mean's gradient, made (rows, N), needs a
// view here. _unsafe_view: same memory, but not marked as a view, which autograd would otherwise
// track as a view made under no-grad (refusing in-place use later).
Tensor shaped(const Tensor& t, const std::vector<int64_t>& shape) {
  return t.defined() && t.sizes() != c10::IntArrayRef(shape) ? at::_unsafe_view(t, shape) : t;
}

Tensor or_zeros(const Tensor& t, const std::vector<int64_t>& shape, const Tensor& like) {
  return t.defined() ? t : at::zeros(shape, like.options());
}

// A C++ Function may not return undefined tensors, so the transposed Functions return only the
// gradients asked for (bit i of `mask` set: slot i present) and these two helpers map between
// that packed list and a fixed-position one with undefined slots.
variable_list pack(const variable_list& slots) {
  variable_list out;
  for (const auto& t : slots) {
    if (t.defined()) out.push_back(t);
  }
  return out;
}

variable_list unpack(const variable_list& packed, int64_t mask, size_t n) {
  variable_list out(n);
  size_t next = 0;
  for (size_t i = 0; i < n; ++i) {
    if (mask & (int64_t{1} << i)) out[i] = packed.at(next++);
  }
  return out;
}

// What Mix and MixT keep: lambda and the four shapes (xbar's empty when there is none). Saved as
// two entries, the shapes packed into one list (rank, sizes..., four times): every entry is a
// hashed key and a heap list per call, which a 10-sample batch's microseconds notice.
struct MixMeta {
  double lam;
  std::vector<int64_t> xs, xbs, ys, ybs;

  void save(AutogradContext* ctx) const {
    std::vector<int64_t> packed;
    packed.reserve(4 + xs.size() + xbs.size() + ys.size() + ybs.size());
    for (const auto* shape : {&xs, &xbs, &ys, &ybs}) {
      packed.push_back(static_cast<int64_t>(shape->size()));
      packed.insert(packed.end(), shape->begin(), shape->end());
    }
    ctx->saved_data["lam"] = lam;
    ctx->saved_data["shapes"] = std::move(packed);
  }
  static MixMeta load(AutogradContext* ctx) {
    MixMeta meta{ctx->saved_data["lam"].toDouble(), {}, {}, {}, {}};
    const auto packed = ctx->saved_data["shapes"].toIntList();
    size_t at = 0;
    for (auto* shape : {&meta.xs, &meta.xbs, &meta.ys, &meta.ybs}) {
      const auto rank = static_cast<size_t>(packed.get(at++));
      for (size_t d = 0; d < rank; ++d) shape->push_back(packed.get(at++));
    }
    return meta;
  }
  bool has_xbar() const { return !xbs.empty(); }
};

struct MixTFn;

struct MixFn : public Function<MixFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& xbar,
                               const Tensor& y, const Tensor& ybar, double lam) {
    const bool has_xbar = xbar.has_value() && xbar->defined();
    const MixMeta meta{lam, x.sizes().vec(), has_xbar ? xbar->sizes().vec() : std::vector<int64_t>{},
                       y.sizes().vec(), ybar.sizes().vec()};
    meta.save(ctx);
    ctx->set_materialize_grads(false);  // e.g. the mixed input's gradient alone: no zeros for the labels
    auto [xm, ym] = mix_forward(x, xbar, y, ybar, lam);
    return {xm, ym};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct MixTFn : public Function<MixTFn> {
  // mask: bits 0..3 = gradients of x, xbar, y, ybar wanted (xbar only if there is one).
  static variable_list forward(AutogradContext* ctx, const Tensor& gxm, const Tensor& gym, const MixMeta& meta,
                               int64_t mask) {
    ctx->set_materialize_grads(false);  // a gradient not given stays undefined: treated as zero, not built
    meta.save(ctx);
    ctx->saved_data["mask"] = mask;
    auto [gx, gxbar, gy, gybar] = mix_backward(gxm, gym, meta.has_xbar() ? meta.xbs[0] : 0,
                                               meta.ybs[0], meta.lam, mask & 1, mask & 2, mask & 4, mask & 8);
    return pack({shaped(gx, meta.xs), shaped(gxbar, meta.xbs), shaped(gy, meta.ys), shaped(gybar, meta.ybs)});
  }
  static variable_list backward(AutogradContext* ctx, variable_list packed) {
    const MixMeta meta = MixMeta::load(ctx);
    const variable_list gg = unpack(packed, ctx->saved_data["mask"].toInt(), 4);
    const Tensor& like = gg[0].defined() ? gg[0] : gg[1].defined() ? gg[1] : gg[2].defined() ? gg[2] : gg[3];
    if (!like.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    std::optional<Tensor> ggxbar;
    if (meta.has_xbar() && gg[1].defined()) ggxbar = gg[1];
    auto out = MixFn::apply(or_zeros(gg[0], meta.xs, like), ggxbar, or_zeros(gg[2], meta.ys, like),
                            or_zeros(gg[3], meta.ybs, like), meta.lam);
    return {out[0], out[1], Tensor(), Tensor()};
  }
};

variable_list MixFn::backward(AutogradContext* ctx, variable_list grads) {
  const MixMeta meta = MixMeta::load(ctx);
  // needs_input_grad counts tensor inputs only: without xbar, y and ybar are inputs 1 and 2.
  const int64_t k = meta.has_xbar() ? 1 : 0;
  const int64_t mask = (ctx->needs_input_grad(0) ? 1 : 0) | (k && ctx->needs_input_grad(1) ? 2 : 0) |
                       (ctx->needs_input_grad(1 + k) ? 4 : 0) | (ctx->needs_input_grad(2 + k) ? 8 : 0);
  if (mask == 0 || (!grads[0].defined() && !grads[1].defined())) {
    return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
  if (!at::GradMode::is_enabled()) {  // a plain backward (no create_graph): the kernel, no node
    auto [gx, gxbar, gy, gybar] = mix_backward(grads[0], grads[1], k ? meta.xbs[0] : 0,
                                               meta.ybs[0], meta.lam, mask & 1, mask & 2, mask & 4, mask & 8);
    return {shaped(gx, meta.xs), shaped(gxbar, meta.xbs), shaped(gy, meta.ys), shaped(gybar, meta.ybs), Tensor()};
  }
  const Tensor& like = grads[0].defined() ? grads[0] : grads[1];
  variable_list out = unpack(MixTFn::apply(or_zeros(grads[0], meta.xs, like), or_zeros(grads[1], meta.ys, like),
                                           meta, mask), mask, 4);
  out.push_back(Tensor());
  return out;
}

struct L3TFn;

struct L3Fn : public Function<L3Fn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& g, const Tensor& xbar, double lam) {
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({g, xbar});
    ctx->saved_data["lam"] = lam;
    return l3_forward(g, xbar, lam);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct L3TFn : public Function<L3TFn> {
  // mask: bit 0 = gradient of g wanted, bit 1 = of xbar.
  static variable_list forward(AutogradContext* ctx, const Tensor& gs, const Tensor& g, const Tensor& xbar,
                               double lam, int64_t mask) {
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({gs, g, xbar});
    ctx->saved_data["lam"] = lam;
    ctx->saved_data["mask"] = mask;
    auto [gg, gx] = l3_backward(gs, g, xbar, lam, mask & 1, mask & 2);  // shaped as g and xbar
    return pack({gg, gx});
  }
  static variable_list backward(AutogradContext* ctx, variable_list packed) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &gs = saved[0], &g = saved[1], &xbar = saved[2];
    const double lam = ctx->saved_data["lam"].toDouble();
    const variable_list gg = unpack(packed, ctx->saved_data["mask"].toInt(), 2);
    const Tensor &gg_g = gg[0], &gg_x = gg[1];
    Tensor d_gs;
    if (ctx->needs_input_grad(0)) {  // d/d gs of l gs_i (<gg_g_i, xbar_i> + <g_i, gg_x_i>)
      if (gg_g.defined()) d_gs = L3Fn::apply(gg_g, xbar, lam);
      if (gg_x.defined()) {
        Tensor t = L3Fn::apply(g, gg_x, lam);
        d_gs = d_gs.defined() ? d_gs.add(t) : t;
      }
    }
    // d/d g = l gs_i gg_x_i and d/d xbar = l sum_i gs_i gg_g_i: L3T itself with (gg_g, gg_x) for (g, xbar).
    const int64_t mask = (ctx->needs_input_grad(1) && gg_x.defined() ? 1 : 0) |
                         (ctx->needs_input_grad(2) && gg_g.defined() ? 2 : 0);
    variable_list d(2);
    if (mask != 0) {
      d = unpack(L3TFn::apply(gs, gg_g.defined() ? gg_g : at::zeros_like(g),
                              gg_x.defined() ? gg_x : at::zeros_like(xbar), lam, mask), mask, 2);
    }
    return {d_gs, d[0], d[1], Tensor(), Tensor()};
  }
};

variable_list L3Fn::backward(AutogradContext* ctx, variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  const double lam = ctx->saved_data["lam"].toDouble();
  const int64_t mask = (ctx->needs_input_grad(0) ? 1 : 0) | (ctx->needs_input_grad(1) ? 2 : 0);
  if (mask == 0 || !grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
  if (!at::GradMode::is_enabled()) {  // FedMix's loss.backward(): the kernel, no node
    auto [gg, gx] = l3_backward(grads[0], saved[0], saved[1], lam, mask & 1, mask & 2);
    return {gg, gx, Tensor()};
  }
  variable_list out = unpack(L3TFn::apply(grads[0].contiguous(), saved[0], saved[1], lam, mask), mask, 2);
  out.push_back(Tensor());
  return out;
}

}  // namespace

// Without anything to differentiate (raw images, evaluation), skip the autograd node: a few us
// per call, which is the whole kernel's time for a small batch.
std::tuple<Tensor, Tensor> mix(const Tensor& x, const std::optional<Tensor>& xbar, const Tensor& y,
                               const Tensor& ybar, double lam) {
  const bool has_xbar = xbar.has_value() && xbar->defined();
  if (!at::GradMode::is_enabled() ||
      !(x.requires_grad() || y.requires_grad() || ybar.requires_grad() || (has_xbar && xbar->requires_grad()))) {
    return mix_forward(x, xbar, y, ybar, lam);
  }
  auto out = MixFn::apply(x, xbar, y, ybar, lam);
  return {out[0], out[1]};
}

Tensor l3(const Tensor& g, const Tensor& xbar, double lam) {
  if (!at::GradMode::is_enabled() || !(g.requires_grad() || xbar.requires_grad())) {
    return l3_forward(g, xbar, lam);
  }
  return L3Fn::apply(g, xbar, lam);
}

}  // namespace fedhpc
