// The CUDA conv and pooling kernels: conv2d and its backward through cuDNN's convolutions (the
// bias gradient as a deterministic channel sum), max and average pooling as plain kernels.
#include <array>
#include <climits>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include "ops/cuda/channel_reduce.cuh"
#include "ops/cuda/handles.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

using detail::ConvGeometry;
using detail::PoolKind;

namespace {

// ---- conv2d through cuDNN ----

// Note [cuDNN convolutions]
// conv2d runs cuDNN's legacy convolution API on NCHW tensors: f32 and f64 as they are, bf16 and
// f16 with f32 accumulation (CUDNN_DATA_FLOAT compute: products and sums in f32, one rounding
// of each output). f32 may use TF32 tensor cores only when lockstep::cuda::allow_tf32()
// (CUDNN_FMA_MATH otherwise; cuDNN's default math would allow TF32 on Ampere and later).
// The bias starts the output: y is filled with each channel's bias and the convolution added
// with beta = 1, so a bf16 output is still rounded once. The algorithm of each direction is
// chosen once per shape from cudnnGet*Algorithm_v7 (heuristics, no trial runs that would
// allocate outside the caching allocator) and cached: the first that cuDNN rates supported,
// within the workspace limit, with the math the dtype allows and, for the two backward
// directions, deterministic (so that training runs repeat exactly), else the first supported.
// The workspace comes from the caching allocator on the current stream. The bias gradient is a
// channel sum of g in double (Note [Deterministic CUDA reductions]), as on the CPU.
constexpr size_t kMaxConvWorkspaceBytes = size_t{1} << 30;

struct ConvTypes {
  cudnnDataType_t data, compute;
  cudnnMathType_t math;
};

ConvTypes conv_types(DType dt) {
  switch (dt) {
    case DType::f32:
      return {CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT,
              cuda::allow_tf32() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH};
    case DType::f64:
      return {CUDNN_DATA_DOUBLE, CUDNN_DATA_DOUBLE, CUDNN_DEFAULT_MATH};
    case DType::bf16:
      return {CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH};
    case DType::f16:
      return {CUDNN_DATA_HALF, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH};
    default:
      LS_THROW("conv2d: dtype ", dtype_name(dt), " is not supported on cuda");
  }
}

int as_int(int64_t v, const char* what) {
  LS_CHECK(v >= 0 && v <= INT_MAX, "conv2d: ", what, " ", v, " exceeds what cuDNN takes (", INT_MAX,
           ")");
  return static_cast<int>(v);
}

using TensorDesc = std::unique_ptr<cudnnTensorStruct, cudnnStatus_t (*)(cudnnTensorDescriptor_t)>;
using FilterDesc = std::unique_ptr<cudnnFilterStruct, cudnnStatus_t (*)(cudnnFilterDescriptor_t)>;
using ConvDesc =
    std::unique_ptr<cudnnConvolutionStruct, cudnnStatus_t (*)(cudnnConvolutionDescriptor_t)>;

TensorDesc tensor_desc(cudnnDataType_t type, const Dims& s) {
  cudnnTensorDescriptor_t d = nullptr;
  LS_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
  TensorDesc o(d, cudnnDestroyTensorDescriptor);
  LS_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, type, as_int(s[0], "size"),
                                            as_int(s[1], "size"), as_int(s[2], "size"),
                                            as_int(s[3], "size")));
  return o;
}

// The descriptors of one convolution: x (N, C, H, W), w (O, C / groups, kh, kw), y.
struct ConvDescs {
  TensorDesc x, y;
  FilterDesc w;
  ConvDesc conv;
  ConvTypes types;
};

ConvDescs conv_descs(const Tensor& x, const Tensor& w, const ConvGeometry& g, int64_t groups) {
  const ConvTypes types = conv_types(x.dtype());
  Dims yshape = {x.size(0), w.size(0), g.out_h, g.out_w};
  cudnnFilterDescriptor_t fd = nullptr;
  LS_CUDNN_CHECK(cudnnCreateFilterDescriptor(&fd));
  FilterDesc wd(fd, cudnnDestroyFilterDescriptor);
  LS_CUDNN_CHECK(cudnnSetFilter4dDescriptor(fd, types.data, CUDNN_TENSOR_NCHW,
                                            as_int(w.size(0), "size"), as_int(w.size(1), "size"),
                                            as_int(w.size(2), "size"), as_int(w.size(3), "size")));
  cudnnConvolutionDescriptor_t cd = nullptr;
  LS_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&cd));
  ConvDesc conv(cd, cudnnDestroyConvolutionDescriptor);
  LS_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
      cd, as_int(g.pad_h, "padding"), as_int(g.pad_w, "padding"), as_int(g.stride_h, "stride"),
      as_int(g.stride_w, "stride"), as_int(g.dilation_h, "dilation"),
      as_int(g.dilation_w, "dilation"), CUDNN_CROSS_CORRELATION, types.compute));
  LS_CUDNN_CHECK(cudnnSetConvolutionGroupCount(cd, as_int(groups, "groups")));
  LS_CUDNN_CHECK(cudnnSetConvolutionMathType(cd, types.math));
  return {tensor_desc(types.data, x.shape()), tensor_desc(types.data, yshape), std::move(wd),
          std::move(conv), types};
}

