// The CUDA loss kernels: cross_entropy (log-sum-exp and label-smoothed NLL fused, one block per
// row, the target check and the scalar reduction in one deterministic pass) and mse_loss, with
// their backward kernels.
#include <climits>
#include <cmath>

#include "ops/cuda/channel_reduce.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

using detail::TargetCheck;

namespace {

template <typename T>
__device__ inline T exp_of(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return expf(v);
  } else {
    return exp(v);
  }
}

// The first element's offset of each row of a tensor along `dim`, row r being the r-th position
// (row-major) over the other dims (src/ops/cpu/rows.h's Rows, on the device).
struct RowOffsets {
  int ndim = 0;
  int64_t size[Dims::kMaxDims] = {};
  int64_t stride[Dims::kMaxDims] = {};

  RowOffsets(const Tensor& t, int64_t dim) {
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (d == dim || t.size(d) == 1) continue;
      size[ndim] = t.size(d);
      stride[ndim] = t.stride(d);
      ++ndim;
    }
  }

  __device__ int64_t at(int64_t r) const {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      off += (r % size[d]) * stride[d];
      r /= size[d];
    }
    return off;
  }
};

// ---- cross_entropy ----

// One block per row: the row's max, then sum exp(x - max) and sum x in double (as the CPU
// kernel), its log-sum-exp, and its loss: -(1-e) log p_t - (e/C) sum_c log p_c, 0 when the
// target is ignored or out of range (the check reports the latter; nothing reads x there).
template <typename T>
__global__ void cross_entropy_rows_kernel(int64_t rows, int64_t classes, int64_t sx, RowOffsets ro,
                                          const T* x, const int64_t* tgt, int64_t ignore_index,
                                          double smoothing, T* lse_out, double* row_loss,
                                          T* out_none) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + ro.at(r);
    T mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < classes; i += blockDim.x) {
      const T v = xr[i * sx];
      mx = mx < v ? v : mx;  // std::max: a NaN never becomes the max (it poisons the sum)
    }
    mx = block_reduce(mx, MaxOp{});
    Sums<2> acc;
    for (int64_t i = threadIdx.x; i < classes; i += blockDim.x) {
      const T v = xr[i * sx];
      acc.v[0] += static_cast<double>(exp_of<T>(v - mx));
      acc.v[1] += static_cast<double>(v);
    }
    const Sums<2> s = block_reduce(acc, CombineOp{});
    if (threadIdx.x != 0) continue;
    const double lse = static_cast<double>(mx) + log(s.v[0]);
    lse_out[r] = static_cast<T>(lse);
    const int64_t t = tgt[r];
    double loss = 0;
    if (t != ignore_index && t >= 0 && t < classes) {
      const double nll = lse - static_cast<double>(xr[t * sx]);
      loss = (1 - smoothing) * nll + smoothing * (lse - s.v[1] / static_cast<double>(classes));
    }
    if (out_none) {
      out_none[r] = static_cast<T>(loss);
    } else {
      row_loss[r] = loss;
    }
  }
}

// The scalar loss and the target check, combined over rows.
struct CrossEntropyAcc {
  double loss = 0;
  int64_t count = 0;        // targets that are not ignore_index (and in range)
  int64_t bad = LLONG_MAX;  // first row whose target is out of range
  __device__ static CrossEntropyAcc combine(const CrossEntropyAcc& a, const CrossEntropyAcc& b) {
    CrossEntropyAcc c;
    c.loss = a.loss + b.loss;
    c.count = a.count + b.count;
    c.bad = a.bad < b.bad ? a.bad : b.bad;
    return c;
  }
};

// With one channel, rows come either as n (batch = rows, inner = 1) or as i (batch = 1): the
// row is n + i.
struct CrossEntropyValue {
  const int64_t* tgt;
  const double* row_loss;  // null for Reduction::none
  int64_t classes, ignore_index;
  __device__ CrossEntropyAcc operator()(int64_t, int64_t n, int64_t i) const {
    const int64_t r = n + i;
    const int64_t t = tgt[r];
    CrossEntropyAcc a;
    if (t == ignore_index) return a;
    if (t < 0 || t >= classes) {
      a.bad = r;
      return a;
    }
    a.count = 1;
    if (row_loss) a.loss = row_loss[r];
    return a;
  }
};

