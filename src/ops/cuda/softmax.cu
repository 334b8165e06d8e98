// CUDA softmax / log_softmax (forward and backward, along any dim of any strides) and the
// dropout kernels, with the formulas and precision of src/ops/cpu/softmax.cpp and dropout.cpp.
#include <algorithm>

#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"
#include "ops/cuda/philox.cuh"

namespace lockstep::cuda_ops {

namespace {

// Note [CUDA softmax]
// Rows are spread three ways: one thread per row when the rows lie side by side in memory
// (softmax over a dim that is not the innermost, with many rows: neighbouring threads read
// neighbouring addresses, and each row is summed in the CPU's order); otherwise one warp per row
// when the row has at most kWarpRowLimit elements, else one block of kBlock threads per row.
// In a warp or block row each thread takes the elements t, t + threads, ... of the row; partial
// results combine through a fixed butterfly of warp shuffles (and, for a block, the warps'
// results in warp order), so every run gives the same bits. As on the CPU: the max is taken in
// T and ignores NaN (std::max's `mx < x ? x : mx`; a NaN then poisons the sum), exponentials in
// T, their sum in double; the backward's row sums in double, rounded to T once.
constexpr int kWarp = 32;
constexpr int64_t kWarpRowLimit = 1024;

// Rows along `dim` of N operands of one shape (as Rows in src/ops/cpu/rows.h): row r is the r-th
// position, row-major, over the other dims of size > 1.
template <int N>
struct RowIndex {
  int ndim = 0;
  int64_t count = 1, length = 0;
  int64_t step[N] = {};
  int64_t outer[Dims::kMaxDims] = {};
  int64_t strides[N][Dims::kMaxDims] = {};

  RowIndex(const Dims& shape, int64_t dim, const Tensor* const (&ops)[N]) {
    length = shape[dim];
    for (int k = 0; k < N; ++k) step[k] = ops[k]->strides()[dim];
    for (int64_t d = 0; d < shape.size(); ++d) {
      if (d == dim || shape[d] == 1) continue;
      outer[ndim] = shape[d];
      for (int k = 0; k < N; ++k) strides[k][ndim] = ops[k]->strides()[d];
      count *= shape[d];
      ++ndim;
    }
  }

  __device__ void offsets(int64_t r, int64_t (&off)[N]) const {
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t i = r % outer[d];
      r /= outer[d];
      for (int k = 0; k < N; ++k) off[k] += i * strides[k][d];
    }
  }
};

// std::max(a, b) as the CPU computes it: b only when a < b, so a NaN b is never taken.
template <typename T>
__device__ inline T cpu_max(T a, T b) {
  return a < b ? b : a;
}

template <typename T>
__device__ inline T d_exp(T x) {
  if constexpr (std::is_same_v<T, float>) return expf(x); else return exp(x);
}

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const { return cpu_max(a, b); }
};
struct AddOp {
  template <typename T>
  __device__ T operator()(T a, T b) const { return a + b; }
};

// Who works on one row (Note [CUDA softmax]).
enum class RowMode : int { thread, warp, block };

// The combination of v over the threads of the row (none, a warp, or the whole block), in a
// fixed order; every thread of the row gets it (up to the sign of a zero maximum, which the
// butterfly may leave differing between lanes and which no output depends on except through
// x - max of a zero x). `scratch` holds one value per warp (block rows only).
template <typename T, typename Op>
__device__ T row_reduce(T v, Op op, RowMode mode, T* scratch) {
  if (mode == RowMode::thread) return v;
#pragma unroll
  for (int m = kWarp / 2; m > 0; m /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, m));
  if (mode == RowMode::warp) return v;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  __syncthreads();  // scratch may still be read from the previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < warps; ++w) r = op(r, scratch[w]);
  return r;
}

// The row this thread works on in iteration `it` of the grid-stride loop, its first element
// and the step between its elements.
struct RowWork {
  int64_t row, first, threads;
};

// Rows per block and iteration: one per thread, per warp, or per block.
__host__ __device__ inline int64_t rows_per_block(RowMode mode) {
  return mode == RowMode::thread ? kBlock : mode == RowMode::warp ? kBlock / kWarp : 1;
}

