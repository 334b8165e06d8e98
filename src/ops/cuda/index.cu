// CUDA kernels of the index ops: the range check, index_select, gather and their adjoints
// index_add and scatter_add, with the semantics of src/ops/cpu/index.cpp.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>

#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

namespace {

using detail::BadIndex;

// Note [CUDA index adjoints]
// index_add and scatter_add are deterministic and add in the CPU kernels' order, with no
// atomics: each thread owns a set of destination elements that no other thread touches and
// adds its contributions to them in index order, so the sums are bit-identical to the CPU's.
// - index_add over a single outer slice (embedding backward, index_select's backward along dim
//   0) with many indices: the positions 0..k-1 are sorted by their index with cub's radix sort,
//   which is stable, so each destination row's contributions stay in position order; then one
//   thread per (destination row, column) adds them. Parallel over the rows and columns
//   touched, whatever the number of repeats (a row that many indices hit is one long thread).
// - index_add otherwise: one thread per (outer slice, column of the inner rows), walking the k
//   indices in order.
// - scatter_add: one thread per line along `dim`, walking the line.
// atomicAdd would be simpler but gives different bits from run to run.

template <typename F>
decltype(auto) dispatch_index(DType t, const char* op, F&& f) {
  switch (t) {
    LS_CUDA_DISPATCH_CASE(i32, int32_t)
    LS_CUDA_DISPATCH_CASE(i64, int64_t)
    default:
      break;
  }
  LS_THROW(op, ": index dtype must be i64 or i32, got ", dtype_name(t));
}

int64_t span_numel(const Dims& shape, int64_t begin, int64_t end) {
  int64_t n = 1;
  for (int64_t d = begin; d < end; ++d) n *= shape[d];
  return n;
}

// -- index_bounds ---------------------------------------------------------------------------
// The smallest position of an entry outside [0, size), by atomicMin (the minimum is the same
// whatever the order of the atomics); `first` starts at kNone.
constexpr unsigned long long kNone = 0x7F7F7F7F7F7F7F7FULL;  // cudaMemset's 0x7F bytes

template <typename I>
__global__ void index_bounds_kernel(const I* index, int64_t n, int64_t size,
                                    unsigned long long* first) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t v = static_cast<int64_t>(index[i]);
    if (v < 0 || v >= size) {
      atomicMin(first, static_cast<unsigned long long>(i));
      return;  // later positions of this thread are larger
    }
  }
}

// Reads `bytes` at device address `src` into host memory `dst`, waiting for the stream.
void read_back(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  LS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  LS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// The fronts read *bad on the host right away, so this waits for the device.
void index_bounds(const Tensor& index, int64_t size, BadIndex* bad) {
  const int64_t n = index.numel();
  if (n == 0) return;
  TensorDeviceGuard guard(index);
  cudaStream_t stream = current_cuda_stream();
  const Tensor ic = index.contiguous();
  Tensor first = empty({1}, TensorOptions(kInt64).with_device(index.device()));
  auto* fp = static_cast<unsigned long long*>(first.data_ptr());
  LS_CUDA_CHECK(cudaMemsetAsync(fp, 0x7F, sizeof(unsigned long long), stream));
  dispatch_index(ic.dtype(), "index", [&]<typename I>() {
    index_bounds_kernel<I><<<grid_for(n), kBlock, 0, stream>>>(data_of<const I>(ic), n, size,
                                                               fp);
    check_launch("index", ic);
    unsigned long long pos = kNone;
    read_back(&pos, fp, sizeof pos, stream);
    if (pos == kNone) return;
    I value{};
    read_back(&value, data_of<const I>(ic) + pos, sizeof value, stream);
    *bad = BadIndex{static_cast<int64_t>(pos), static_cast<int64_t>(value)};
  });
}

// -- index_select ---------------------------------------------------------------------------
// out (outer, k, inner) from src (outer, n, inner): out row (oi, i) = src row (oi, index[i]).
template <typename T, typename I>
__global__ void index_select_kernel(T* out, const T* src, const I* index, int64_t total,
                                    int64_t k, int64_t n, int64_t inner) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t r = e / inner, j = e % inner;
    const int64_t oi = r / k, i = r % k;
    out[e] = src[(oi * n + static_cast<int64_t>(index[i])) * inner + j];
  }
}

void index_select(const Tensor& out, const Tensor& src, int64_t d, const Tensor& index) {
  const int64_t total = out.numel();
  if (total == 0) return;
  TensorDeviceGuard guard(out);
  const int64_t k = index.numel(), n = src.shape()[d];
  const int64_t inner = span_numel(src.shape(), d + 1, src.dim());
  dispatch_all(src.dtype(), "index_select", [&]<typename T>() {
    dispatch_index(index.dtype(), "index_select", [&]<typename I>() {
      index_select_kernel<T, I><<<grid_for(total), kBlock, 0, current_cuda_stream()>>>(
          data_of<T>(out), data_of<const T>(src), data_of<const I>(index), total, k, n, inner);
    });
  });
  check_launch("index_select", out);
}

