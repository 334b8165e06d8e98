// CUDA reduction kernels (sum, var, max/min with index) over a ReducePlan: deterministic tree
// reductions with the CPU kernels' precision (src/ops/cpu/reduce.cpp). Note [CUDA reductions].
#include <algorithm>

#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

namespace {

using detail::ReducePlan;

// Note [CUDA reductions]
// Output o reduces the `count` elements of the plan's reduced dims, numbered k row-major (the
// CPU's order, and the index max/min report). Two shapes of work, picked on the host:
// - Thread mode, when the outputs lie closer together in memory than the reduced elements
//   (sum over dim 0 of (rows, n)) or there are only a few elements per output: one thread per
//   output walks its elements in order, so neighbouring threads read neighbouring addresses.
// - Group mode otherwise: a group of G threads (32..256, a power of two no larger than the
//   row needs) per output, thread t taking elements t, t + G, ..., then a shared-memory tree.
// When there are too few outputs to fill the GPU, each output's elements are also split into
// `splits` consecutive chunks whose partial results go to a buffer and are combined, in chunk
// order, by a second kernel. Every partial result and every combination is fixed by the shapes
// alone (no atomics), so a reduction gives the same bits on every run.
// Precision as the CPU's: floating sums accumulate in double (f32 included) and round once,
// integer sums in i64 (wrapping, so the order is immaterial), var takes its mean first (pass 1)
// then the sum of squared deviations in double (pass 2). Sums differ from the CPU's only by the
// order of double additions, far below f32 rounding.

// The plan's dims with size-1 dims dropped and neighbours merged where one step over the outer
// dim equals a whole run of the inner one; merging keeps the row-major numbering k.
struct DimList {
  int n = 0;
  int64_t shape[Dims::kMaxDims] = {};
  int64_t strides[Dims::kMaxDims] = {};

  static DimList of(const Dims& shape, const Dims& strides) {
    DimList l;
    for (int64_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 1) continue;
      if (l.n > 0 && l.strides[l.n - 1] == strides[d] * shape[d]) {
        l.shape[l.n - 1] *= shape[d];
        l.strides[l.n - 1] = strides[d];
        continue;
      }
      l.shape[l.n] = shape[d];
      l.strides[l.n] = strides[d];
      ++l.n;
    }
    return l;
  }

  // Element offset of row-major position i.
  __device__ int64_t offset(int64_t i) const {
    if (n == 1) return i * strides[0];  // the common case, without a 64-bit division
    int64_t off = 0;
    for (int d = n - 1; d >= 0; --d) {
      off += (i % shape[d]) * strides[d];
      i /= shape[d];
    }
    return off;
  }
};

struct ReduceIndex {
  DimList keep, red;
};

// -- reducers: Acc, identity, load, combine, store ------------------------------------------
// Floating sums in double, integer sums in i64; out[o] = acc * scale, or acc / divisor (var's
// mean, divided as the CPU divides).
template <typename T, typename Out>
struct SumReducer {
  using Acc = std::conditional_t<std::is_floating_point_v<T>, double, int64_t>;
  Out* out;
  double scale;
  double divisor;  // 0: multiply by scale instead

  __device__ Acc identity() const { return Acc(0); }
  __device__ Acc load(T v, int64_t, int64_t) const { return static_cast<Acc>(v); }
  __device__ Acc combine(Acc a, Acc b) const { return a + b; }
  __device__ void store(int64_t o, Acc a) const {
    if constexpr (std::is_floating_point_v<T>) {
      out[o] = static_cast<Out>(divisor != 0 ? a / divisor : a * scale);
    } else {
      out[o] = static_cast<Out>(a);  // integer sums ignore scale, as on the CPU
    }
  }
};

// Sum over (x - mean[o])^2, divided by denom.
template <typename T>
struct SquaredDeviationReducer {
  using Acc = double;
  T* out;
  const double* mean;
  double denom;

  __device__ Acc identity() const { return 0.0; }
  __device__ Acc load(T v, int64_t o, int64_t) const {
    const double d = static_cast<double>(v) - mean[o];
    return d * d;
  }
  __device__ Acc combine(Acc a, Acc b) const { return a + b; }
  __device__ void store(int64_t o, Acc a) const { out[o] = static_cast<T>(a / denom); }
};

// The winner and its index; index -1 is "nothing seen" (an empty reduction stores T{} and -1,
// as the CPU does).
template <typename T>
struct Candidate {
  T v;
  int64_t i;
};

// The first NaN if there is one, else the largest (smallest) value, ties to the lower index:
// choosing the best under one total order, so any tree of combines picks the CPU's winner.
template <typename T>
struct ExtremeReducer {
  using Acc = Candidate<T>;
  T* values;
  int64_t* indices;
  bool is_max;