__device__ inline RowWork row_work(RowMode mode, int64_t it) {
  switch (mode) {
    case RowMode::thread:
      return RowWork{it * blockDim.x + threadIdx.x, 0, 1};
    case RowMode::warp:
      return RowWork{it * (blockDim.x / kWarp) + threadIdx.x / kWarp, threadIdx.x % kWarp, kWarp};
    case RowMode::block:
      break;
  }
  return RowWork{it, threadIdx.x, blockDim.x};
}

// Thread rows when each element's row neighbour is the next address over (softmax over a dim
// that is not the innermost: neighbouring threads then read neighbouring addresses) and there
// are rows enough to fill the GPU; otherwise a warp per row, a block per long row.
template <int N>
RowMode row_mode(const RowIndex<N>& rows) {
  bool adjacent = rows.ndim > 0;
  for (int k = 0; k < N; ++k)
    adjacent = adjacent && rows.step[k] != 1 && rows.strides[k][rows.ndim - 1] == 1;
  if (adjacent && rows.count >= 16 * kBlock) return RowMode::thread;
  return rows.length > kWarpRowLimit ? RowMode::block : RowMode::warp;
}

// Block rows: every thread of the block runs the same iterations (row_reduce synchronizes);
// warp rows stop by whole warps, so the shuffles always have their full warp.
template <typename T>
__global__ void softmax_forward_kernel(T* y, const T* x, RowIndex<2> rows, RowMode mode,
                                       bool log) {
  __shared__ double scratch_d[kBlock / kWarp];
  __shared__ T scratch_t[kBlock / kWarp];
  const int64_t per_iter = rows_per_block(mode);
  const int64_t iterations = (rows.count + per_iter - 1) / per_iter;
  const int64_t n = rows.length, sy = rows.step[0], sx = rows.step[1];
  for (int64_t it = blockIdx.x; it < iterations; it += gridDim.x) {
    const RowWork w = row_work(mode, it);
    if (mode != RowMode::block && w.row >= rows.count) break;
    int64_t off[2];
    rows.offsets(w.row, off);
    T* yr = y + off[0];
    const T* xr = x + off[1];
    T mx = -INFINITY;
    for (int64_t i = w.first; i < n; i += w.threads) mx = cpu_max(mx, xr[i * sx]);
    mx = row_reduce(mx, MaxOp{}, mode, scratch_t);
    double sum = 0;
    for (int64_t i = w.first; i < n; i += w.threads) sum += d_exp(xr[i * sx] - mx);
    sum = row_reduce(sum, AddOp{}, mode, scratch_d);
    if (log) {
      // (x - max) - log(sum): x - max is exact, so large logits keep their precision.
      const T log_sum = static_cast<T>(::log(sum));
      for (int64_t i = w.first; i < n; i += w.threads) yr[i * sy] = (xr[i * sx] - mx) - log_sum;
    } else {
      const T inv = static_cast<T>(1.0 / sum);
      for (int64_t i = w.first; i < n; i += w.threads) yr[i * sy] = d_exp(xr[i * sx] - mx) * inv;
    }
  }
}

// softmax: dx = y * (g - sum(g * y)); log_softmax: dx = g - exp(y) * sum(g).
template <typename T>
__global__ void softmax_backward_kernel(T* dx, const T* g, const T* y, RowIndex<3> rows,
                                        RowMode mode, bool log) {
  __shared__ double scratch_d[kBlock / kWarp];
  const int64_t per_iter = rows_per_block(mode);
  const int64_t iterations = (rows.count + per_iter - 1) / per_iter;
  const int64_t n = rows.length, sd = rows.step[0], sg = rows.step[1], sy = rows.step[2];
  for (int64_t it = blockIdx.x; it < iterations; it += gridDim.x) {
    const RowWork w = row_work(mode, it);
    if (mode != RowMode::block && w.row >= rows.count) break;
    int64_t off[3];
    rows.offsets(w.row, off);
    T* dr = dx + off[0];
    const T* gr = g + off[1];
    const T* yr = y + off[2];
    double acc = 0;
    if (log) {
      for (int64_t i = w.first; i < n; i += w.threads) acc += gr[i * sg];
    } else {
      for (int64_t i = w.first; i < n; i += w.threads)
        acc += static_cast<double>(gr[i * sg]) * yr[i * sy];
    }
    const T s = static_cast<T>(row_reduce(acc, AddOp{}, mode, scratch_d));
    if (log) {
      for (int64_t i = w.first; i < n; i += w.threads)
        dr[i * sd] = gr[i * sg] - d_exp(yr[i * sy]) * s;
    } else {
      for (int64_t i = w.first; i < n; i += w.threads) dr[i * sd] = yr[i * sy] * (gr[i * sg] - s);
    }
  }
}