enum class ConvDirection : int { forward, backward_data, backward_filter };

// The chosen algorithm of one direction for one shape.
struct ConvAlgo {
  int algo = 0;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspace = 0;
};

using ConvKey = std::array<int64_t, 20>;

ConvKey conv_key(ConvDirection dir, const Tensor& x, const Tensor& w, const ConvGeometry& g,
                 int64_t groups, const ConvTypes& types) {
  return {cuda::current_device(),
          static_cast<int64_t>(dir),
          static_cast<int64_t>(x.dtype()),
          static_cast<int64_t>(types.math),
          x.size(0),
          x.size(1),
          x.size(2),
          x.size(3),
          w.size(0),
          w.size(2),
          w.size(3),
          g.stride_h,
          g.stride_w,
          g.pad_h,
          g.pad_w,
          g.dilation_h,
          g.dilation_w,
          groups,
          0,
          0};
}

class ConvAlgoCache {
 public:
  template <typename Choose>
  ConvAlgo get(const ConvKey& key, Choose choose) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(key);
      if (it != cache_.end()) return it->second;
    }
    const ConvAlgo a = choose();
    std::lock_guard<std::mutex> lock(mu_);
    cache_.emplace(key, a);
    return a;
  }

 private:
  std::mutex mu_;
  std::map<ConvKey, ConvAlgo> cache_;
};

ConvAlgoCache& conv_algo_cache() {
  static ConvAlgoCache cache;
  return cache;
}

// Picks from cuDNN's ranked results (Note [cuDNN convolutions]). For f32 without TF32 an
// algorithm that cuDNN rates with tensor-op math is skipped and the rest run with FMA math (the
// v7 heuristics may report CUDNN_DEFAULT_MATH for them, which would allow TF32).
template <typename Perf>
ConvAlgo pick(const Perf* results, int count, const ConvTypes& types, bool want_deterministic,
              const char* direction) {
  const bool fma_only = types.math == CUDNN_FMA_MATH;
  const Perf* chosen = nullptr;
  for (int i = 0; i < count; ++i) {
    const Perf& r = results[i];
    if (r.status != CUDNN_STATUS_SUCCESS || r.memory > kMaxConvWorkspaceBytes) continue;
    if (fma_only &&
        (r.mathType == CUDNN_TENSOR_OP_MATH || r.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION))
      continue;
    if (chosen == nullptr) chosen = &r;
    if (!want_deterministic || r.determinism == CUDNN_DETERMINISTIC) {
      chosen = &r;
      break;
    }
  }
  LS_CHECK(chosen != nullptr, "conv2d: cuDNN has no ", direction,
           " algorithm for this shape and dtype");
  return {static_cast<int>(chosen->algo), fma_only ? CUDNN_FMA_MATH : chosen->mathType, 0};
}

constexpr int kMaxAlgos = 32;  // more than cuDNN has per direction

ConvAlgo forward_algo(cudnnHandle_t h, const ConvDescs& d, const ConvKey& key) {
  return conv_algo_cache().get(key, [&] {
    cudnnConvolutionFwdAlgoPerf_t results[kMaxAlgos];
    int count = 0;
    LS_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(h, d.x.get(), d.w.get(), d.conv.get(),
                                                          d.y.get(), kMaxAlgos, &count, results));
    ConvAlgo a = pick(results, count, d.types, false, "forward");
    LS_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.get(), a.math));
    LS_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(
        h, d.x.get(), d.w.get(), d.conv.get(), d.y.get(),
        static_cast<cudnnConvolutionFwdAlgo_t>(a.algo), &a.workspace));
    return a;
  });
}

