// Deterministic reductions shared by the linalg, conv, loss and norm kernels: a block-wide tree
// and per-channel reductions of an (N, C, inner) layout (Note [Deterministic CUDA reductions]).
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

// Note [Deterministic CUDA reductions]
// Every floating-point sum these kernels return is the same on every run and every GPU: each
// block combines its threads' partial values in a fixed tree, the work is split into blocks by
// the shape alone (never by the number of SMs or by timing), and partial results are combined
// by one thread in block order. No floating-point atomics. Sums run in double, as the CPU
// kernels accumulate (src/ops/cpu/), so both devices agree to within the last bits of the
// result's dtype.

// Threads per block of the reductions (a power of two).
inline constexpr int kReduceThreads = 256;

template <int K>
struct Sums {
  double v[K];
  __host__ __device__ Sums() {
    for (int k = 0; k < K; ++k) v[k] = 0;
  }
  __device__ static Sums combine(const Sums& a, const Sums& b) {
    Sums s;
#pragma unroll
    for (int k = 0; k < K; ++k) s.v[k] = a.v[k] + b.v[k];
    return s;
  }
};

// The combination of every thread's `v` in a fixed tree, returned to every thread of the block.
// blockDim.x * blockDim.y must be a power of two and at most kMaxTreeThreads; every thread calls.
inline constexpr int kMaxTreeThreads = 512;

template <typename Acc, typename Combine>
__device__ Acc block_reduce(Acc v, Combine combine) {
  __shared__ alignas(16) unsigned char raw[kMaxTreeThreads * sizeof(Acc)];
  Acc* sh = reinterpret_cast<Acc*>(raw);
  const int n = blockDim.x * blockDim.y;
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  __syncthreads();  // an earlier call's readers are done with sh
  sh[t] = v;
  __syncthreads();
  for (int s = n / 2; s > 0; s /= 2) {
    if (t < s) sh[t] = combine(sh[t], sh[t + s]);
    __syncthreads();
  }
  return sh[0];
}

struct AddOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};

struct CombineOp {
  template <typename Acc>
  __device__ Acc operator()(const Acc& a, const Acc& b) const {
    return Acc::combine(a, b);
  }
};

// Per-channel reduction of values laid out as (batch, channels, inner): for every channel c,
// fin(c, acc) receives the combination over n < batch, i < inner of f(c, n, i) (an Acc: a
// trivially copyable struct whose default is the identity, with a static combine). Two layouts:
// - inner == 1 (columns: a matrix's column sums, batch_norm over (N, C)): blocks of 32 channels
//   x 8 rows, threads along the channels so reads of a row-major matrix coalesce;
// - inner > 1 (planes: conv and batch_norm over (N, C, H, W)): one block per channel and chunk
//   of its batch * inner values, threads along inner.
// Long reductions are split into chunks (a number that depends on the shape only) whose
// partial results a second kernel combines in chunk order (Note [Deterministic CUDA reductions]).
inline constexpr int kColumnTile = 32;
inline constexpr int kColumnRows = 8;
inline constexpr int64_t kRowsPerChunk = 256;      // columns layout
inline constexpr int64_t kValuesPerChunk = 16384;  // planes layout
inline constexpr int64_t kMaxChunks = 1024;

inline int64_t reduce_chunks(int64_t values, int64_t per_chunk) {
  return std::clamp<int64_t>((values + per_chunk - 1) / per_chunk, 1, kMaxChunks);
}

// The combination of one chunk, written to partial[chunk * channels + c], or, when there is one
// chunk, handed to fin directly.
template <typename Acc, typename F, typename Fin>
__global__ void reduce_columns_kernel(int64_t batch, int64_t channels, int64_t rows_per_chunk, F f,
                                      Fin fin, Acc* partial) {
  const int64_t c = int64_t{blockIdx.x} * kColumnTile + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t r0 = chunk * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < batch ? r0 + rows_per_chunk : batch;
  Acc acc;
  if (c < channels) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColumnRows)
      acc = Acc::combine(acc, f(c, r, 0));
  }
  __shared__ alignas(16) unsigned char raw[kColumnRows * kColumnTile * sizeof(Acc)];
  Acc* sh = reinterpret_cast<Acc*>(raw);
  sh[threadIdx.y * kColumnTile + threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || c >= channels) return;
  Acc total = sh[threadIdx.x];
  for (int y = 1; y < kColumnRows; ++y)
    total = Acc::combine(total, sh[y * kColumnTile + threadIdx.x]);
  if (partial == nullptr) {
    fin(c, total);
  } else {
    partial[chunk * channels + c] = total;
  }
}

