// CPU copy (with dtype conversion) and fill kernels.
#include <cmath>
#include <cstring>

#include "ops/cpu/kernels.h"
#include "lockstep/tensor/cuda.h"
#include "ops/cpu/loops.h"
#include "tensor/dispatch.h"

namespace lockstep::cpu {

void copy_kernel(const Tensor& dst, const Tensor& src) {
  // Host memory on both sides: the CPU's, or an emulated GPU's (Note [Emulated kernels]).
  auto host = [](const Device& d) { return d.is_cpu() || cuda::emulated(); };
  LS_CHECK(host(dst.device()) && host(src.device()), "copy: the CPU kernel got tensors on ",
           dst.device().str(), " and ", src.device().str());
  // f32 <-> f16 or bf16 between contiguous tensors: the bulk conversions (F16C, AVX2; autocast
  // converts every weight and activation a Linear takes), in parallel chunks.
  const DType half = dst.dtype() == kFloat32 ? src.dtype() : dst.dtype();
  const bool f32_half = (dst.dtype() == kFloat32 || src.dtype() == kFloat32) &&
                        (half == kFloat16 || half == kBFloat16) && dst.dtype() != src.dtype();
  if (f32_half && dst.is_contiguous() && src.is_contiguous() && src.numel() == dst.numel()) {
    const bool to_half = dst.dtype() == half, bf16 = half == kBFloat16;
    void* d = dst.data_ptr();
    const void* from = src.data_ptr();
    parallel_for(0, dst.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
      const auto* f = static_cast<const float*>(from) + b;
      const auto* h = static_cast<const uint16_t*>(from) + b;
      if (to_half) {
        (bf16 ? float_to_bf16_bits_n : float_to_f16_bits_n)(f, static_cast<uint16_t*>(d) + b,
                                                            e - b);
      } else {
        (bf16 ? bf16_bits_to_float_n : f16_bits_to_float_n)(h, static_cast<float*>(d) + b, e - b);
      }
    });
    return;
  }
  // Same dtype, both contiguous, not overlapping: the bytes as they are (memcpy moves them at
  // the memory's speed; the element loop did not, which DDP's copy of each gradient into its
  // bucket showed).
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous() &&
      src.numel() == dst.numel()) {
    auto* d = static_cast<char*>(dst.data_ptr());
    const auto* from = static_cast<const char*>(src.data_ptr());
    const auto bytes = static_cast<size_t>(dst.nbytes());
    if (bytes == 0 || d == from) return;
    if (d + bytes <= from || from + bytes <= d) {
      const int64_t width = static_cast<int64_t>(dtype_size(dst.dtype()));
      parallel_for(0, dst.numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
        std::memcpy(d + b * width, from + b * width, static_cast<size_t>((e - b) * width));
      });
      return;
    }
  }
  dispatch_all(dst.dtype(), "copy_", [&]<typename To>() {
    dispatch_all(src.dtype(), "copy_", [&]<typename From>() {
      unary_loop<To, From>(dst, src, [](From v) { return convert<To>(v); });
    });
  });
}

void fill_kernel(const Tensor& dst, double value) {
  // +0.0 is all zero bits in every dtype.
  if (value == 0.0 && !std::signbit(value) && dst.is_contiguous()) {
    std::memset(dst.data_ptr(), 0, static_cast<size_t>(dst.nbytes()));
    return;
  }
  dispatch_all(dst.dtype(), "fill_", [&]<typename T>() {
    const T v = convert<T>(value);
    StridedLoop<1> loop(dst.shape(), {&dst});
    loop.run([&](char** p, const int64_t* s, int64_t n) {
      if (s[0] == sizeof(T)) {
        T* o = reinterpret_cast<T*>(p[0]);
        for (int64_t i = 0; i < n; ++i) o[i] = v;
      } else {
        for (int64_t i = 0; i < n; ++i) *reinterpret_cast<T*>(p[0] + i * s[0]) = v;
      }
    });
  });
}

}  // namespace lockstep::cpu
