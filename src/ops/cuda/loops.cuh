// What every CUDA kernel file shares: the device types behind a DType, dtype dispatch, launch
// geometry, and the elementwise loop over any strides (Note [CUDA elementwise loops]).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "lockstep/tensor/tensor.h"
#include "tensor/cuda/runtime.h"

namespace lockstep::cuda_ops {

using cuda::check_launch;
using cuda::current_cuda_stream;
using cuda::TensorDeviceGuard;

// -- types ----------------------------------------------------------------------------------
// A DType's element type on the device: bf16 and f16 are CUDA's own types, with the same bits
// as lockstep's BFloat16 and Half.
template <typename T>
inline constexpr bool is_half_v = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

// The type a kernel computes an element of T in: float for the 16-bit floats, T otherwise.
template <typename T>
using acc_t = std::conditional_t<is_half_v<T>, float, T>;

template <typename To, typename From>
__host__ __device__ inline To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (is_half_v<From>) {
    return convert<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, __nv_bfloat16>) {
    return __float2bfloat16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, __half>) {
    return __float2half(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else {
    return static_cast<To>(v);
  }
}

#define LS_CUDA_DISPATCH_CASE(DT, T) \
  case DType::DT:                    \
    return f.template operator()<T>();

// f.template operator()<T>() with T the device type of `t`; `op` names the caller in the error.
template <typename F>
decltype(auto) dispatch_all(DType t, const char* op, F&& f) {
  switch (t) {
    LS_CUDA_DISPATCH_CASE(f32, float)
    LS_CUDA_DISPATCH_CASE(f64, double)
    LS_CUDA_DISPATCH_CASE(bf16, __nv_bfloat16)
    LS_CUDA_DISPATCH_CASE(f16, __half)
    LS_CUDA_DISPATCH_CASE(i32, int32_t)
    LS_CUDA_DISPATCH_CASE(i64, int64_t)
    LS_CUDA_DISPATCH_CASE(u8, uint8_t)
    LS_CUDA_DISPATCH_CASE(b8, bool)
  }
  LS_THROW(op, ": unsupported dtype on cuda");
}

// f32, f64, i32, i64, u8 (16-bit floats reach kernels as f32: the fronts convert them).
template <typename F>
decltype(auto) dispatch_numeric(DType t, const char* op, F&& f) {
  switch (t) {
    LS_CUDA_DISPATCH_CASE(f32, float)
    LS_CUDA_DISPATCH_CASE(f64, double)
    LS_CUDA_DISPATCH_CASE(i32, int32_t)
    LS_CUDA_DISPATCH_CASE(i64, int64_t)
    LS_CUDA_DISPATCH_CASE(u8, uint8_t)
    default:
      break;
  }
  LS_THROW(op, ": dtype ", dtype_name(t), " is not supported on cuda (expected f32, f64, i32, ",
           "i64 or u8)");
}

template <typename F>
decltype(auto) dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    LS_CUDA_DISPATCH_CASE(f32, float)
    LS_CUDA_DISPATCH_CASE(f64, double)
    default:
      break;
  }
  LS_THROW(op, ": dtype ", dtype_name(t), " is not supported on cuda (expected f32 or f64)");
}

// Any floating dtype: f32, f64, bf16, f16.
template <typename F>
decltype(auto) dispatch_floating(DType t, const char* op, F&& f) {
  switch (t) {
    LS_CUDA_DISPATCH_CASE(f32, float)
    LS_CUDA_DISPATCH_CASE(f64, double)
    LS_CUDA_DISPATCH_CASE(bf16, __nv_bfloat16)
    LS_CUDA_DISPATCH_CASE(f16, __half)
    default:
      break;
  }
  LS_THROW(op, ": dtype ", dtype_name(t), " is not a floating dtype");
}

// -- launch geometry ------------------------------------------------------------------------
inline constexpr int kBlock = 256;

// Blocks for n work items of `per_thread` each, capped so a grid-stride loop covers the rest.
inline unsigned grid_for(int64_t n, int per_thread = 1) {
  const int64_t per_block = int64_t{kBlock} * per_thread;
  int64_t blocks = (n + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535LL * 8) blocks = 65535LL * 8;
  return static_cast<unsigned>(blocks);
}