unsigned row_grid(int64_t rows, RowMode mode) {
  const int64_t per_block = rows_per_block(mode);
  return static_cast<unsigned>(std::min<int64_t>((rows + per_block - 1) / per_block, 65535LL * 8));
}

void softmax(const Tensor& y, const Tensor& x, int64_t dim, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  if (x.numel() == 0) return;
  TensorDeviceGuard guard(y);
  const Tensor* ops[] = {&y, &x};
  const RowIndex<2> rows(x.shape(), dim, ops);
  const RowMode mode = row_mode(rows);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    softmax_forward_kernel<T><<<row_grid(rows.count, mode), kBlock, 0, current_cuda_stream()>>>(
        data_of<T>(y), data_of<const T>(x), rows, mode, log);
  });
  check_launch(op, y);
}

void softmax_backward(const Tensor& dx, const Tensor& g, const Tensor& y, int64_t dim,
                      bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  if (y.numel() == 0) return;
  TensorDeviceGuard guard(dx);
  const Tensor* ops[] = {&dx, &g, &y};
  const RowIndex<3> rows(y.shape(), dim, ops);
  const RowMode mode = row_mode(rows);
  dispatch_float(y.dtype(), op, [&]<typename T>() {
    softmax_backward_kernel<T><<<row_grid(rows.count, mode), kBlock, 0,
                                 current_cuda_stream()>>>(
        data_of<T>(dx), data_of<const T>(g), data_of<const T>(y), rows, mode, log);
  });
  check_launch(op, dx);
}

// -- dropout --------------------------------------------------------------------------------
// mask[i] = (lane i % 4 of Philox block start + i / 4, as u in [0, 1)) >= p; one thread per
// block of 4 elements.
__global__ void dropout_mask_kernel(uint8_t* mask, int64_t n, uint64_t seed, uint64_t start,
                                    double p) {
  const int64_t blocks = (n + 3) / 4;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t j = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < blocks; j += stride) {
    const philox::Block b = philox::philox(seed, start + static_cast<uint64_t>(j));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = j * 4 + k;
      if (i < n) mask[i] = philox::keep_value(b, k, p);
    }
  }
}

void dropout_mask(const Tensor& mask, uint64_t seed, uint64_t start, double p) {
  const int64_t n = mask.numel();
  if (n == 0) return;
  LS_CHECK(mask.is_contiguous() && mask.dtype() == kUInt8,
           "dropout: expected a contiguous u8 mask on cuda, got ", dtype_name(mask.dtype()),
           " of shape ", mask.shape().str());
  TensorDeviceGuard guard(mask);
  dropout_mask_kernel<<<grid_for(n, 4), kBlock, 0, current_cuda_stream()>>>(
      data_of<uint8_t>(mask), n, seed, start, p);
  check_launch("dropout", mask);
}

// out = mask ? x * scale : 0, the 16-bit floats computing in float and rounding once.
template <typename T>
struct MaskedScaleFn {
  acc_t<T> scale;
  __device__ T operator()(T x, uint8_t m) const {
    if constexpr (is_half_v<T>) {
      return convert<T>(m ? static_cast<float>(x) * scale : 0.0f);
    } else {
      return m ? x * scale : T(0);
    }
  }
};

void masked_scale(const Tensor& out, const Tensor& x, const Tensor& mask, double scale) {
  dispatch_floating(x.dtype(), "dropout", [&]<typename T>() {
    map<T, T, uint8_t>("dropout", out, MaskedScaleFn<T>{static_cast<acc_t<T>>(scale)}, x, mask);
  });
}

}  // namespace

void fill_softmax_kernels(Kernels& k) {
  k.softmax = softmax;
  k.softmax_backward = softmax_backward;
  k.dropout_mask = dropout_mask;
  k.masked_scale = masked_scale;
}

}  // namespace lockstep::cuda_ops
