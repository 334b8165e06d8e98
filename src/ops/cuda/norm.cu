// The CUDA normalization kernels: layer_norm (one block per row, its statistics in double as on
// the CPU) with its backward, and batch_norm (channel statistics, the affine map, the backward),
// with every reduction deterministic (Note [Deterministic CUDA reductions]).
#include <cmath>

#include "ops/cuda/channel_reduce.cuh"
#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

namespace {

// ---- layer_norm ----

// One block per row of x (m, n): two passes for the mean and the variance (no cancellation
// when |mean| >> std), in double as src/ops/cpu/norm.cpp, then the affine map in T.
template <typename T>
__global__ void layer_norm_forward_kernel(int64_t m, int64_t n, const T* x, const T* w, const T* b,
                                          T* y, T* mean, T* rstd, double eps) {
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    double s = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += static_cast<double>(xr[i]);
    const double mu_d = block_reduce(s, AddOp{}) / static_cast<double>(n);
    double ss = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const double d = static_cast<double>(xr[i]) - mu_d;
      ss += d * d;
    }
    const double rstd_d = 1.0 / sqrt(block_reduce(ss, AddOp{}) / static_cast<double>(n) + eps);
    if (threadIdx.x == 0) {
      mean[r] = static_cast<T>(mu_d);
      rstd[r] = static_cast<T>(rstd_d);
    }
    const T mu = static_cast<T>(mu_d), rs = static_cast<T>(rstd_d);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      T v = (xr[i] - mu) * rs;
      if (w) v *= w[i];
      if (b) v += b[i];
      yr[i] = v;
    }
  }
}

// dx per row: with xhat = (x - mean) * rstd and wg = g * weight,
// dx = rstd * (wg - mean(wg) - xhat * mean(wg * xhat)) (the CPU kernel's formula).
template <typename T>
__global__ void layer_norm_dx_kernel(int64_t m, int64_t n, const T* x, const T* g, const T* w,
                                     const T* mean, const T* rstd, T* dx) {
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    const T* gr = g + r * n;
    const T mu = mean[r], rs = rstd[r];
    Sums<2> acc;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const T wg = w ? gr[i] * w[i] : gr[i];
      acc.v[0] += static_cast<double>(wg);
      acc.v[1] += static_cast<double>(wg * ((xr[i] - mu) * rs));
    }
    const Sums<2> tot = block_reduce(acc, CombineOp{});
    const T a = static_cast<T>(tot.v[0] / static_cast<double>(n));
    const T bb = static_cast<T>(tot.v[1] / static_cast<double>(n));
    T* dr = dx + r * n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const T wg = w ? gr[i] * w[i] : gr[i];
      dr[i] = rs * (wg - a - (xr[i] - mu) * rs * bb);
    }
  }
}

// Column c, row r of layer_norm's weight and bias gradients: g * xhat and g.
template <typename T>
struct LayerNormWbValue {
  const T* x;
  const T* g;
  const T* mean;
  const T* rstd;
  int64_t n;
  __device__ Sums<2> operator()(int64_t c, int64_t r, int64_t) const {
    const T xhat = (x[r * n + c] - mean[r]) * rstd[r];
    const T gv = g[r * n + c];
    Sums<2> s;
    s.v[0] = static_cast<double>(gv * xhat);
    s.v[1] = static_cast<double>(gv);
    return s;
  }
};

template <typename T>
struct LayerNormWbStore {
  T* dw;
  T* db;
  __device__ void operator()(int64_t c, const Sums<2>& s) const {
    if (dw) dw[c] = static_cast<T>(s.v[0]);
    if (db) db[c] = static_cast<T>(s.v[1]);
  }
};

template <typename T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? data_of<T>(t) : nullptr;
}

template <typename T>
T* mut_ptr_or_null(const Tensor& t) {
  return t.defined() ? data_of<T>(t) : nullptr;
}

void layer_norm_kernel(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, double eps) {
  const int64_t m = x.size(0), n = x.size(1);
  if (m == 0) return;
  TensorDeviceGuard guard(x);
  dispatch_float(x.dtype(), "layer_norm", [&]<typename T>() {
    layer_norm_forward_kernel<T><<<row_blocks(m), row_threads(n), 0, current_cuda_stream()>>>(
        m, n, data_of<T>(x), ptr_or_null<T>(weight), ptr_or_null<T>(bias), data_of<T>(y),
        data_of<T>(mean), data_of<T>(rstd), eps);
    check_launch("layer_norm", x);
  });
}

