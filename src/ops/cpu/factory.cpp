// CPU creation kernels: arange and the Philox-based random fills (Note [Random tensors] in
// src/ops/factory.cpp).
#include <cmath>

#include "ops/cpu/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

namespace {
// Fills `t` (contiguous) with f(i) for flat index i, in parallel.
template <typename T, typename F>
void fill_indexed(const Tensor& t, const F& f) {
  T* p = static_cast<T*>(t.data_ptr());
  parallel_for(0, t.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] = f(i);
  });
}
}  // namespace

void arange_kernel(const Tensor& t, double start, double step) {
  dispatch_all(t.dtype(), "arange", [&]<typename T>() {
    fill_indexed<T>(t,
                    [&](int64_t i) { return convert<T>(start + static_cast<double>(i) * step); });
  });
}

void rand_uniform_kernel(const Tensor& t, uint64_t seed, uint64_t start, double low, double high) {
  const double span = high - low;
  dispatch_all(t.dtype(), "rand", [&]<typename T>() {
    fill_indexed<T>(t, [&](int64_t i) {
      double u;
      if constexpr (std::is_same_v<T, double>) {
        auto b = Generator::philox(seed, start + static_cast<uint64_t>(i / 2));
        const int lane = 2 * static_cast<int>(i % 2);
        u = Generator::to_unit_double(b[lane], b[lane + 1]);
      } else {
        auto b = Generator::philox(seed, start + static_cast<uint64_t>(i / 4));
        u = Generator::to_unit_float(b[i % 4]);
      }
      double v = low + span * u;
      return convert<T>(v < high ? v : low);
    });
  });
}

void rand_normal_kernel(const Tensor& t, uint64_t seed, uint64_t start, double mean, double std) {
  dispatch_all(t.dtype(), "randn", [&]<typename T>() {
    fill_indexed<T>(t, [&](int64_t i) {
      // Box-Muller on the lane pair (0,1) or (2,3) of this element's block.
      auto b = Generator::philox(seed, start + static_cast<uint64_t>(i / 4));
      const int lane = static_cast<int>(i % 4);
      const int pair = lane & ~1;
      double u1 = (static_cast<double>(b[pair]) + 1.0) * 0x1.0p-32;  // (0, 1]
      double u2 = static_cast<double>(b[pair + 1]) * 0x1.0p-32;
      double r = std::sqrt(-2.0 * std::log(u1));
      double z = (lane & 1) ? r * std::sin(2.0 * M_PI * u2) : r * std::cos(2.0 * M_PI * u2);
      return convert<T>(mean + std * z);
    });
  });
}

void randint_kernel(const Tensor& t, uint64_t seed, uint64_t start, int64_t low, int64_t high) {
  const uint64_t span = static_cast<uint64_t>(high - low);
  dispatch_all(t.dtype(), "randint", [&]<typename T>() {
    fill_indexed<T>(t, [&](int64_t i) {
      auto b = Generator::philox(seed, start + static_cast<uint64_t>(i / 2));
      const int lane = 2 * static_cast<int>(i % 2);
      uint64_t r = static_cast<uint64_t>(b[lane]) << 32 | b[lane + 1];
      return convert<T>(low + static_cast<int64_t>(r % span));
    });
  });
}

}  // namespace lockstep::cpu