template <typename Acc, typename F, typename Fin>
__global__ void reduce_planes_kernel(int64_t batch, int64_t channels, int64_t inner,
                                     int64_t per_chunk, F f, Fin fin, Acc* partial) {
  const int64_t c = blockIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t total_values = batch * inner;
  const int64_t j0 = chunk * per_chunk;
  const int64_t j1 = j0 + per_chunk < total_values ? j0 + per_chunk : total_values;
  Acc acc;
  int64_t j = j0 + threadIdx.x;
  if (j < j1) {
    // (n, i) of value j, stepped without a division per value.
    int64_t n = j / inner, i = j % inner;
    for (; j < j1; j += blockDim.x) {
      acc = Acc::combine(acc, f(c, n, i));
      i += blockDim.x;
      while (i >= inner) {
        i -= inner;
        ++n;
      }
    }
  }
  const Acc total = block_reduce(acc, CombineOp{});
  if (threadIdx.x != 0) return;
  if (partial == nullptr) {
    fin(c, total);
  } else {
    partial[chunk * channels + c] = total;
  }
}

// Combines the chunks of each channel in chunk order.
template <typename Acc, typename Fin>
__global__ void reduce_chunks_kernel(int64_t channels, int64_t chunks, const Acc* partial,
                                     Fin fin) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < channels; c += step) {
    Acc acc = partial[c];
    for (int64_t k = 1; k < chunks; ++k) acc = Acc::combine(acc, partial[k * channels + c]);
    fin(c, acc);
  }
}

// Runs the reduction on the current stream of `device`'s current device (the caller holds a
// TensorDeviceGuard); `op` names the caller in launch errors.
template <typename Acc, typename F, typename Fin>
void channel_reduce(const char* op, const Device& device, int64_t batch, int64_t channels,
                    int64_t inner, F f, Fin fin) {
  if (channels == 0) return;
  cudaStream_t stream = current_cuda_stream();
  const bool columns = inner == 1;
  const int64_t values = batch * inner;
  const int64_t chunks =
      columns ? reduce_chunks(batch, kRowsPerChunk) : reduce_chunks(values, kValuesPerChunk);
  const int64_t per_chunk = (std::max<int64_t>(columns ? batch : values, 1) + chunks - 1) / chunks;
  LS_CHECK(channels <= (columns ? int64_t{INT32_MAX} * kColumnTile : int64_t{INT32_MAX}), op, ": ",
           channels, " channels exceed a CUDA grid");
  Tensor partial_buf;
  Acc* partial = nullptr;
  if (chunks > 1) {
    partial_buf = empty({chunks * channels * static_cast<int64_t>(sizeof(Acc))},
                        TensorOptions(kUInt8).with_device(device));
    partial = static_cast<Acc*>(partial_buf.data_ptr());
  }
  if (columns) {
    const dim3 grid(static_cast<unsigned>((channels + kColumnTile - 1) / kColumnTile),
                    static_cast<unsigned>(chunks));
    reduce_columns_kernel<Acc><<<grid, dim3(kColumnTile, kColumnRows), 0, stream>>>(
        batch, channels, per_chunk, f, fin, partial);
  } else {
    const dim3 grid(static_cast<unsigned>(channels), static_cast<unsigned>(chunks));
    reduce_planes_kernel<Acc>
        <<<grid, kReduceThreads, 0, stream>>>(batch, channels, inner, per_chunk, f, fin, partial);
  }
  check_launch(op);
  if (chunks > 1) {
    reduce_chunks_kernel<Acc>
        <<<grid_for(channels), kBlock, 0, stream>>>(channels, chunks, partial, fin);
    check_launch(op);
  }
}

// A power-of-two block size for one row of `n` values: about four values per thread, from 32
// to kMaxTreeThreads threads.
inline int row_threads(int64_t n) {
  int t = 32;
  while (t < kMaxTreeThreads && int64_t{t} * 4 < n) t *= 2;
  return t;
}

// Blocks for `rows` rows of one block each (a grid-stride loop covers the rest).
inline unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, int64_t{1} << 20));
}

}  // namespace lockstep::cuda_ops