ConvAlgo backward_data_algo(cudnnHandle_t h, const ConvDescs& d, const ConvKey& key) {
  return conv_algo_cache().get(key, [&] {
    cudnnConvolutionBwdDataAlgoPerf_t results[kMaxAlgos];
    int count = 0;
    LS_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(
        h, d.w.get(), d.y.get(), d.conv.get(), d.x.get(), kMaxAlgos, &count, results));
    ConvAlgo a = pick(results, count, d.types, true, "backward data");
    LS_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.get(), a.math));
    LS_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(
        h, d.w.get(), d.y.get(), d.conv.get(), d.x.get(),
        static_cast<cudnnConvolutionBwdDataAlgo_t>(a.algo), &a.workspace));
    return a;
  });
}

ConvAlgo backward_filter_algo(cudnnHandle_t h, const ConvDescs& d, const ConvKey& key) {
  return conv_algo_cache().get(key, [&] {
    cudnnConvolutionBwdFilterAlgoPerf_t results[kMaxAlgos];
    int count = 0;
    LS_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
        h, d.x.get(), d.y.get(), d.conv.get(), d.w.get(), kMaxAlgos, &count, results));
    ConvAlgo a = pick(results, count, d.types, true, "backward filter");
    LS_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.get(), a.math));
    LS_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(
        h, d.x.get(), d.y.get(), d.conv.get(), d.w.get(),
        static_cast<cudnnConvolutionBwdFilterAlgo_t>(a.algo), &a.workspace));
    return a;
  });
}

// A workspace of `bytes` from the caching allocator (undefined for none).
Tensor workspace(size_t bytes, const Device& device) {
  if (bytes == 0) return Tensor();
  return empty({static_cast<int64_t>(bytes)}, TensorOptions(kUInt8).with_device(device));
}

void* ptr_of(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// alpha and beta as cuDNN reads them: double for double data, float otherwise.
struct Scales {
  double d[2];
  float f[2];
  bool is_double;
  Scales(ConvTypes t, double alpha, double beta)
      : d{alpha, beta},
        f{static_cast<float>(alpha), static_cast<float>(beta)},
        is_double(t.data == CUDNN_DATA_DOUBLE) {}
  const void* alpha() const { return is_double ? static_cast<const void*>(&d[0]) : &f[0]; }
  const void* beta() const { return is_double ? static_cast<const void*>(&d[1]) : &f[1]; }
};

// out (N, O, L) = bias[o] everywhere: the accumulator's start.
template <typename T>
__global__ void fill_channels_kernel(int64_t total, int64_t channels, int64_t plane, const T* bias,
                                     T* out) {
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += step)
    out[e] = bias[(e / plane) % channels];
}

void conv2d_kernel(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& bias,
                   const ConvGeometry& geo, int64_t groups) {
  if (out.numel() == 0) return;
  TensorDeviceGuard guard(x);
  cudaStream_t stream = current_cuda_stream();
  if (x.numel() == 0 || w.numel() == 0) {  // no taps: the output is the bias (or zeros)
    if (!bias.defined()) {
      LS_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, static_cast<size_t>(out.nbytes()), stream));
      return;
    }
  }
  if (bias.defined()) {
    const int64_t total = out.numel();
    dispatch_floating(out.dtype(), "conv2d", [&]<typename T>() {
      fill_channels_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(
          total, out.size(1), geo.out_plane(), data_of<T>(bias), data_of<T>(out));
      check_launch("conv2d", out);
    });
    if (x.numel() == 0 || w.numel() == 0) return;
  }
  CudnnLease handle;
  ConvDescs d = conv_descs(x, w, geo, groups);
  const ConvAlgo a =
      forward_algo(handle.get(), d, conv_key(ConvDirection::forward, x, w, geo, groups, d.types));
  LS_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.get(), a.math));
  const Tensor ws = workspace(a.workspace, x.device());
  const Scales s(d.types, 1.0, bias.defined() ? 1.0 : 0.0);
  LS_CUDNN_CHECK(cudnnConvolutionForward(handle.get(), s.alpha(), d.x.get(), x.data_ptr(),
                                         d.w.get(), w.data_ptr(), d.conv.get(),
                                         static_cast<cudnnConvolutionFwdAlgo_t>(a.algo), ptr_of(ws),
                                         a.workspace, s.beta(), d.y.get(), out.data_ptr()));
}

// db[o] = the sum of g (N, O, L) over n and l, in double.
template <typename T>
struct ChannelValue {
  const T* g;
  int64_t channels, plane;
  __device__ Sums<1> operator()(int64_t c, int64_t n, int64_t i) const {
    Sums<1> s;
    s.v[0] = static_cast<double>(static_cast<acc_t<T>>(g[(n * channels + c) * plane + i]));
    return s;
  }
};

