// im2col / col2im for one (sample, channel) plane: the layout change that turns a convolution
// into a matrix product.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops/kernels.h"

namespace lockstep::cpu {

// The window geometry (src/ops/kernels.h), shared with the kernel table.
using detail::ConvGeometry;

// The output positions o in [0, out) whose input coordinate o * stride + offset lies in
// [0, size): [lo, hi). Everything outside reads padding.
inline void valid_range(int64_t offset, int64_t stride, int64_t size, int64_t out, int64_t& lo,
                        int64_t& hi) {
  lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  hi = size - 1 - offset >= 0 ? std::min(out, (size - 1 - offset) / stride + 1) : 0;
  lo = std::min(lo, hi);
}

// Writes the kernel_h * kernel_w rows of one input channel plane `x` (height x width) into
// `col`: row (ki * kernel_w + kj) starts at col + (ki * kernel_w + kj) * ld and holds out_plane()
// entries, the input under kernel tap (ki, kj) for every output position (0 in the padding).
template <typename T>
void im2col_plane(const T* x, const ConvGeometry& g, T* col, int64_t ld) {
  for (int64_t ki = 0; ki < g.kernel_h; ++ki) {
    const int64_t off_h = ki * g.dilation_h - g.pad_h;
    int64_t oh_lo, oh_hi;
    valid_range(off_h, g.stride_h, g.height, g.out_h, oh_lo, oh_hi);
    for (int64_t kj = 0; kj < g.kernel_w; ++kj) {
      const int64_t off_w = kj * g.dilation_w - g.pad_w;
      int64_t ow_lo, ow_hi;
      valid_range(off_w, g.stride_w, g.width, g.out_w, ow_lo, ow_hi);
      T* row = col + (ki * g.kernel_w + kj) * ld;
      std::fill(row, row + oh_lo * g.out_w, T(0));
      for (int64_t oh = oh_lo; oh < oh_hi; ++oh) {
        T* r = row + oh * g.out_w;
        const T* xr = x + (oh * g.stride_h + off_h) * g.width + off_w;
        std::fill(r, r + ow_lo, T(0));
        if (g.stride_w == 1) {
          for (int64_t ow = ow_lo; ow < ow_hi; ++ow) r[ow] = xr[ow];
        } else {
          for (int64_t ow = ow_lo; ow < ow_hi; ++ow) r[ow] = xr[ow * g.stride_w];
        }
        std::fill(r + ow_hi, r + g.out_w, T(0));
      }
      std::fill(row + oh_hi * g.out_w, row + g.out_plane(), T(0));
    }
  }
}

// The adjoint of im2col_plane: adds each column entry back onto the input element it was read
// from (entries that read padding are dropped).
template <typename T>
void col2im_plane(const T* col, int64_t ld, const ConvGeometry& g, T* x) {
  for (int64_t ki = 0; ki < g.kernel_h; ++ki) {
    const int64_t off_h = ki * g.dilation_h - g.pad_h;
    int64_t oh_lo, oh_hi;
    valid_range(off_h, g.stride_h, g.height, g.out_h, oh_lo, oh_hi);
    for (int64_t kj = 0; kj < g.kernel_w; ++kj) {
      const int64_t off_w = kj * g.dilation_w - g.pad_w;
      int64_t ow_lo, ow_hi;
      valid_range(off_w, g.stride_w, g.width, g.out_w, ow_lo, ow_hi);
      const T* row = col + (ki * g.kernel_w + kj) * ld;
      for (int64_t oh = oh_lo; oh < oh_hi; ++oh) {
        const T* r = row + oh * g.out_w;
        T* xr = x + (oh * g.stride_h + off_h) * g.width + off_w;
        for (int64_t ow = ow_lo; ow < ow_hi; ++ow) xr[ow * g.stride_w] += r[ow];
      }
    }
  }
}

}  // namespace lockstep::cpu
