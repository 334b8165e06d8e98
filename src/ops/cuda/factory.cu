// CUDA creation kernels: arange and the Philox random fills, drawing the numbers of the CPU
// kernels (src/ops/cpu/factory.cpp) element for element.
#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"
#include "ops/cuda/philox.cuh"

namespace lockstep::cuda_ops {

namespace {

// Note [CUDA random fills]
// Note [Random tensors] fixes which Philox block and lanes every element draws, so a fill's
// values do not depend on the device. Each thread computes one Philox block and writes the
// elements that block feeds (4 for a 32-bit draw, 2 for a 64-bit one), in a grid-stride loop.
// The value of each element is computed by the host/device functions of src/ops/cuda/philox.cuh
// (uniform_value, normal_value, randint_value): the CPU kernel's arithmetic, in double where it
// is in double, with explicitly rounded operations (__dmul_rn, __dadd_rn) because nvcc would
// otherwise contract `low + span * u` into one fused multiply-add, which the CPU build (no
// -march) never does; tests/ops/philox_test.cpp checks their host side against the CPU kernels.
// rand, randint and arange are bit-identical to the CPU. randn goes through log, sin and cos,
// which CUDA's libm computes within 1-2 ulp where glibc rounds (nearly always) correctly: a f64
// randn may differ from the CPU's in its last bits; after rounding to f32/bf16/f16 a difference
// needs a value within an ulp of a rounding boundary, so these agree all but never.

template <typename T>
__global__ void arange_kernel(T* out, int64_t n, double start, double step) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = convert<T>(__dadd_rn(start, __dmul_rn(static_cast<double>(i), step)));
}

// Uniform [low, high): 32-bit draws (lane i % 4 of block i / 4) for every dtype but f64, which
// draws 53 bits from lanes 2 (i % 2), 2 (i % 2) + 1 of block i / 2.
template <typename T>
__global__ void rand_uniform_kernel(T* out, int64_t n, uint64_t seed, uint64_t start, double low,
                                    double high, double span) {
  constexpr bool wide = std::is_same_v<T, double>;
  constexpr int per_block = wide ? 2 : 4;
  const int64_t blocks = (n + per_block - 1) / per_block;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < blocks; j += stride) {
    const philox::Block b = philox::philox(seed, start + static_cast<uint64_t>(j));
#pragma unroll
    for (int k = 0; k < per_block; ++k) {
      const int64_t i = j * per_block + k;
      if (i >= n) break;
      out[i] = convert<T>(philox::uniform_value(b, k, wide, low, high, span));
    }
  }
}

// Box-Muller on the lane pairs (0, 1) and (2, 3) of block i / 4: lane 2p gives the cosine,
// lane 2p + 1 the sine.
template <typename T>
__global__ void rand_normal_kernel(T* out, int64_t n, uint64_t seed, uint64_t start, double mean,
                                   double std) {
  const int64_t blocks = (n + 3) / 4;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < blocks; j += stride) {
    const philox::Block b = philox::philox(seed, start + static_cast<uint64_t>(j));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = j * 4 + k;
      if (i >= n) break;
      out[i] = convert<T>(philox::normal_value(b, k, mean, std));
    }
  }
}

// low + (64 random bits from lanes 2 (i % 2), 2 (i % 2) + 1 of block i / 2) mod span.
template <typename T>
__global__ void randint_kernel(T* out, int64_t n, uint64_t seed, uint64_t start, int64_t low,
                               uint64_t span) {
  const int64_t blocks = (n + 1) / 2;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < blocks; j += stride) {
    const philox::Block b = philox::philox(seed, start + static_cast<uint64_t>(j));
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t i = j * 2 + k;
      if (i >= n) break;
      out[i] = convert<T>(philox::randint_value(b, k, low, span));
    }
  }
}

// The fronts allocate `t` contiguous (empty()); the kernels write it as a flat array.
void check_contiguous(const Tensor& t, const char* op) {
  LS_CHECK(t.is_contiguous(), op, ": expected a contiguous output on cuda, got shape ",
           t.shape().str());
}

void arange(const Tensor& t, double start, double step) {
  const int64_t n = t.numel();
  if (n == 0) return;
  check_contiguous(t, "arange");
  TensorDeviceGuard guard(t);
  dispatch_all(t.dtype(), "arange", [&]<typename T>() {
    arange_kernel<T><<<grid_for(n), kBlock, 0, current_cuda_stream()>>>(data_of<T>(t), n, start,
                                                                         step);
  });
  check_launch("arange", t);
}

void rand_uniform(const Tensor& t, uint64_t seed, uint64_t start, double low, double high) {
  const int64_t n = t.numel();
  if (n == 0) return;
  check_contiguous(t, "rand");
  TensorDeviceGuard guard(t);
  const double span = high - low;  // rounded on the host, as the CPU kernel does
  dispatch_all(t.dtype(), "rand", [&]<typename T>() {
    const int per_block = std::is_same_v<T, double> ? 2 : 4;
    rand_uniform_kernel<T><<<grid_for(n, per_block), kBlock, 0, current_cuda_stream()>>>(
        data_of<T>(t), n, seed, start, low, high, span);
  });
  check_launch("rand", t);
}

void rand_normal(const Tensor& t, uint64_t seed, uint64_t start, double mean, double std) {
  const int64_t n = t.numel();
  if (n == 0) return;
  check_contiguous(t, "randn");
  TensorDeviceGuard guard(t);
  dispatch_all(t.dtype(), "randn", [&]<typename T>() {
    rand_normal_kernel<T><<<grid_for(n, 4), kBlock, 0, current_cuda_stream()>>>(
        data_of<T>(t), n, seed, start, mean, std);
  });
  check_launch("randn", t);
}

void randint(const Tensor& t, uint64_t seed, uint64_t start, int64_t low, int64_t high) {
  const int64_t n = t.numel();
  if (n == 0) return;
  check_contiguous(t, "randint");
  TensorDeviceGuard guard(t);
  const uint64_t span = static_cast<uint64_t>(high - low);
  dispatch_all(t.dtype(), "randint", [&]<typename T>() {
    randint_kernel<T><<<grid_for(n, 2), kBlock, 0, current_cuda_stream()>>>(
        data_of<T>(t), n, seed, start, low, span);
  });
  check_launch("randint", t);
}

}  // namespace

void fill_factory_kernels(Kernels& k) {
  k.arange = arange;
  k.rand_uniform = rand_uniform;
  k.rand_normal = rand_normal;
  k.randint = randint;
}

}  // namespace lockstep::cuda_ops