// -- index_add (Note [CUDA index adjoints]) -------------------------------------------------
// dst (outer, n, inner) += src (outer, k, inner) row i into row index[i]; thread per (oi, j).
template <typename T, typename I>
__global__ void index_add_kernel(T* dst, const T* src, const I* index, int64_t outer, int64_t k,
                                 int64_t n, int64_t inner) {
  const int64_t columns = outer * inner;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < columns; c += stride) {
    const int64_t oi = c / inner, j = c % inner;
    const T* from = src + oi * k * inner + j;
    T* to = dst + oi * n * inner + j;
    int64_t i = 0;
    // Eight loads in flight before their adds (the adds stay in index order).
    constexpr int kBatch = 8;
    for (; i + kBatch <= k; i += kBatch) {
      T v[kBatch];
      int64_t row[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        v[b] = from[(i + b) * inner];
        row[b] = static_cast<int64_t>(index[i + b]);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) to[row[b] * inner] += v[b];
    }
    for (; i < k; ++i) to[static_cast<int64_t>(index[i]) * inner] += from[i * inner];
  }
}

__global__ void iota_kernel(int64_t* out, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = i;
}

// dst (n, inner) += src (k, inner) row pos[p] into row keys[p], keys sorted (stably) by value:
// thread (p, j) with p the first position of its key adds the key's whole run in column j.
template <typename T, typename I>
__global__ void index_add_sorted_kernel(T* dst, const T* src, const I* keys, const int64_t* pos,
                                        int64_t k, int64_t inner) {
  const int64_t total = k * inner;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t p = e / inner, j = e % inner;
    const I key = keys[p];
    if (p > 0 && keys[p - 1] == key) continue;  // not the first of its run
    T* to = dst + static_cast<int64_t>(key) * inner + j;
    T acc = *to;  // the CPU's `to[j] += from[j]`, one rounding per add, in position order
    for (int64_t q = p; q < k && keys[q] == key; ++q) acc += src[pos[q] * inner + j];
    *to = acc;
  }
}

// Indices below this count take the column kernel (the sort's fixed cost is not worth it).
constexpr int64_t kSortedIndexAddMin = 256;

template <typename T, typename I>
void index_add_sorted(const Tensor& dst, const Tensor& index, const Tensor& src, int64_t k,
                      int64_t n, int64_t inner) {
  cudaStream_t stream = current_cuda_stream();
  const TensorOptions on = TensorOptions(kInt64).with_device(dst.device());
  Tensor keys = empty({k}, TensorOptions(index.dtype()).with_device(dst.device()));
  Tensor pos_in = empty({k}, on), pos = empty({k}, on);
  iota_kernel<<<grid_for(k), kBlock, 0, stream>>>(data_of<int64_t>(pos_in), k);
  check_launch("index_select backward", dst);
  // Indices are checked to lie in [0, n): their low `bits` bits order them.
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) < n) ++bits;
  size_t temp_bytes = 0;
  LS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, temp_bytes, data_of<const I>(index), data_of<I>(keys),
      data_of<const int64_t>(pos_in), data_of<int64_t>(pos), k, 0, bits, stream));
  Tensor temp = empty({std::max<int64_t>(1, static_cast<int64_t>(temp_bytes))},
                      TensorOptions(kUInt8).with_device(dst.device()));
  LS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      temp.data_ptr(), temp_bytes, data_of<const I>(index), data_of<I>(keys),
      data_of<const int64_t>(pos_in), data_of<int64_t>(pos), k, 0, bits, stream));
  index_add_sorted_kernel<T, I><<<grid_for(k * inner), kBlock, 0, stream>>>(
      data_of<T>(dst), data_of<const T>(src), data_of<const I>(keys), data_of<const int64_t>(pos),
      k, inner);
}

void index_add(const Tensor& dst, int64_t d, const Tensor& index, const Tensor& src) {
  const int64_t k = index.numel();
  const int64_t outer = span_numel(dst.shape(), 0, d);
  const int64_t inner = span_numel(dst.shape(), d + 1, dst.dim());
  if (k == 0 || outer * inner == 0) return;
  TensorDeviceGuard guard(dst);
  const int64_t n = dst.shape()[d];
  if (outer == 1 && k >= kSortedIndexAddMin) {
    dispatch_float(dst.dtype(), "index_select backward", [&]<typename T>() {
      dispatch_index(index.dtype(), "index_select backward", [&]<typename I>() {
        index_add_sorted<T, I>(dst, index, src, k, n, inner);
      });
    });
    check_launch("index_select backward", dst);
    return;
  }
  dispatch_float(dst.dtype(), "index_select backward", [&]<typename T>() {
    dispatch_index(index.dtype(), "index_select backward", [&]<typename I>() {
      index_add_kernel<T, I><<<grid_for(outer * inner), kBlock, 0, current_cuda_stream()>>>(
          data_of<T>(dst), data_of<const T>(src), data_of<const I>(index), outer, k, n, inner);
    });
  });
  check_launch("index_select backward", dst);
}