  __device__ Acc identity() const { return Acc{T{}, -1}; }
  __device__ Acc load(T v, int64_t, int64_t k) const { return Acc{v, k}; }
  __device__ Acc combine(Acc a, Acc b) const {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    const bool a_nan = a.v != a.v, b_nan = b.v != b.v;
    if (a_nan || b_nan) {
      if (a_nan && b_nan) return a.i < b.i ? a : b;
      return a_nan ? a : b;
    }
    if (a.v != b.v) {
      const bool a_wins = is_max ? a.v > b.v : a.v < b.v;
      return a_wins ? a : b;
    }
    return a.i < b.i ? a : b;
  }
  __device__ void store(int64_t o, Acc a) const {
    values[o] = a.v;
    indices[o] = a.i;
  }
};

// -- kernels --------------------------------------------------------------------------------
// Work item w = (split s, output o), o fastest. Elements [k0, k1) of output o folded in order.
template <typename T, typename R>
__device__ typename R::Acc fold_range(const T* in, const ReduceIndex& ix, const R& r, int64_t o,
                                      int64_t base, int64_t k0, int64_t k1, int64_t step) {
  typename R::Acc acc = r.identity();
  for (int64_t k = k0; k < k1; k += step)
    acc = r.combine(acc, r.load(in[base + ix.red.offset(k)], o, k));
  return acc;
}

template <typename T, typename R>
__global__ void reduce_thread_kernel(const T* in, ReduceIndex ix, int64_t outputs, int64_t count,
                                     int64_t splits, int64_t chunk, R r,
                                     typename R::Acc* partial) {
  const int64_t items = outputs * splits;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t w = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; w < items; w += stride) {
    const int64_t o = w % outputs, s = w / outputs;
    const int64_t k0 = s * chunk, k1 = min(count, k0 + chunk);
    const auto acc = fold_range(in, ix, r, o, ix.keep.offset(o), k0, k1, 1);
    if (splits == 1) {
      r.store(o, acc);
    } else {
      partial[o * splits + s] = acc;
    }
  }
}

// Groups of G threads per work item; every thread of the block runs the same number of loop
// iterations so that __syncthreads is reached uniformly.
template <typename T, typename R>
__global__ void reduce_group_kernel(const T* in, ReduceIndex ix, int64_t outputs, int64_t count,
                                    int64_t splits, int64_t chunk, int group, R r,
                                    typename R::Acc* partial) {
  using Acc = typename R::Acc;
  __shared__ alignas(16) unsigned char smem[kBlock * sizeof(Acc)];
  Acc* buf = reinterpret_cast<Acc*>(smem);
  const int groups = blockDim.x / group;
  const int g = threadIdx.x / group, lane = threadIdx.x % group;
  const int64_t items = outputs * splits;
  for (int64_t first = int64_t{blockIdx.x} * groups; first < items;
       first += int64_t{gridDim.x} * groups) {
    const int64_t w = first + g;
    Acc acc = r.identity();
    if (w < items) {
      const int64_t o = w / splits, s = w % splits;
      const int64_t k0 = s * chunk, k1 = min(count, k0 + chunk);
      acc = fold_range(in, ix, r, o, ix.keep.offset(o), k0 + lane, k1, group);
    }
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int h = group / 2; h > 0; h /= 2) {
      if (lane < h) buf[threadIdx.x] = r.combine(buf[threadIdx.x], buf[threadIdx.x + h]);
      __syncthreads();
    }
    if (lane == 0 && w < items) {
      if (splits == 1) {
        r.store(w, buf[threadIdx.x]);
      } else {
        partial[w] = buf[threadIdx.x];  // w = o * splits + s
      }
    }
    __syncthreads();  // buf is rewritten by the next iteration
  }
}