void layer_norm_backward_kernel(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                const Tensor& g, const Tensor& x, const Tensor& weight,
                                const Tensor& mean, const Tensor& rstd) {
  const int64_t m = x.size(0), n = x.size(1);
  TensorDeviceGuard guard(x);
  dispatch_float(x.dtype(), "layer_norm", [&]<typename T>() {
    if (dx.defined() && m > 0 && n > 0) {
      layer_norm_dx_kernel<T><<<row_blocks(m), row_threads(n), 0, current_cuda_stream()>>>(
          m, n, data_of<T>(x), data_of<T>(g), ptr_or_null<T>(weight), data_of<T>(mean),
          data_of<T>(rstd), data_of<T>(dx));
      check_launch("layer_norm backward", x);
    }
    if (dweight.defined() || dbias.defined()) {
      // dweight and dbias: column sums over the rows (Note [Deterministic CUDA reductions]).
      channel_reduce<Sums<2>>(
          "layer_norm backward", x.device(), m, n, 1,
          LayerNormWbValue<T>{data_of<T>(x), data_of<T>(g), data_of<T>(mean), data_of<T>(rstd), n},
          LayerNormWbStore<T>{mut_ptr_or_null<T>(dweight), mut_ptr_or_null<T>(dbias)});
    }
  });
}

// ---- batch_norm ----

// x (N, C, *) contiguous as N * C runs of `inner` elements; run i belongs to channel i % C.
struct ChannelRuns {
  int64_t batch, channels, inner;
  explicit ChannelRuns(const Tensor& x)
      : batch(x.size(0)),
        channels(x.size(1)),
        inner(x.numel() / std::max<int64_t>(x.size(0) * x.size(1), 1)) {}
  int64_t count() const { return batch * inner; }  // values per channel
};

__device__ inline int64_t offset_of(int64_t c, int64_t n, int64_t i, int64_t channels,
                                    int64_t inner) {
  return (n * channels + c) * inner + i;
}

// Note [Batch statistics in one pass] (src/ops/cpu/norm.cpp): sums of (v - K) and (v - K)^2
// with K the channel's first value.
template <typename T>
struct StatsValue {
  const T* x;
  int64_t channels, inner;
  __device__ Sums<2> operator()(int64_t c, int64_t n, int64_t i) const {
    const double d = static_cast<double>(x[offset_of(c, n, i, channels, inner)]) -
                     static_cast<double>(x[c * inner]);
    Sums<2> s;
    s.v[0] = d;
    s.v[1] = d * d;
    return s;
  }
};

template <typename T>
struct StatsStore {
  const T* x;
  T* mean;
  T* var;
  int64_t inner;
  double count;
  __device__ void operator()(int64_t c, const Sums<2>& s) const {
    const double shift = count > 0 ? static_cast<double>(x[c * inner]) : 0.0;
    const double d_mean = s.v[0] / count;
    mean[c] = static_cast<T>(shift + d_mean);
    const double v = s.v[1] / count - d_mean * d_mean;
    var[c] = static_cast<T>(v > 0.0 ? v : (v == v ? 0.0 : v));  // max(v, 0); NaN stays NaN
  }
};

void batch_norm_stats_kernel(const Tensor& mean, const Tensor& var, const Tensor& x) {
  const ChannelRuns r(x);
  TensorDeviceGuard guard(x);
  dispatch_float(x.dtype(), "batch_norm", [&]<typename T>() {
    channel_reduce<Sums<2>>("batch_norm", x.device(), r.batch, r.channels, r.inner,
                            StatsValue<T>{data_of<T>(x), r.channels, r.inner},
                            StatsStore<T>{data_of<T>(x), data_of<T>(mean), data_of<T>(var), r.inner,
                                          static_cast<double>(r.count())});
  });
}

// Per channel: coeff[2c] = 1/sqrt(var + eps) * weight, coeff[2c + 1] = bias (in double, as the
// CPU's inv_std, then rounded to T once).
template <typename T>
__global__ void batch_norm_coeff_kernel(int64_t channels, const T* var, const T* w, const T* b,
                                        double eps, T* coeff) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < channels; c += step) {
    const double istd = 1.0 / sqrt(static_cast<double>(var[c]) + eps);
    coeff[2 * c] = static_cast<T>(w ? istd * static_cast<double>(w[c]) : istd);
    coeff[2 * c + 1] = b ? b[c] : T(0);
  }
}

template <typename T>
__global__ void batch_norm_apply_kernel(int64_t total, int64_t channels, int64_t inner, const T* x,
                                        const T* mean, const T* coeff, T* y) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t c = (e / inner) % channels;
    y[e] = (x[e] - mean[c]) * coeff[2 * c] + coeff[2 * c + 1];
  }
}

void batch_norm_kernel(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& var,
                       const Tensor& weight, const Tensor& bias, double eps) {
  const ChannelRuns r(x);
  const int64_t total = x.numel();
  if (r.channels == 0) return;
  TensorDeviceGuard guard(x);
  cudaStream_t stream = current_cuda_stream();
  dispatch_float(x.dtype(), "batch_norm", [&]<typename T>() {
    Tensor coeff = empty({2 * r.channels}, TensorOptions(x.dtype()).with_device(x.device()));
    batch_norm_coeff_kernel<T><<<grid_for(r.channels), kBlock, 0, stream>>>(
        r.channels, data_of<T>(var), ptr_or_null<T>(weight), ptr_or_null<T>(bias), eps,
        data_of<T>(coeff));
    check_launch("batch_norm", x);
    if (total == 0) return;
    batch_norm_apply_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(
        total, r.channels, r.inner, data_of<T>(x), data_of<T>(mean), data_of<T>(coeff),
        data_of<T>(y));
    check_launch("batch_norm", x);
  });
}