// -- gather, scatter_add --------------------------------------------------------------------
// Lines along `dim` of the index's shape: every position of the other dims. `a` and `b` are two
// operands' strides (in elements) for the offsets of a line's start.
struct Lines {
  int ndim = 0;
  int dim = 0;
  int64_t shape[Dims::kMaxDims] = {};
  int64_t a[Dims::kMaxDims] = {};
  int64_t b[Dims::kMaxDims] = {};

  Lines(const Dims& s, int64_t d, const Dims& sa, const Dims& sb) {
    ndim = static_cast<int>(s.size());
    dim = static_cast<int>(d);
    for (int k = 0; k < ndim; ++k) shape[k] = s[k], a[k] = sa[k], b[k] = sb[k];
  }

  __device__ void offsets(int64_t line, int64_t& oa, int64_t& ob) const {
    oa = ob = 0;
    for (int k = ndim - 1; k >= 0; --k) {
      if (k == dim) continue;
      const int64_t i = line % shape[k];
      line /= shape[k];
      oa += i * a[k];
      ob += i * b[k];
    }
  }
};

// out[p] = src[line start + index[p] * src step], one thread per output element: the output's
// position p splits into its line and its place j along dim.
template <typename T, typename I>
__global__ void gather_kernel(T* out, const T* src, const I* index, Lines lines, int64_t total,
                              int64_t len, int64_t step, int64_t src_step) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t p = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; p < total; p += stride) {
    // p = (outer, j, inner) with inner = step (the index is contiguous).
    const int64_t j = (p / step) % len;
    const int64_t line = (p / (step * len)) * step + p % step;
    int64_t io, so;
    lines.offsets(line, io, so);
    out[io + j * step] = src[so + static_cast<int64_t>(index[io + j * step]) * src_step];
  }
}

void gather(const Tensor& out, const Tensor& src, int64_t d, const Tensor& index) {
  const int64_t total = index.numel();
  if (total == 0) return;
  TensorDeviceGuard guard(out);
  const Dims idx_strides = contiguous_strides(index.shape());  // also the output's
  const Lines lines(index.shape(), d, idx_strides, src.strides());
  const int64_t len = index.shape()[d], step = idx_strides[d];
  dispatch_all(src.dtype(), "gather", [&]<typename T>() {
    dispatch_index(index.dtype(), "gather", [&]<typename I>() {
      gather_kernel<T, I><<<grid_for(total), kBlock, 0, current_cuda_stream()>>>(
          data_of<T>(out), data_of<const T>(src), data_of<const I>(index), lines, total, len,
          step, src.strides()[d]);
    });
  });
  check_launch("gather", out);
}

// dst[line start + index[p] * dst step] += src[p] along each line, in order (Note [CUDA index
// adjoints]): two lines never share a destination element.
template <typename T, typename I>
__global__ void scatter_add_kernel(T* dst, const T* src, const I* index, Lines lines,
                                   int64_t count, int64_t len, int64_t step, int64_t dst_step) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t l = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; l < count; l += stride) {
    int64_t io, dof;
    lines.offsets(l, io, dof);
    for (int64_t j = 0; j < len; ++j)
      dst[dof + static_cast<int64_t>(index[io + j * step]) * dst_step] += src[io + j * step];
  }
}

void scatter_add(const Tensor& dst, int64_t d, const Tensor& index, const Tensor& src) {
  const int64_t len = index.shape()[d];
  if (index.numel() == 0) return;
  TensorDeviceGuard guard(dst);
  const Dims idx_strides = contiguous_strides(index.shape());  // also src's
  const Dims dst_strides = contiguous_strides(dst.shape());
  const Lines lines(index.shape(), d, idx_strides, dst_strides);
  const int64_t count = index.numel() / len;
  dispatch_float(dst.dtype(), "gather backward", [&]<typename T>() {
    dispatch_index(index.dtype(), "gather backward", [&]<typename I>() {
      scatter_add_kernel<T, I><<<grid_for(count), kBlock, 0, current_cuda_stream()>>>(
          data_of<T>(dst), data_of<const T>(src), data_of<const I>(index), lines, count, len,
          idx_strides[d], dst_strides[d]);
    });
  });
  check_launch("gather backward", dst);
}

}  // namespace

void fill_shape_kernels(Kernels& k) {
  k.index_bounds = index_bounds;
  k.index_select = index_select;
  k.index_add = index_add;
  k.gather = gather;
  k.scatter_add = scatter_add;
}

}  // namespace lockstep::cuda_ops
