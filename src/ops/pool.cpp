// max_pool2d and avg_pool2d over (N, C, H, W) or (C, H, W): checks, the output's geometry and
// the backward they record; the windows run in the device's pool2d kernels.
#include "lockstep/autograd/node.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::TensorList;
using detail::ConvGeometry;
using detail::Kernels;
using detail::PoolKind;

namespace {

struct PoolShape {
  ConvGeometry geo;
  Dims out_shape;
};

PoolShape check_pool_args(const Tensor& x, const Pool2dOptions& o, const char* op) {
  detail::check_defined(x, op);
  LS_CHECK(x.dim() == 3 || x.dim() == 4, op,
           ": expected input of shape (N, C, H, W) or (C, H, W), got ", x.shape().str());
  LS_CHECK(is_floating(x.dtype()), op, ": expected a floating-point input, got ",
           dtype_name(x.dtype()));
  LS_CHECK(o.kernel_h >= 1 && o.kernel_w >= 1, op, ": kernel size must be positive, got ",
           o.kernel_h, "x", o.kernel_w);
  LS_CHECK(o.stride_h >= 0 && o.stride_w >= 0, op,
           ": stride must be non-negative (0 means the "
           "kernel size), got (",
           o.stride_h, ", ", o.stride_w, ")");
  LS_CHECK(o.pad_h >= 0 && o.pad_w >= 0 && 2 * o.pad_h <= o.kernel_h && 2 * o.pad_w <= o.kernel_w,
           op, ": padding (", o.pad_h, ", ", o.pad_w, ") must be between 0 and half the kernel ",
           o.kernel_h, "x", o.kernel_w);
  PoolShape s;
  ConvGeometry& g = s.geo;
  const int64_t d = x.dim();
  g.height = x.shape()[d - 2];
  g.width = x.shape()[d - 1];
  g.kernel_h = o.kernel_h, g.kernel_w = o.kernel_w;
  g.stride_h = o.stride_h == 0 ? o.kernel_h : o.stride_h;
  g.stride_w = o.stride_w == 0 ? o.kernel_w : o.stride_w;
  g.pad_h = o.pad_h, g.pad_w = o.pad_w;
  LS_CHECK(g.height + 2 * g.pad_h >= g.kernel_h && g.width + 2 * g.pad_w >= g.kernel_w, op,
           ": input of size ", g.height, "x", g.width, " (", g.height + 2 * g.pad_h, "x",
           g.width + 2 * g.pad_w, " with padding) is smaller than the kernel ", g.kernel_h, "x",
           g.kernel_w, "; input ", x.shape().str());
  // Floor mode, as PyTorch's default.
  g.out_h = (g.height + 2 * g.pad_h - g.kernel_h) / g.stride_h + 1;
  g.out_w = (g.width + 2 * g.pad_w - g.kernel_w) / g.stride_w + 1;
  s.out_shape = x.shape();
  s.out_shape[d - 2] = g.out_h;
  s.out_shape[d - 1] = g.out_w;
  return s;
}

// Both pooling ops: the kernel computes in f32/f64 (16-bit floats convert around it, autograd
// through the conversions); max keeps each window's winner for the backward.
Tensor pool2d(PoolKind kind, const Tensor& x, const Pool2dOptions& opts, const char* op) {
  const PoolShape s = check_pool_args(x, opts, op);
  const auto forward = detail::kernel(&Kernels::pool2d, x.device(), op);
  if (is_half(x.dtype())) return pool2d(kind, x.to(kFloat32), opts, op).to(x.dtype());
  const Tensor xc = x.detach().contiguous();
  Tensor out = empty(s.out_shape, detail::options_on(x, x.dtype()));
  // Flat position h * W + w of each winner within its plane.
  Tensor indices =
      kind == PoolKind::max ? empty(s.out_shape, detail::options_on(x, kInt64)) : Tensor();
  if (out.numel() > 0) forward(kind, out, indices, xc, s.geo);
  autograd::record(kind == PoolKind::max ? "MaxPool2dBackward" : "AvgPool2dBackward", {x}, out,
                   [kind, indices, in_shape = x.shape(), opts = detail::options_on(x, x.dtype()),
                    geo = s.geo, op](const TensorList& gl) {
                     const auto backward =
                         detail::kernel(&Kernels::pool2d_backward, opts.device, op);
                     const Tensor g = gl[0].to(opts.dtype).contiguous();
                     Tensor gx = empty(in_shape, opts);
                     backward(kind, gx, g, indices, geo);
                     return TensorList{gx};
                   });
  return out;
}

}  // namespace

Tensor max_pool2d(const Tensor& x, const Pool2dOptions& opts) {
  return pool2d(PoolKind::max, x, opts, "max_pool2d");
}

// Padding counts as zeros in the average (count_include_pad).
Tensor avg_pool2d(const Tensor& x, const Pool2dOptions& opts) {
  return pool2d(PoolKind::avg, x, opts, "avg_pool2d");
}

}  // namespace lockstep