// Per channel of the backward: sum g and sum g * (x - mean), in double.
template <typename T>
struct BackwardValue {
  const T* x;
  const T* g;
  const T* mean;
  int64_t channels, inner;
  __device__ Sums<2> operator()(int64_t c, int64_t n, int64_t i) const {
    const int64_t off = offset_of(c, n, i, channels, inner);
    const double gv = static_cast<double>(g[off]);
    Sums<2> s;
    s.v[0] = gv;
    s.v[1] = gv * (static_cast<double>(x[off]) - static_cast<double>(mean[c]));
    return s;
  }
};

template <typename T>
struct BackwardStore {
  double* sums;  // (C, 2)
  const T* var;
  T* dw;
  T* db;
  double eps;
  __device__ void operator()(int64_t c, const Sums<2>& s) const {
    sums[2 * c] = s.v[0];
    sums[2 * c + 1] = s.v[1];
    if (db) db[c] = static_cast<T>(s.v[0]);
    if (dw) dw[c] = static_cast<T>(s.v[1] * (1.0 / sqrt(static_cast<double>(var[c]) + eps)));
  }
};

// Per channel: coeff[3c .. 3c + 2] = weight * istd, mean(g), istd^2 * sum(g (x - mean)) / m,
// each computed in double and rounded to T once (the CPU kernel's scale, g_mean and proj).
template <typename T>
__global__ void batch_norm_backward_coeff_kernel(int64_t channels, const double* sums, const T* var,
                                                 const T* w, double eps, double m, T* coeff) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < channels; c += step) {
    const double istd = 1.0 / sqrt(static_cast<double>(var[c]) + eps);
    const double wc = w ? static_cast<double>(w[c]) : 1.0;
    coeff[3 * c] = static_cast<T>(wc * istd);
    coeff[3 * c + 1] = sums ? static_cast<T>(sums[2 * c] / m) : T(0);
    coeff[3 * c + 2] = sums ? static_cast<T>(sums[2 * c + 1] * istd * istd / m) : T(0);
  }
}

template <typename T>
__global__ void batch_norm_dx_kernel(int64_t total, int64_t channels, int64_t inner, bool training,
                                     const T* g, const T* x, const T* mean, const T* coeff, T* dx) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t c = (e / inner) % channels;
    const T scale = coeff[3 * c];
    if (!training) {
      dx[e] = g[e] * scale;
    } else {
      dx[e] = scale * (g[e] - coeff[3 * c + 1] - (x[e] - mean[c]) * coeff[3 * c + 2]);
    }
  }
}

void batch_norm_backward_kernel(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                const Tensor& g, const Tensor& x, const Tensor& mean,
                                const Tensor& var, const Tensor& weight, double eps,
                                bool training) {
  const ChannelRuns r(x);
  if (r.channels == 0) return;
  TensorDeviceGuard guard(x);
  cudaStream_t stream = current_cuda_stream();
  dispatch_float(x.dtype(), "batch_norm", [&]<typename T>() {
    Tensor sums;
    if (training || dweight.defined() || dbias.defined()) {
      sums = empty({2 * r.channels}, TensorOptions(kFloat64).with_device(x.device()));
      channel_reduce<Sums<2>>(
          "batch_norm backward", x.device(), r.batch, r.channels, r.inner,
          BackwardValue<T>{data_of<T>(x), data_of<T>(g), data_of<T>(mean), r.channels, r.inner},
          BackwardStore<T>{data_of<double>(sums), data_of<T>(var), mut_ptr_or_null<T>(dweight),
                           mut_ptr_or_null<T>(dbias), eps});
    }
    const int64_t total = x.numel();
    if (!dx.defined() || total == 0) return;
    Tensor coeff = empty({3 * r.channels}, TensorOptions(x.dtype()).with_device(x.device()));
    batch_norm_backward_coeff_kernel<T><<<grid_for(r.channels), kBlock, 0, stream>>>(
        r.channels, training ? data_of<double>(sums) : nullptr, data_of<T>(var),
        ptr_or_null<T>(weight), eps, static_cast<double>(r.count()), data_of<T>(coeff));
    check_launch("batch_norm backward", x);
    batch_norm_dx_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(
        total, r.channels, r.inner, training, data_of<T>(g), data_of<T>(x), data_of<T>(mean),
        data_of<T>(coeff), data_of<T>(dx));
    check_launch("batch_norm backward", x);
  });
}

}  // namespace

void fill_norm_kernels(Kernels& k) {
  k.layer_norm = layer_norm_kernel;
  k.layer_norm_backward = layer_norm_backward_kernel;
  k.batch_norm_stats = batch_norm_stats_kernel;
  k.batch_norm = batch_norm_kernel;
  k.batch_norm_backward = batch_norm_backward_kernel;
}

}  // namespace lockstep::cuda_ops
