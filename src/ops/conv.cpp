// conv2d: argument checks, the output's geometry and the backward it records; the convolution
// itself runs in the device's conv2d kernels (im2col + GEMM on the CPU, src/ops/cpu/conv.cpp).
#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::TensorList;
using detail::ConvGeometry;
using detail::Kernels;

namespace {

ConvGeometry check_conv_args(const Tensor& x, const Tensor& w, const Tensor& b,
                             const Conv2dOptions& o) {
  const char* op = "conv2d";
  detail::check_defined(x, op);
  detail::check_defined(w, op, "weight");
  detail::check_same_device(x, w, op);
  LS_CHECK(x.dim() == 4, "conv2d: expected input of shape (N, C, H, W), got ", x.shape().str());
  LS_CHECK(w.dim() == 4, "conv2d: expected weight of shape (O, C/groups, kh, kw), got ",
           w.shape().str());
  LS_CHECK(is_floating(x.dtype()), "conv2d: expected a floating-point input, got ",
           dtype_name(x.dtype()));
  LS_CHECK(w.dtype() == x.dtype(), "conv2d: input is ", dtype_name(x.dtype()), " but weight is ",
           dtype_name(w.dtype()), "; convert one with .to()");
  LS_CHECK(o.stride_h >= 1 && o.stride_w >= 1, "conv2d: stride must be positive, got (", o.stride_h,
           ", ", o.stride_w, ")");
  LS_CHECK(o.dilation_h >= 1 && o.dilation_w >= 1, "conv2d: dilation must be positive, got (",
           o.dilation_h, ", ", o.dilation_w, ")");
  LS_CHECK(o.pad_h >= 0 && o.pad_w >= 0, "conv2d: padding must be non-negative, got (", o.pad_h,
           ", ", o.pad_w, ")");
  LS_CHECK(o.groups >= 1, "conv2d: groups must be positive, got ", o.groups);
  const int64_t in_channels = x.shape()[1], out_channels = w.shape()[0];
  LS_CHECK(in_channels % o.groups == 0, "conv2d: groups ", o.groups,
           " does not divide the input's ", in_channels, " channels (input ", x.shape().str(), ")");
  LS_CHECK(out_channels % o.groups == 0, "conv2d: groups ", o.groups,
           " does not divide the weight's ", out_channels, " output channels (weight ",
           w.shape().str(), ")");
  if (o.groups == 1) {
    LS_CHECK(w.shape()[1] == in_channels, "conv2d: input has ", in_channels,
             " channels but weight expects ", w.shape()[1], " (input ", x.shape().str(),
             ", weight ", w.shape().str(), ")");
  } else {
    LS_CHECK(w.shape()[1] * o.groups == in_channels, "conv2d: input has ", in_channels,
             " channels but weight expects ", w.shape()[1] * o.groups, " (", w.shape()[1],
             " per group x ", o.groups, " groups; input ", x.shape().str(), ", weight ",
             w.shape().str(), ")");
  }
  if (b.defined()) {
    detail::check_same_device(x, b, op);
    LS_CHECK(b.dim() == 1 && b.shape()[0] == out_channels, "conv2d: bias of shape ",
             b.shape().str(), " does not match the weight's ", out_channels,
             " output channels (weight ", w.shape().str(), "); expected [", out_channels, "]");
    LS_CHECK(b.dtype() == x.dtype(), "conv2d: input is ", dtype_name(x.dtype()), " but bias is ",
             dtype_name(b.dtype()));
  }
  ConvGeometry g;
  g.height = x.shape()[2];
  g.width = x.shape()[3];
  g.kernel_h = w.shape()[2];
  g.kernel_w = w.shape()[3];
  g.stride_h = o.stride_h, g.stride_w = o.stride_w;
  g.pad_h = o.pad_h, g.pad_w = o.pad_w;
  g.dilation_h = o.dilation_h, g.dilation_w = o.dilation_w;
  const int64_t span_h = o.dilation_h * (g.kernel_h - 1) + 1;
  const int64_t span_w = o.dilation_w * (g.kernel_w - 1) + 1;
  LS_CHECK(g.kernel_h >= 1 && g.kernel_w >= 1 && span_h <= g.height + 2 * o.pad_h &&
               span_w <= g.width + 2 * o.pad_w,
           "conv2d: input of size ", g.height, "x", g.width, " (", g.height + 2 * o.pad_h, "x",
           g.width + 2 * o.pad_w, " with padding) is smaller than the kernel ", g.kernel_h, "x",
           g.kernel_w, " (", span_h, "x", span_w, " with dilation); input ", x.shape().str(),
           ", weight ", w.shape().str());
  g.out_h = (g.height + 2 * o.pad_h - span_h) / o.stride_h + 1;
  g.out_w = (g.width + 2 * o.pad_w - span_w) / o.stride_w + 1;
  return g;
}

// A new tensor like `t` (shape, dtype, device), or undefined when not `wanted`.
Tensor empty_if(bool wanted, const Tensor& t) {
  return wanted ? empty(t.shape(), detail::options_on(t, t.dtype())) : Tensor();
}

}  // namespace

// Every floating dtype goes to the kernel as it is: bf16 runs its products in bf16 with f32
// accumulation (Note [bf16 conv] in src/ops/cpu/conv.cpp), f16 is computed in f32 there.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
              const Conv2dOptions& opts) {
  LS_AUTOCAST("conv2d", conv2d, x, weight, bias, opts);
  const ConvGeometry geo = check_conv_args(x, weight, bias, opts);
  const auto forward = detail::kernel(&Kernels::conv2d, x.device(), "conv2d");
  const int64_t groups = opts.groups;
  const Tensor xc = x.detach().contiguous();
  const Tensor wc = weight.detach().contiguous();
  const Tensor bc = bias.defined() ? bias.detach().contiguous() : Tensor();
  Tensor out =
      empty({x.size(0), weight.size(0), geo.out_h, geo.out_w}, detail::options_on(x, x.dtype()));
  if (out.numel() > 0) forward(out, xc, wc, bc, geo, groups);
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  const bool need_b = bias.defined() && bias.requires_grad();
  autograd::record(
      "Conv2dBackward", {x, weight, bias}, out,
      [xc, wc, bc, geo, groups, need_x, need_w, need_b](const TensorList& g) {
        const auto backward = detail::kernel(&Kernels::conv2d_backward, xc.device(), "conv2d");
        const Tensor gc = g[0].to(xc.dtype()).contiguous();
        TensorList grads{empty_if(need_x, xc), empty_if(need_w, wc), empty_if(need_b, bc)};
        backward(grads[0], grads[1], grads[2], gc, xc, wc, geo, groups);
        return grads;
      });
  return out;
}

}  // namespace lockstep