template <typename T>
struct ChannelStore {
  T* out;
  __device__ void operator()(int64_t c, const Sums<1>& s) const {
    out[c] = convert<T>(static_cast<acc_t<T>>(s.v[0]));
  }
};

void conv2d_backward_kernel(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& g,
                            const Tensor& x, const Tensor& w, const ConvGeometry& geo,
                            int64_t groups) {
  TensorDeviceGuard guard(x);
  cudaStream_t stream = current_cuda_stream();
  if (db.defined()) {
    dispatch_floating(g.dtype(), "conv2d backward", [&]<typename T>() {
      channel_reduce<Sums<1>>("conv2d backward", g.device(), g.size(0), g.size(1), geo.out_plane(),
                              ChannelValue<T>{data_of<T>(g), g.size(1), geo.out_plane()},
                              ChannelStore<T>{data_of<T>(db)});
    });
  }
  const bool need_dx = dx.defined() && dx.numel() > 0, need_dw = dw.defined() && dw.numel() > 0;
  if (!need_dx && !need_dw) return;
  if (g.numel() == 0 || x.numel() == 0 || w.numel() == 0) {  // an empty sum: zero gradients
    if (need_dx)
      LS_CUDA_CHECK(cudaMemsetAsync(dx.data_ptr(), 0, static_cast<size_t>(dx.nbytes()), stream));
    if (need_dw)
      LS_CUDA_CHECK(cudaMemsetAsync(dw.data_ptr(), 0, static_cast<size_t>(dw.nbytes()), stream));
    return;
  }
  CudnnLease handle;
  ConvDescs d = conv_descs(x, w, geo, groups);
  const Scales s(d.types, 1.0, 0.0);
  if (need_dx) {
    const ConvAlgo a = backward_data_algo(
        handle.get(), d, conv_key(ConvDirection::backward_data, x, w, geo, groups, d.types));
    LS_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.get(), a.math));
    const Tensor ws = workspace(a.workspace, x.device());
    LS_CUDNN_CHECK(cudnnConvolutionBackwardData(
        handle.get(), s.alpha(), d.w.get(), w.data_ptr(), d.y.get(), g.data_ptr(), d.conv.get(),
        static_cast<cudnnConvolutionBwdDataAlgo_t>(a.algo), ptr_of(ws), a.workspace, s.beta(),
        d.x.get(), dx.data_ptr()));
  }
  if (need_dw) {
    const ConvAlgo a = backward_filter_algo(
        handle.get(), d, conv_key(ConvDirection::backward_filter, x, w, geo, groups, d.types));
    LS_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.get(), a.math));
    const Tensor ws = workspace(a.workspace, x.device());
    LS_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
        handle.get(), s.alpha(), d.x.get(), x.data_ptr(), d.y.get(), g.data_ptr(), d.conv.get(),
        static_cast<cudnnConvolutionBwdFilterAlgo_t>(a.algo), ptr_of(ws), a.workspace, s.beta(),
        d.w.get(), dw.data_ptr()));
  }
}

// ---- pooling ----

// The window of output (oh, ow) clipped to the input, as src/ops/cpu/pool.cpp's for_windows.
struct Window {
  int64_t h0, h1, w0, w1;
  __device__ Window(const ConvGeometry& g, int64_t oh, int64_t ow) {
    const int64_t hs = oh * g.stride_h - g.pad_h, ws = ow * g.stride_w - g.pad_w;
    h0 = hs > 0 ? hs : 0;
    h1 = hs + g.kernel_h < g.height ? hs + g.kernel_h : g.height;
    w0 = ws > 0 ? ws : 0;
    w1 = ws + g.kernel_w < g.width ? ws + g.kernel_w : g.width;
  }
};