template <typename T>
struct CrossEntropyStore {
  const int64_t* tgt;
  T* out;  // null for Reduction::none
  bool mean;
  int64_t* check;  // count, bad position (-1: none), bad value
  __device__ void operator()(int64_t, const CrossEntropyAcc& a) const {
    // Mean over the non-ignored targets, as PyTorch: all ignored gives 0 / 0 = NaN.
    if (out) out[0] = static_cast<T>(mean ? a.loss / static_cast<double>(a.count) : a.loss);
    check[0] = a.count;
    check[1] = a.bad == LLONG_MAX ? -1 : a.bad;
    check[2] = a.bad == LLONG_MAX ? 0 : tgt[a.bad];
  }
};

void cross_entropy_kernel(const Tensor& out, const Tensor& lse, const Tensor& logits,
                          const Tensor& targets, Reduction reduction, int64_t ignore_index,
                          double smoothing, TargetCheck* check) {
  const int64_t rows = targets.numel(), classes = logits.size(1);
  TensorDeviceGuard guard(logits);
  cudaStream_t stream = current_cuda_stream();
  const auto dev = TensorOptions(kInt64).with_device(logits.device());
  Tensor check_buf = empty({3}, dev);
  dispatch_float(logits.dtype(), "cross_entropy", [&]<typename T>() {
    const bool none = reduction == Reduction::none;
    Tensor row_loss =
        none ? Tensor() : empty({rows}, TensorOptions(kFloat64).with_device(logits.device()));
    const int64_t* tgt = data_of<int64_t>(targets);
    if (rows > 0) {
      cross_entropy_rows_kernel<T><<<row_blocks(rows), row_threads(classes), 0, stream>>>(
          rows, classes, logits.stride(1), RowOffsets(logits, 1), data_of<T>(logits), tgt,
          ignore_index, smoothing, data_of<T>(lse), none ? nullptr : data_of<double>(row_loss),
          none ? data_of<T>(out) : nullptr);
      check_launch("cross_entropy", logits);
    }
    channel_reduce<CrossEntropyAcc>(
        "cross_entropy", logits.device(), 1, 1, rows,
        CrossEntropyValue{tgt, none ? nullptr : data_of<double>(row_loss), classes, ignore_index},
        CrossEntropyStore<T>{tgt, none ? nullptr : data_of<T>(out), reduction == Reduction::mean,
                             data_of<int64_t>(check_buf)});
  });
  // The front throws for a bad target, so the check comes back to the host now (one
  // synchronization per loss, as PyTorch's host-side checks of class targets).
  int64_t host[3];
  LS_CUDA_CHECK(
      cudaMemcpyAsync(host, check_buf.data_ptr(), sizeof(host), cudaMemcpyDeviceToHost, stream));
  LS_CUDA_CHECK(cudaStreamSynchronize(stream));
  check->count = host[0];
  check->bad = {host[1], host[2]};
}

// dx = scale_r * (softmax - (1 - e) * onehot(t) - e / C) per element of the contiguous dx
// (N, C, d...), 0 on ignored rows; scale_r is g[r] (none) or g[0] (/ count for mean).
template <typename T>
__global__ void cross_entropy_backward_kernel(int64_t total, int64_t classes, int64_t inner,
                                              StridedOffsets<1> xo, const T* x, const int64_t* tgt,
                                              const T* lse, const T* g, bool per_row, bool mean,
                                              double count, int64_t ignore_index, double smoothing,
                                              T* dx) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  const T sub = static_cast<T>(smoothing / static_cast<double>(classes));
  const T on_target = static_cast<T>(1 - smoothing);
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t c = (e / inner) % classes;
    const int64_t r = e / (classes * inner) * inner + e % inner;
    const int64_t t = tgt[r];
    if (t == ignore_index) {
      dx[e] = T(0);
      continue;
    }
    T scale;
    if (per_row) {
      scale = g[r];
    } else {
      double u = static_cast<double>(g[0]);
      if (mean) u /= count;
      scale = static_cast<T>(u);
    }
    int64_t off[1];
    xo.at(e, off);
    T v = scale * (exp_of<T>(x[off[0]] - lse[r]) - sub);
    if (c == t) v -= scale * on_target;
    dx[e] = v;
  }
}