// Output o combines its splits' partial results in split order.
template <typename R>
__global__ void reduce_finish_kernel(const typename R::Acc* partial, int64_t outputs,
                                     int64_t splits, R r) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t o = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; o < outputs; o += stride) {
    auto acc = partial[o * splits];
    for (int64_t s = 1; s < splits; ++s) acc = r.combine(acc, partial[o * splits + s]);
    r.store(o, acc);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Runs reducer r over `a` for every output of the plan (outputs = product of keep_shape), on
// the current stream of a's device (the caller holds the device guard).
template <typename T, typename R>
void run_reduce(const char* op, const Tensor& a, const ReducePlan& p, int64_t outputs,
                const R& r) {
  if (outputs == 0) return;
  using Acc = typename R::Acc;
  const ReduceIndex ix{DimList::of(p.keep_shape, p.keep_strides),
                       DimList::of(p.red_shape, p.red_strides)};
  const int64_t count = p.count;
  const T* in = static_cast<const T*>(a.data_ptr());
  cudaStream_t stream = current_cuda_stream();
  // Thread mode: few elements per output, or outputs adjacent in memory (Note [CUDA reductions]).
  const bool outputs_adjacent = ix.keep.n > 0 && ix.red.n > 0 &&
                                ix.keep.strides[ix.keep.n - 1] < ix.red.strides[ix.red.n - 1];
  const bool thread_mode = count <= 32 || outputs_adjacent;
  int group = kBlock;
  int64_t splits = 1;
  if (thread_mode) {
    // Enough threads to fill the GPU (about 64K), each folding at least 32 elements.
    constexpr int64_t kTargetThreads = 65536;
    if (outputs < kTargetThreads)
      splits = std::clamp<int64_t>(kTargetThreads / outputs, 1, std::max<int64_t>(1, count / 32));
  } else {
    group = 32;
    while (group < kBlock && group < count) group *= 2;
    // About 2048 groups' worth of blocks, each split folding at least 16 elements per thread.
    constexpr int64_t kTargetGroups = 2048;
    if (outputs < kTargetGroups)
      splits = std::clamp<int64_t>(kTargetGroups / outputs, 1,
                                   std::max<int64_t>(1, count / (int64_t{group} * 16)));
  }
  // At least 1: an empty reduction (count 0) stores the identity, never divides by 0 below.
  const int64_t chunk = std::max<int64_t>(1, ceil_div(count, splits));
  splits = std::max<int64_t>(1, ceil_div(count, chunk));
  Tensor partial;
  Acc* part = nullptr;
  if (splits > 1) {
    partial = empty({outputs * splits * static_cast<int64_t>(sizeof(Acc))},
                    TensorOptions(kUInt8).with_device(a.device()));
    part = static_cast<Acc*>(partial.data_ptr());
  }
  const int64_t items = outputs * splits;
  if (thread_mode) {
    reduce_thread_kernel<T, R><<<grid_for(items), kBlock, 0, stream>>>(in, ix, outputs, count,
                                                                       splits, chunk, r, part);
  } else {
    const int64_t groups_per_block = kBlock / group;
    const int64_t blocks = std::min<int64_t>(ceil_div(items, groups_per_block), 65535LL * 8);
    reduce_group_kernel<T, R><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
        in, ix, outputs, count, splits, chunk, group, r, part);
  }
  check_launch(op, a);
  if (splits > 1) {
    reduce_finish_kernel<R><<<grid_for(outputs), kBlock, 0, stream>>>(part, outputs, splits, r);
    check_launch(op, a);
  }
}

int64_t outputs_of(const ReducePlan& p) {
  int64_t n = 1;
  for (int64_t d = 0; d < p.keep_shape.size(); ++d) n *= p.keep_shape[d];
  return n;
}

void sum(const Tensor& out, const Tensor& a, const ReducePlan& p, double scale) {
  TensorDeviceGuard guard(a);
  const int64_t outputs = outputs_of(p);
  // Bool sums too (counting trues), as on the CPU; 16-bit floats arrive as f32 (the front).
  dispatch_all(a.dtype(), "sum", [&]<typename T>() {
    if constexpr (is_half_v<T>) {
      LS_THROW("sum: unreachable 16-bit float input on cuda (the front sums them as f32)");
    } else {
      using Out = std::conditional_t<std::is_floating_point_v<T>, T, int64_t>;
      run_reduce<T>("sum", a, p, outputs, SumReducer<T, Out>{data_of<Out>(out), scale, 0.0});
    }
  });
}

void var(const Tensor& out, const Tensor& a, const ReducePlan& p, double denom) {
  TensorDeviceGuard guard(a);
  const int64_t outputs = outputs_of(p);
  if (outputs == 0) return;
  dispatch_float(a.dtype(), "var", [&]<typename T>() {
    Tensor mean = empty({outputs}, TensorOptions(kFloat64).with_device(a.device()));
    run_reduce<T>("var", a, p, outputs,
              SumReducer<T, double>{data_of<double>(mean), 1.0, static_cast<double>(p.count)});
    run_reduce<T>("var", a, p, outputs,
              SquaredDeviationReducer<T>{data_of<T>(out), data_of<double>(mean), denom});
  });
}

void extreme(const Tensor& values, const Tensor& indices, const Tensor& a, const ReducePlan& p,
             bool is_max) {
  const char* op = is_max ? "max" : "min";
  TensorDeviceGuard guard(a);
  const int64_t outputs = outputs_of(p);
  dispatch_numeric(a.dtype(), op, [&]<typename T>() {
    run_reduce<T>(op, a, p, outputs,
              ExtremeReducer<T>{data_of<T>(values), data_of<int64_t>(indices), is_max});
  });
}

}  // namespace

void fill_reduce_kernels(Kernels& k) {
  k.sum = sum;
  k.var = var;
  k.extreme = extreme;
}

}  // namespace lockstep::cuda_ops
