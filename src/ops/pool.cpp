// max_pool2d and avg_pool2d over (N, C, H, W) or (C, H, W), and their gradients.
#include <algorithm>
#include <cmath>
#include <limits>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/cpu/im2col.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep {

using autograd::TensorList;

namespace {

// Window reads per thread chunk below which a pooling loop stays on one thread.
constexpr int64_t kPoolGrainElements = 32768;

struct PoolShape {
  int64_t planes = 0;  // N * C
  cpu::ConvGeometry geo;
  Dims out_shape;
  int64_t in_plane() const { return geo.height * geo.width; }
};

PoolShape check_pool_args(const Tensor& x, const Pool2dOptions& o, const char* op) {
  detail::check_cpu(x, op);
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
  cpu::ConvGeometry& g = s.geo;
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
  s.planes = d == 4 ? x.shape()[0] * x.shape()[1] : x.shape()[0];
  s.out_shape = x.shape();
  s.out_shape[d - 2] = g.out_h;
  s.out_shape[d - 1] = g.out_w;
  return s;
}

// Calls f(plane) for every (n, c) plane in parallel.
template <typename F>
void for_planes(const PoolShape& s, const F& f) {
  const int64_t per_plane = s.geo.out_plane() * s.geo.kernel_h * s.geo.kernel_w;
  const int64_t grain = std::max<int64_t>(1, kPoolGrainElements / std::max<int64_t>(per_plane, 1));
  cpu::parallel_for(0, s.planes, grain, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) f(p);
  });
}

// Calls f(oh, ow, h0, h1, w0, w1) with the window of each output clipped to the input. (Floor
// mode with padding at most half the kernel keeps every window inside the padded input, so the
// unclipped window always has kernel_h * kernel_w taps.)
template <typename F>
void for_windows(const cpu::ConvGeometry& g, const F& f) {
  for (int64_t oh = 0; oh < g.out_h; ++oh) {
    const int64_t hs = oh * g.stride_h - g.pad_h;
    const int64_t h0 = std::max<int64_t>(hs, 0), h1 = std::min(hs + g.kernel_h, g.height);
    for (int64_t ow = 0; ow < g.out_w; ++ow) {
      const int64_t ws = ow * g.stride_w - g.pad_w;
      const int64_t w0 = std::max<int64_t>(ws, 0), w1 = std::min(ws + g.kernel_w, g.width);
      f(oh * g.out_w + ow, h0, h1, w0, w1);
    }
  }
}

// Gradient tensor `g` as a contiguous tensor of `dt`.
Tensor grad_as(const Tensor& g, DType dt) { return (g.dtype() == dt ? g : g.to(dt)).contiguous(); }

}  // namespace