void cross_entropy_backward_kernel(const Tensor& dx, const Tensor& g, const Tensor& logits,
                                   const Tensor& targets, const Tensor& lse, Reduction reduction,
                                   int64_t ignore_index, double smoothing, int64_t count) {
  const int64_t total = dx.numel();
  if (total == 0) return;
  const int64_t classes = logits.size(1);
  const int64_t inner = total / (logits.size(0) * classes);
  TensorDeviceGuard guard(dx);
  dispatch_float(logits.dtype(), "cross_entropy", [&]<typename T>() {
    const Tensor* ts[] = {&logits};
    cross_entropy_backward_kernel<T><<<grid_for(total), kBlock, 0, current_cuda_stream()>>>(
        total, classes, inner, strided_offsets<1>(logits.shape(), ts), data_of<T>(logits),
        data_of<int64_t>(targets), data_of<T>(lse), data_of<T>(g), reduction == Reduction::none,
        reduction == Reduction::mean, static_cast<double>(count), ignore_index, smoothing,
        data_of<T>(dx));
    check_launch("cross_entropy backward", dx);
  });
}

// ---- mse_loss ----

template <typename T>
struct SquaredDifference {
  __device__ T operator()(T a, T b) const {
    const T d = a - b;
    return d * d;
  }
};

// One channel of n values, as in CrossEntropyValue: the element is n + i.
template <typename T>
struct SquaredDifferenceValue {
  const T* x;
  const T* t;
  __device__ Sums<1> operator()(int64_t, int64_t n, int64_t i) const {
    const double d = static_cast<double>(x[n + i]) - static_cast<double>(t[n + i]);
    Sums<1> s;
    s.v[0] = d * d;
    return s;
  }
};

template <typename T>
struct ScalarStore {
  T* out;
  double divisor;
  __device__ void operator()(int64_t, const Sums<1>& s) const {
    out[0] = static_cast<T>(s.v[0] / divisor);  // mean of nothing: 0 / 0 = NaN
  }
};

void mse_loss_kernel(const Tensor& out, const Tensor& x, const Tensor& t, Reduction reduction) {
  const int64_t n = x.numel();
  TensorDeviceGuard guard(x);
  dispatch_float(x.dtype(), "mse_loss", [&]<typename T>() {
    if (reduction == Reduction::none) {
      map<T, T, T>("mse_loss", out, SquaredDifference<T>{}, x, t);
      return;
    }
    const double divisor = reduction == Reduction::mean ? static_cast<double>(n) : 1.0;
    channel_reduce<Sums<1>>("mse_loss", x.device(), 1, 1, n,
                            SquaredDifferenceValue<T>{data_of<T>(x), data_of<T>(t)},
                            ScalarStore<T>{data_of<T>(out), divisor});
  });
}

// d/dx = 2 (x - t) g (/ n for mean); d/dt is its negation.
template <typename T>
__global__ void mse_loss_backward_kernel(int64_t n, const T* x, const T* t, const T* g,
                                         bool per_element, double divisor, T* gx, T* gt) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += step) {
    const T factor =
        per_element ? T(2) * g[i] : static_cast<T>(2.0 * static_cast<double>(g[0]) / divisor);
    const T v = factor * (x[i] - t[i]);
    if (gx) gx[i] = v;
    if (gt) gt[i] = -v;
  }
}

void mse_loss_backward_kernel(const Tensor& gx, const Tensor& gt, const Tensor& g, const Tensor& x,
                              const Tensor& t, Reduction reduction) {
  const int64_t n = x.numel();
  if (n == 0 || (!gx.defined() && !gt.defined())) return;
  TensorDeviceGuard guard(x);
  dispatch_float(x.dtype(), "mse_loss", [&]<typename T>() {
    mse_loss_backward_kernel<T><<<grid_for(n), kBlock, 0, current_cuda_stream()>>>(
        n, data_of<T>(x), data_of<T>(t), data_of<T>(g), reduction == Reduction::none,
        reduction == Reduction::mean ? static_cast<double>(n) : 1.0,
        gx.defined() ? data_of<T>(gx) : nullptr, gt.defined() ? data_of<T>(gt) : nullptr);
    check_launch("mse_loss backward", x);
  });
}

}  // namespace

void fill_loss_kernels(Kernels& k) {
  k.cross_entropy = cross_entropy_kernel;
  k.cross_entropy_backward = cross_entropy_backward_kernel;
  k.mse_loss = mse_loss_kernel;
  k.mse_loss_backward = mse_loss_backward_kernel;
}

}  // namespace lockstep::cuda_ops
