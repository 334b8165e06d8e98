// dropout: a keep-mask drawn from the counter-based Generator, and its backward.
#include <cstdint>

#include "lockstep/autograd/node.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;

namespace {

// out[i] = x[i] * mask[i] * scale over contiguous tensors of any floating dtype.
template <typename T>
void apply_mask(const Tensor& x, const Tensor& mask, double scale, const Tensor& out) {
  const T* px = x.data<T>();
  const uint8_t* pm = mask.data<uint8_t>();
  T* po = out.data<T>();
  cpu::parallel_for(0, x.numel(), cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
    if constexpr (cpu::is_half_type_v<T>) {
      const float s = static_cast<float>(scale);
      for (int64_t i = b; i < e; ++i) po[i] = T(pm[i] ? static_cast<float>(px[i]) * s : 0.0f);
    } else {
      const T s = static_cast<T>(scale);
      for (int64_t i = b; i < e; ++i) po[i] = pm[i] ? px[i] * s : T(0);
    }
  });
}

Tensor masked_scale(const Tensor& x, const Tensor& mask, double scale) {
  const Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.dtype());
  cpu::dispatch_all(x.dtype(), "dropout", [&]<typename T>() {
    if constexpr (std::is_floating_point_v<T> || cpu::is_half_type_v<T>) {
      apply_mask<T>(xc, mask, scale, out);
    } else {
      LS_THROW("dropout: unreachable non-floating dtype");
    }
  });
  return out;
}

}  // namespace

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  detail::check_cpu(x, "dropout");
  LS_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability p must be in [0, 1], got ", p);
  LS_CHECK(is_floating(x.dtype()), "dropout: expected a floating-point tensor, got ",
           dtype_name(x.dtype()));
  if (!training || p == 0.0) return x;

  // Element i (in row-major order) keeps when the 32 bits in lane i % 4 of Philox block
  // start + i / 4, read as u in [0, 1), satisfy u >= p: the mask depends on the generator state
  // only, never on the thread count (Note [Random tensors] in src/tensor/factory.cpp).
  const int64_t n = x.numel();
  const uint64_t seed = gen.seed(), start = gen.reserve(n);
  Tensor mask = empty(x.shape(), kUInt8);
  uint8_t* pm = mask.data<uint8_t>();
  cpu::parallel_for(0, n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
    std::array<uint32_t, 4> block{};
    for (int64_t i = b; i < e; ++i) {
      if (i == b || i % 4 == 0)
        block = Generator::philox(seed, start + static_cast<uint64_t>(i / 4));
      const double u = static_cast<double>(block[i % 4]) * 0x1.0p-32;
      pm[i] = u >= p;
    }
  });
  // p == 1 drops everything; its scale would be infinite, and every kept value is zero anyway.
  const double scale = p < 1.0 ? 1.0 / (1.0 - p) : 0.0;
  Tensor out = masked_scale(x.detach(), mask, scale);
  record("DropoutBackward", {x}, out, [mask, scale](const TensorList& g) {
    return TensorList{masked_scale(g[0], mask, scale)};
  });
  return out;
}

}  // namespace lockstep
