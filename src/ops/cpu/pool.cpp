// The CPU pooling kernels: max and average over windows of each (H, W) plane, and their
// gradients, parallel over planes.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/cpu/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

using detail::ConvGeometry;
using detail::PoolKind;

namespace {

// Window reads per thread chunk below which a pooling loop stays on one thread.
constexpr int64_t kPoolGrainElements = 32768;

// Calls f(plane) for every (n, c) plane in parallel.
template <typename F>
void for_planes(int64_t planes, const ConvGeometry& g, const F& f) {
  const int64_t per_plane = g.out_plane() * g.kernel_h * g.kernel_w;
  const int64_t grain = std::max<int64_t>(1, kPoolGrainElements / std::max<int64_t>(per_plane, 1));
  parallel_for(0, planes, grain, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) f(p);
  });
}

// Calls f(o, h0, h1, w0, w1) with the window of each output o clipped to the input. (Floor
// mode with padding at most half the kernel keeps every window inside the padded input, so the
// unclipped window always has kernel_h * kernel_w taps.)
template <typename F>
void for_windows(const ConvGeometry& g, const F& f) {
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

template <typename T>
void max_pool(const T* xp, T* op, int64_t* ip, int64_t planes, const ConvGeometry& g) {
  const int64_t in_plane = g.height * g.width;
  for_planes(planes, g, [&](int64_t p) {
    const T* xpl = xp + p * in_plane;
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
}

// count_include_pad: every window counts kernel_h * kernel_w taps (see for_windows).
double inv_count(const ConvGeometry& g) {
  return 1.0 / static_cast<double>(g.kernel_h * g.kernel_w);
}

template <typename T>
void avg_pool(const T* xp, T* op, int64_t planes, const ConvGeometry& g) {
  const int64_t in_plane = g.height * g.width;
  const T scale = static_cast<T>(inv_count(g));
  for_planes(planes, g, [&](int64_t p) {
    const T* xpl = xp + p * in_plane;
    T* opl = op + p * g.out_plane();
    for_windows(g, [&](int64_t o, int64_t h0, int64_t h1, int64_t w0, int64_t w1) {
      T acc = 0;
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t w = w0; w < w1; ++w) acc += xpl[h * g.width + w];
      opl[o] = acc * scale;
    });
  });
}

}  // namespace

void pool2d_kernel(PoolKind kind, const Tensor& out, const Tensor& indices, const Tensor& x,
                   const ConvGeometry& geo) {
  const int64_t planes = out.numel() / std::max<int64_t>(geo.out_plane(), 1);
  const char* name = kind == PoolKind::max ? "max_pool2d" : "avg_pool2d";
  dispatch_float(x.dtype(), name, [&]<typename T>() {
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* yp = static_cast<T*>(out.data_ptr());
    if (kind == PoolKind::max) {
      max_pool(xp, yp, static_cast<int64_t*>(indices.data_ptr()), planes, geo);
    } else {
      avg_pool(xp, yp, planes, geo);
    }
  });
}

void pool2d_backward_kernel(PoolKind kind, const Tensor& dx, const Tensor& g, const Tensor& indices,
                            const ConvGeometry& geo) {
  const int64_t L = geo.out_plane(), in_plane = geo.height * geo.width;
  const int64_t planes = dx.numel() / std::max<int64_t>(in_plane, 1);
  const char* op = kind == PoolKind::max ? "max_pool2d backward" : "avg_pool2d backward";
  dispatch_float(dx.dtype(), op, [&]<typename T>() {
    const T* gp = static_cast<const T*>(g.data_ptr());
    T* gxp = static_cast<T*>(dx.data_ptr());
    if (kind == PoolKind::max) {
      const int64_t* ip = static_cast<const int64_t*>(indices.data_ptr());
      for_planes(planes, geo, [&](int64_t p) {
        T* dst = gxp + p * in_plane;
        std::fill(dst, dst + in_plane, T(0));
        for (int64_t l = 0; l < L; ++l) dst[ip[p * L + l]] += gp[p * L + l];
      });
    } else {
      const T scale = static_cast<T>(inv_count(geo));
      for_planes(planes, geo, [&](int64_t p) {
        const T* gpl = gp + p * L;
        T* dst = gxp + p * in_plane;
        std::fill(dst, dst + in_plane, T(0));
        for_windows(geo, [&](int64_t o, int64_t h0, int64_t h1, int64_t w0, int64_t w1) {
          const T v = gpl[o] * scale;
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) dst[h * geo.width + w] += v;
        });
      });
    }
  });
}

}  // namespace lockstep::cpu
