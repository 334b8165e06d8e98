// CPU dropout kernels: the Philox keep-mask and the masked, scaled copy.
#include <array>

#include "ops/cpu/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

namespace {
// out[i] = x[i] * mask[i] * scale over contiguous tensors of any floating dtype.
template <typename T>
void apply_mask(const Tensor& x, const Tensor& mask, double scale, const Tensor& out) {
  const T* px = x.data<T>();
  const uint8_t* pm = mask.data<uint8_t>();
  T* po = out.data<T>();
  parallel_for(0, x.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
    if constexpr (is_half_type_v<T>) {
      const float s = static_cast<float>(scale);
      for (int64_t i = b; i < e; ++i) po[i] = T(pm[i] ? static_cast<float>(px[i]) * s : 0.0f);
    } else {
      const T s = static_cast<T>(scale);
      for (int64_t i = b; i < e; ++i) po[i] = pm[i] ? px[i] * s : T(0);
    }
  });
}
}  // namespace

void dropout_mask_kernel(const Tensor& mask, uint64_t seed, uint64_t start, double p) {
  uint8_t* pm = mask.data<uint8_t>();
  parallel_for(0, mask.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
    std::array<uint32_t, 4> block{};
    for (int64_t i = b; i < e; ++i) {
      if (i == b || i % 4 == 0)
        block = Generator::philox(seed, start + static_cast<uint64_t>(i / 4));
      const double u = static_cast<double>(block[i % 4]) * 0x1.0p-32;
      pm[i] = u >= p;
    }
  });
}

void masked_scale_kernel(const Tensor& out, const Tensor& x, const Tensor& mask, double scale) {
  dispatch_all(x.dtype(), "dropout", [&]<typename T>() {
    if constexpr (std::is_floating_point_v<T> || is_half_type_v<T>) {
      apply_mask<T>(x, mask, scale, out);
    } else {
      LS_THROW("dropout: unreachable non-floating dtype");
    }
  });
}

}  // namespace lockstep::cpu