Tensor max_pool2d(const Tensor& x, const Pool2dOptions& opts) {
  const PoolShape s = check_pool_args(x, opts, "max_pool2d");
  if (is_half(x.dtype())) return max_pool2d(x.to(kFloat32), opts).to(x.dtype());
  const Tensor xc = x.detach().contiguous();
  Tensor out = empty(s.out_shape, x.dtype());
  Tensor indices = empty(s.out_shape, kInt64);  // flat position h * W + w within the plane
  if (out.numel() > 0) {
    cpu::dispatch_float(x.dtype(), "max_pool2d", [&]<typename T>() {
      const T* xp = static_cast<const T*>(xc.data_ptr());
      T* op = static_cast<T*>(out.data_ptr());
      int64_t* ip = static_cast<int64_t*>(indices.data_ptr());
      const cpu::ConvGeometry& g = s.geo;
      for_planes(s, [&](int64_t p) {
        const T* xpl = xp + p * s.in_plane();
        T* opl = op + p * g.out_plane();
        int64_t* ipl = ip + p * g.out_plane();
        for_windows(g, [&](int64_t o, int64_t h0, int64_t h1, int64_t w0, int64_t w1) {
          // Padding reads as -inf: it never wins, so only in-bounds taps are visited.
          T best = -std::numeric_limits<T>::infinity();
          int64_t best_i = h0 * g.width + w0;
          for (int64_t h = h0; h < h1; ++h) {
            for (int64_t w = w0; w < w1; ++w) {
              const T v = xpl[h * g.width + w];
              if (v > best || std::isnan(v)) {  // NaN propagates, as in PyTorch
                best = v;
                best_i = h * g.width + w;
              }
            }
          }
          opl[o] = best;
          ipl[o] = best_i;
        });
      });
    });
  }
  const Dims in_shape = x.shape();
  const DType dt = x.dtype();
  autograd::record("MaxPool2dBackward", {x}, out, [indices, in_shape, dt, s](const TensorList& gl) {
    const Tensor g = grad_as(gl[0], dt);
    Tensor gx = zeros(in_shape, dt);
    cpu::dispatch_float(dt, "max_pool2d backward", [&]<typename T>() {
      const T* gp = static_cast<const T*>(g.data_ptr());
      const int64_t* ip = static_cast<const int64_t*>(indices.data_ptr());
      T* gxp = static_cast<T*>(gx.data_ptr());
      const int64_t L = s.geo.out_plane();
      for_planes(s, [&](int64_t p) {
        T* dst = gxp + p * s.in_plane();
        for (int64_t l = 0; l < L; ++l) dst[ip[p * L + l]] += gp[p * L + l];
      });
    });
    return TensorList{gx};
  });
  return out;
}

Tensor avg_pool2d(const Tensor& x, const Pool2dOptions& opts) {
  const PoolShape s = check_pool_args(x, opts, "avg_pool2d");
  if (is_half(x.dtype())) return avg_pool2d(x.to(kFloat32), opts).to(x.dtype());
  const Tensor xc = x.detach().contiguous();
  Tensor out = empty(s.out_shape, x.dtype());
  // count_include_pad: every window counts kernel_h * kernel_w taps (see for_windows).
  const double inv_count = 1.0 / static_cast<double>(s.geo.kernel_h * s.geo.kernel_w);
  if (out.numel() > 0) {
    cpu::dispatch_float(x.dtype(), "avg_pool2d", [&]<typename T>() {
      const T* xp = static_cast<const T*>(xc.data_ptr());
      T* op = static_cast<T*>(out.data_ptr());
      const cpu::ConvGeometry& g = s.geo;
      for_planes(s, [&](int64_t p) {
        const T* xpl = xp + p * s.in_plane();
        T* opl = op + p * g.out_plane();
        for_windows(g, [&](int64_t o, int64_t h0, int64_t h1, int64_t w0, int64_t w1) {
          T acc = 0;
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) acc += xpl[h * g.width + w];
          opl[o] = acc * static_cast<T>(inv_count);
        });
      });
    });
  }
  const Dims in_shape = x.shape();
  const DType dt = x.dtype();
  autograd::record(
      "AvgPool2dBackward", {x}, out, [in_shape, dt, s, inv_count](const TensorList& gl) {
        const Tensor g = grad_as(gl[0], dt);
        Tensor gx = zeros(in_shape, dt);
        cpu::dispatch_float(dt, "avg_pool2d backward", [&]<typename T>() {
          const T* gp = static_cast<const T*>(g.data_ptr());
          T* gxp = static_cast<T*>(gx.data_ptr());
          const cpu::ConvGeometry& geo = s.geo;
          for_planes(s, [&](int64_t p) {
            const T* gpl = gp + p * geo.out_plane();
            T* dst = gxp + p * s.in_plane();
            for_windows(geo, [&](int64_t o, int64_t h0, int64_t h1, int64_t w0, int64_t w1) {
              const T v = gpl[o] * static_cast<T>(inv_count);
              for (int64_t h = h0; h < h1; ++h)
                for (int64_t w = w0; w < w1; ++w) dst[h * geo.width + w] += v;
            });
          });
        });
        return TensorList{gx};
      });
  return out;
}

}  // namespace lockstep