template <typename T>
T* data_of(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Note [CUDA elementwise loops]
// An elementwise kernel maps N input tensors to one output of the same shape (inputs are
// already broadcast to it as stride-0 views). When every operand is contiguous, each thread
// takes kVec consecutive elements with one aligned vector load per operand where the pointers
// allow it, and a grid-stride loop covers any size; otherwise each element's offsets come from
// its linear index divided down the shape (StridedOffsets), as PyTorch's OffsetCalculator does.
// Indexing is 64-bit throughout: tensors above 2^31 elements are common on an H200.
// Device code is written as functor structs with a __device__ operator(): nvcc forbids extended
// __device__ lambdas inside the generic lambdas that dtype dispatch calls.
template <int N>
struct StridedOffsets {
  int ndim = 0;
  int64_t shape[Dims::kMaxDims] = {};
  int64_t strides[N][Dims::kMaxDims] = {};  // in elements

  __device__ void at(int64_t linear, int64_t (&off)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t i = linear % shape[d];
      linear /= shape[d];
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += i * strides[k][d];
    }
  }
};

template <int N>
StridedOffsets<N> strided_offsets(const Dims& shape, const Tensor* const (&ts)[N]) {
  StridedOffsets<N> s;
  s.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < s.ndim; ++d) {
    s.shape[d] = shape[d];
    for (int k = 0; k < N; ++k) s.strides[k][d] = ts[k]->strides()[d];
  }
  return s;
}

inline constexpr int kVec = 4;

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// out[i] = f(in[i]...) over n contiguous elements; `aligned`: every pointer is aligned to its
// vector width, so whole vectors are loaded and stored.
template <typename Out, typename F, typename... In>
__global__ void map_contiguous_kernel(int64_t n, bool aligned, F f, Out* out, const In*... in) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x * kVec;
  int64_t base = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  if (aligned) {
    for (; base + kVec <= n; base += step) {
      Vec<Out, kVec> o;
      auto loaded = [&](const auto* p) { return *reinterpret_cast<const Vec<std::remove_cv_t<
                                             std::remove_pointer_t<decltype(p)>>, kVec>*>(p + base); };
      // Load all inputs' vectors first, then compute.
      auto vs = [&](const auto&... v) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) o.v[j] = f(v.v[j]...);
      };
      vs(loaded(in)...);
      *reinterpret_cast<Vec<Out, kVec>*>(out + base) = o;
    }
    // The tail (fewer than kVec elements) falls through to the scalar loop below.
    if (base < n) {
      for (int64_t i = base; i < n; ++i) out[i] = f(in[i]...);
    }
    return;
  }
  for (; base < n; base += step) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t i = base + j;
      if (i < n) out[i] = f(in[i]...);
    }
  }
}

template <typename Out, typename F, size_t... K, typename... In>
__device__ inline void map_one(const int64_t* off, F& f, Out* out, std::index_sequence<K...>,
                               const In*... in) {
  out[off[0]] = f(in[off[K + 1]]...);
}

template <typename Out, typename F, typename... In>
__global__ void map_strided_kernel(int64_t n, StridedOffsets<sizeof...(In) + 1> offs, F f,
                                   Out* out, const In*... in) {
  constexpr int N = sizeof...(In) + 1;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t off[N];
    offs.at(i, off);
    map_one(off, f, out, std::index_sequence_for<In...>{}, in...);
  }
}

inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// out = f(ins...) elementwise, with Out and In the device types of out's and the inputs'
// dtypes (the caller dispatched), on the current stream of out's device; checks the launch.
template <typename Out, typename... In, typename F, typename... Ts>
void map(const char* op, const Tensor& out, F f, const Ts&... ins) {
  static_assert(sizeof...(In) == sizeof...(Ts), "one element type per input tensor");
  const int64_t n = out.numel();
  if (n == 0) return;
  TensorDeviceGuard guard(out);
  cudaStream_t stream = current_cuda_stream();
  Out* o = data_of<Out>(out);
  const bool contiguous = out.is_contiguous() && (ins.is_contiguous() && ...);
  if (contiguous) {
    const bool aligned = aligned_to(o, sizeof(Out) * kVec) &&
                         (aligned_to(ins.data_ptr(), sizeof(In) * kVec) && ...);
    map_contiguous_kernel<Out, F, In...><<<grid_for(n, kVec), kBlock, 0, stream>>>(
        n, aligned, f, o, static_cast<const In*>(ins.data_ptr())...);
  } else {
    const Tensor* ts[] = {&out, &ins...};
    auto offs = strided_offsets<sizeof...(In) + 1>(out.shape(), ts);
    map_strided_kernel<Out, F, In...><<<grid_for(n), kBlock, 0, stream>>>(
        n, offs, f, o, static_cast<const In*>(ins.data_ptr())...);
  }
  check_launch(op, out);
}

}  // namespace lockstep::cuda_ops