// One thread per output: max (NaN wins, as PyTorch) with its flat position h * W + w, or the
// average over kernel_h * kernel_w taps (count_include_pad: padding counts as zeros).
template <typename T>
__global__ void pool_forward_kernel(int64_t total, ConvGeometry g, bool is_max, T scale, const T* x,
                                    T* out, int64_t* indices) {
  const int64_t plane_out = g.out_h * g.out_w, plane_in = g.height * g.width;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t p = e / plane_out, o = e % plane_out;
    const Window win(g, o / g.out_w, o % g.out_w);
    const T* xp = x + p * plane_in;
    if (is_max) {
      T best = -INFINITY;
      int64_t best_i = win.h0 * g.width + win.w0;
      for (int64_t h = win.h0; h < win.h1; ++h) {
        for (int64_t w = win.w0; w < win.w1; ++w) {
          const T v = xp[h * g.width + w];
          if (v > best || isnan(v)) {
            best = v;
            best_i = h * g.width + w;
          }
        }
      }
      out[e] = best;
      indices[e] = best_i;
    } else {
      T acc = 0;
      for (int64_t h = win.h0; h < win.h1; ++h)
        for (int64_t w = win.w0; w < win.w1; ++w) acc += xp[h * g.width + w];
      out[e] = acc * scale;
    }
  }
}

// The outputs whose windows hold input row h: [lo, hi] (empty when lo > hi).
__device__ inline void covering(int64_t h, int64_t kernel, int64_t stride, int64_t pad,
                                int64_t outs, int64_t* lo, int64_t* hi) {
  const int64_t first = h + pad - kernel + 1;  // the window start must be >= this
  *lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  const int64_t last = (h + pad) / stride;
  *hi = last < outs - 1 ? last : outs - 1;
}

// One thread per input element: the sum of the gradients of the outputs that took it, added in
// output order as the CPU kernel's scatter adds them, without atomics.
template <typename T>
__global__ void pool_backward_kernel(int64_t total, ConvGeometry g, bool is_max, T scale,
                                     const T* grad, const int64_t* indices, T* dx) {
  const int64_t plane_out = g.out_h * g.out_w, plane_in = g.height * g.width;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t p = e / plane_in, pos = e % plane_in;
    const int64_t h = pos / g.width, w = pos % g.width;
    int64_t oh0, oh1, ow0, ow1;
    covering(h, g.kernel_h, g.stride_h, g.pad_h, g.out_h, &oh0, &oh1);
    covering(w, g.kernel_w, g.stride_w, g.pad_w, g.out_w, &ow0, &ow1);
    const T* gp = grad + p * plane_out;
    T acc = 0;
    for (int64_t oh = oh0; oh <= oh1; ++oh) {
      for (int64_t ow = ow0; ow <= ow1; ++ow) {
        const int64_t o = oh * g.out_w + ow;
        if (is_max) {
          if (indices[p * plane_out + o] == pos) acc += gp[o];
        } else {
          acc += gp[o] * scale;
        }
      }
    }
    dx[e] = acc;
  }
}

// count_include_pad: every window counts kernel_h * kernel_w taps.
double inv_count(const ConvGeometry& g) {
  return 1.0 / static_cast<double>(g.kernel_h * g.kernel_w);
}

void pool2d_kernel(PoolKind kind, const Tensor& out, const Tensor& indices, const Tensor& x,
                   const ConvGeometry& geo) {
  const int64_t total = out.numel();
  if (total == 0) return;
  const bool is_max = kind == PoolKind::max;
  const char* op = is_max ? "max_pool2d" : "avg_pool2d";
  TensorDeviceGuard guard(x);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    pool_forward_kernel<T><<<grid_for(total), kBlock, 0, current_cuda_stream()>>>(
        total, geo, is_max, static_cast<T>(inv_count(geo)), data_of<T>(x), data_of<T>(out),
        is_max ? data_of<int64_t>(indices) : nullptr);
    check_launch(op, out);
  });
}

void pool2d_backward_kernel(PoolKind kind, const Tensor& dx, const Tensor& g, const Tensor& indices,
                            const ConvGeometry& geo) {
  const int64_t total = dx.numel();
  if (total == 0) return;
  const bool is_max = kind == PoolKind::max;
  const char* op = is_max ? "max_pool2d backward" : "avg_pool2d backward";
  TensorDeviceGuard guard(dx);
  dispatch_float(dx.dtype(), op, [&]<typename T>() {
    pool_backward_kernel<T><<<grid_for(total), kBlock, 0, current_cuda_stream()>>>(
        total, geo, is_max, static_cast<T>(inv_count(geo)), data_of<T>(g),
        is_max ? data_of<int64_t>(indices) : nullptr, data_of<T>(dx));
    check_launch(op, dx);
  });
}

}  // namespace

void fill_conv_kernels(Kernels& k) {
  k.conv2d = conv2d_kernel;
  k.conv2d_backward = conv2d_backward_kernel;
  k.pool2d = pool2d_kernel;
  k.pool2d_backward = pool2d_backward_kernel;
}

}  // namespace lockstep::cuda_ops
