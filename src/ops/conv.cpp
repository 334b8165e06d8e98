// conv2d: im2col + one GEMM per group through OpenBLAS, and its backward (GEMMs + col2im).
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <type_traits>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/cpu/bf16_gemm.h"
#include "ops/cpu/im2col.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep {

using autograd::TensorList;

namespace {

// Note [Conv threading]
// OpenMP and OpenBLAS threads must not multiply. A GEMM per sample inside an OpenMP loop either
// starts BLAS's own threads from every OpenMP thread (OpenBLAS's pthreads build: threads x
// threads) or runs single-threaded there (its OpenMP build), where one small product per thread
// uses the cores worse than one wide product does. So the work is split by kind: a batch chunk
// is laid out as one column matrix (K, n * Ho * Wo); im2col, col2im and the layout copies
// (memory-bound, independent per sample and channel) run in OpenMP loops; and each group's
// product is a single large GEMM issued from the calling thread, outside any parallel region,
// where BLAS spreads a matrix wide enough to keep every thread busy (see Note [OpenMP BLAS] in
// CMakeLists.txt for why BLAS should share OpenMP's team).
//
// The column matrix of a whole batch can be large (C * kh * kw * N * Ho * Wo elements), so the
// batch is processed in chunks whose columns fit in this budget.
constexpr int64_t kColumnBudgetBytes = int64_t{64} << 20;
// (sample, channel) planes per thread chunk in the im2col / copy loops.
constexpr int64_t kPlaneGrainElements = 16384;

struct ConvShape {
  int64_t batch = 0, in_channels = 0, out_channels = 0, groups = 1;
  cpu::ConvGeometry geo;
  int64_t in_per_group() const { return in_channels / groups; }
  int64_t out_per_group() const { return out_channels / groups; }
  // Rows of a group's column matrix: Cg * kh * kw.
  int64_t k_per_group() const { return in_per_group() * geo.kernel_h * geo.kernel_w; }
  int64_t in_plane() const { return geo.height * geo.width; }
};

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  LS_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX &&
               ldc <= INT_MAX,
           "conv2d: matrix product of ", m, "x", k, " by ", k, "x", n,
           " exceeds the 32-bit sizes BLAS takes");
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, 1.0, a, lda, b, ldb, beta, c, ldc);
  }
}

// Calls f(i) for i in [0, n) in parallel, each i moving about `per_item` elements.
template <typename F>
void parallel_items(int64_t n, int64_t per_item, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kPlaneGrainElements / std::max<int64_t>(per_item, 1));
  cpu::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) f(i);
  });
}

// Samples per chunk so that the chunk's column matrix stays within kColumnBudgetBytes.
int64_t chunk_samples(const ConvShape& s, int64_t element_size) {
  const int64_t per_sample =
      s.in_channels * s.geo.kernel_h * s.geo.kernel_w * s.geo.out_plane() * element_size;
  return std::clamp<int64_t>(kColumnBudgetBytes / std::max<int64_t>(per_sample, 1), 1,
                             std::max<int64_t>(s.batch, 1));
}

// cols (C * kh * kw, nc * L) <- samples [n0, n0 + nc) of x (N, C, H, W).
template <typename T>
void im2col_chunk(const T* x, const ConvShape& s, int64_t n0, int64_t nc, T* cols) {
  const int64_t L = s.geo.out_plane(), ld = nc * L, taps = s.geo.kernel_h * s.geo.kernel_w;
  parallel_items(nc * s.in_channels, taps * L, [&](int64_t i) {
    const int64_t n = i / s.in_channels, c = i % s.in_channels;
    cpu::im2col_plane(x + ((n0 + n) * s.in_channels + c) * s.in_plane(), s.geo,
                      cols + c * taps * ld + n * L, ld);
  });
}

// dx (N, C, H, W) samples [n0, n0 + nc) += col2im(cols).
template <typename T>
void col2im_chunk(const T* cols, const ConvShape& s, int64_t n0, int64_t nc, T* dx) {
  const int64_t L = s.geo.out_plane(), ld = nc * L, taps = s.geo.kernel_h * s.geo.kernel_w;
  parallel_items(nc * s.in_channels, taps * L, [&](int64_t i) {
    const int64_t n = i / s.in_channels, c = i % s.in_channels;
    cpu::col2im_plane(cols + c * taps * ld + n * L, ld, s.geo,
                      dx + ((n0 + n) * s.in_channels + c) * s.in_plane());
  });
}

// gout (N, O, L) samples [n0, n0 + nc) -> gbuf (O, nc * L), the layout of the forward's
// products.
template <typename T>
void gout_to_columns(const T* gp, const ConvShape& s, int64_t n0, int64_t nc, T* gbp) {
  const int64_t L = s.geo.out_plane(), O = s.out_channels, NL = nc * L;
  parallel_items(nc * O, L, [&](int64_t i) {
    const int64_t n = i / O, o = i % O;
    std::copy_n(gp + ((n0 + n) * O + o) * L, L, gbp + o * NL + n * L);
  });
}

template <typename T>
void conv_forward(const Tensor& x, const Tensor& w, const Tensor& b, const ConvShape& s,
                  Tensor& out) {
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(w.data_ptr());
  const T* bp = b.defined() ? static_cast<const T*>(b.data_ptr()) : nullptr;
  T* op = static_cast<T*>(out.data_ptr());
  const int64_t L = s.geo.out_plane(), K = s.k_per_group(), Og = s.out_per_group();
  const int64_t O = s.out_channels;
  const int64_t chunk = chunk_samples(s, sizeof(T));
  Tensor cols = empty({s.groups * K, chunk * L}, dtype_of<T>::value);
  Tensor obuf = empty({O, chunk * L}, dtype_of<T>::value);
  T* cp = static_cast<T*>(cols.data_ptr());
  T* obp = static_cast<T*>(obuf.data_ptr());
  for (int64_t n0 = 0; n0 < s.batch; n0 += chunk) {
    const int64_t nc = std::min(chunk, s.batch - n0), NL = nc * L;
    im2col_chunk(xp, s, n0, nc, cp);
    // (Og, K) @ (K, nc * L) per group -> obuf (O, nc * L); see Note [Conv threading].
    for (int64_t g = 0; g < s.groups; ++g)
      gemm<T>(false, false, Og, NL, K, wp + g * Og * K, K, cp + g * K * NL, NL, T(0),
              obp + g * Og * NL, NL);
    // obuf (O, nc, L) -> out (nc, O, L), adding the bias on the way.
    parallel_items(nc * O, L, [&](int64_t i) {
      const int64_t n = i / O, o = i % O;
      const T* from = obp + o * NL + n * L;
      T* to = op + ((n0 + n) * O + o) * L;
      const T bias = bp ? bp[o] : T(0);
      for (int64_t l = 0; l < L; ++l) to[l] = from[l] + bias;
    });
  }
}

// Gradients of conv2d for the inputs asked for (undefined Tensor where not).
template <typename T>
TensorList conv_backward(const Tensor& gout, const Tensor& x, const Tensor& w, const ConvShape& s,
                         bool need_x, bool need_w, bool need_b) {
  const T* gp = static_cast<const T*>(gout.data_ptr());
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(w.data_ptr());
  const int64_t L = s.geo.out_plane(), K = s.k_per_group(), Og = s.out_per_group();
  const int64_t O = s.out_channels;
  const DType dt = dtype_of<T>::value;
  Tensor dx = need_x ? zeros(x.shape(), dt) : Tensor();
  Tensor dw = need_w ? zeros(w.shape(), dt) : Tensor();
  Tensor db = need_b ? empty({O}, dt) : Tensor();

  if (need_x || need_w) {
    const int64_t chunk = chunk_samples(s, sizeof(T));
    Tensor cols = empty({s.groups * K, chunk * L}, dt);
    Tensor gbuf = empty({O, chunk * L}, dt);
    T* cp = static_cast<T*>(cols.data_ptr());
    T* gbp = static_cast<T*>(gbuf.data_ptr());
    for (int64_t n0 = 0; n0 < s.batch; n0 += chunk) {
      const int64_t nc = std::min(chunk, s.batch - n0), NL = nc * L;
      gout_to_columns(gp, s, n0, nc, gbp);
      if (need_w) {
        // dW_g (Og, K) += gout_g (Og, nc * L) @ cols_g^T (nc * L, K)
        im2col_chunk(xp, s, n0, nc, cp);
        T* dwp = static_cast<T*>(dw.data_ptr());
        for (int64_t g = 0; g < s.groups; ++g)
          gemm<T>(false, true, Og, K, NL, gbp + g * Og * NL, NL, cp + g * K * NL, NL, T(1),
                  dwp + g * Og * K, K);
      }
      if (need_x) {
        // dcols_g (K, nc * L) = W_g^T (K, Og) @ gout_g (Og, nc * L), then back onto the input.
        for (int64_t g = 0; g < s.groups; ++g)
          gemm<T>(true, false, K, NL, Og, wp + g * Og * K, K, gbp + g * Og * NL, NL, T(0),
                  cp + g * K * NL, NL);
        col2im_chunk(cp, s, n0, nc, static_cast<T*>(dx.data_ptr()));
      }
    }
  }
  if (need_b) {
    T* dbp = static_cast<T*>(db.data_ptr());
    parallel_items(O, s.batch * L, [&](int64_t o) {
      double acc = 0;
      for (int64_t n = 0; n < s.batch; ++n) {
        const T* p = gp + (n * O + o) * L;
        for (int64_t l = 0; l < L; ++l) acc += static_cast<double>(p[l]);
      }
      dbp[o] = static_cast<T>(acc);
    });
  }
  return {dx, dw, db};
}

// Note [bf16 conv]
// Under autocast a bf16 conv keeps its column matrix in bf16 and runs its products through
// oneDNN (Note [bf16 GEMM] in src/ops/cpu/bf16_gemm.cpp), accumulating in f32: the forward
// output, the weight gradient (summed over batch chunks) and the column gradient (folded back
// onto the input by col2im) stay f32 until the single rounding to bf16 at the end. When oneDNN
// is unavailable or declines a shape, the conv is computed in f32 from converted operands.

// c (m x n, f32, ldc) (+)= op(a) @ op(b) with bf16 a and b; false when oneDNN declines.
bool gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const BFloat16* a,
               int64_t lda, const BFloat16* b, int64_t ldb, bool accumulate, float* c,
               int64_t ldc) {
  cpu::Bf16Matrix ma, mb;
  ma.data = reinterpret_cast<const uint16_t*>(a);
  ma.rs = trans_a ? 1 : lda;
  ma.cs = trans_a ? lda : 1;
  mb.data = reinterpret_cast<const uint16_t*>(b);
  mb.rs = trans_b ? 1 : ldb;
  mb.cs = trans_b ? ldb : 1;
  return cpu::bf16_gemm(m, n, k, ma, mb, c, ldc, accumulate);
}

// The bf16 forward (Note [bf16 conv]); false when oneDNN declined (out is then undefined).
bool conv_forward_bf16(const Tensor& x, const Tensor& w, const Tensor& b, const ConvShape& s,
                       Tensor& out) {
  const auto* xp = static_cast<const BFloat16*>(x.data_ptr());
  const auto* wp = static_cast<const BFloat16*>(w.data_ptr());
  const Tensor b32 = b.defined() ? b.to(kFloat32).contiguous() : Tensor();
  const float* bp = b.defined() ? b32.data<float>() : nullptr;
  auto* op = static_cast<BFloat16*>(out.data_ptr());
  const int64_t L = s.geo.out_plane(), K = s.k_per_group(), Og = s.out_per_group();
  const int64_t O = s.out_channels;
  const int64_t chunk = chunk_samples(s, sizeof(BFloat16));
  Tensor cols = empty({s.groups * K, chunk * L}, kBFloat16);
  Tensor obuf = empty({O, chunk * L}, kFloat32);
  auto* cp = static_cast<BFloat16*>(cols.data_ptr());
  float* obp = obuf.data<float>();
  for (int64_t n0 = 0; n0 < s.batch; n0 += chunk) {
    const int64_t nc = std::min(chunk, s.batch - n0), NL = nc * L;
    im2col_chunk(xp, s, n0, nc, cp);
    for (int64_t g = 0; g < s.groups; ++g) {
      if (!gemm_bf16(false, false, Og, NL, K, wp + g * Og * K, K, cp + g * K * NL, NL, false,
                     obp + g * Og * NL, NL)) {
        return false;
      }
    }
    parallel_items(nc * O, L, [&](int64_t i) {
      const int64_t n = i / O, o = i % O;
      const float* from = obp + o * NL + n * L;
      BFloat16* to = op + ((n0 + n) * O + o) * L;
      const float bias = bp ? bp[o] : 0.0f;
      for (int64_t l = 0; l < L; ++l) to[l] = BFloat16(from[l] + bias);
    });
  }
  return true;
}

// The bf16 backward (Note [bf16 conv]); empty when oneDNN declined.
std::optional<TensorList> conv_backward_bf16(const Tensor& gout, const Tensor& x, const Tensor& w,
                                             const ConvShape& s, bool need_x, bool need_w,
                                             bool need_b) {
  const auto* gp = static_cast<const BFloat16*>(gout.data_ptr());
  const auto* xp = static_cast<const BFloat16*>(x.data_ptr());
  const auto* wp = static_cast<const BFloat16*>(w.data_ptr());
  const int64_t L = s.geo.out_plane(), K = s.k_per_group(), Og = s.out_per_group();
  const int64_t O = s.out_channels;
  Tensor dx32 = need_x ? zeros(x.shape(), kFloat32) : Tensor();
  Tensor dw32 = need_w ? zeros(w.shape(), kFloat32) : Tensor();
  if (need_x || need_w) {
    const int64_t chunk = chunk_samples(s, sizeof(float));
    Tensor cols = empty({s.groups * K, chunk * L}, kBFloat16);
    Tensor dcols = need_x ? empty({s.groups * K, chunk * L}, kFloat32) : Tensor();
    Tensor gbuf = empty({O, chunk * L}, kBFloat16);
    auto* cp = static_cast<BFloat16*>(cols.data_ptr());
    auto* gbp = static_cast<BFloat16*>(gbuf.data_ptr());
    for (int64_t n0 = 0; n0 < s.batch; n0 += chunk) {
      const int64_t nc = std::min(chunk, s.batch - n0), NL = nc * L;
      gout_to_columns(gp, s, n0, nc, gbp);
      if (need_w) {
        // dW_g (Og, K) += gout_g (Og, nc * L) @ cols_g^T (nc * L, K), in f32.
        im2col_chunk(xp, s, n0, nc, cp);
        float* dwp = dw32.data<float>();
        for (int64_t g = 0; g < s.groups; ++g) {
          if (!gemm_bf16(false, true, Og, K, NL, gbp + g * Og * NL, NL, cp + g * K * NL, NL, true,
                         dwp + g * Og * K, K)) {
            return std::nullopt;
          }
        }
      }
      if (need_x) {
        // dcols_g (K, nc * L) = W_g^T (K, Og) @ gout_g (Og, nc * L), folded back in f32.
        float* dcp = dcols.data<float>();
        for (int64_t g = 0; g < s.groups; ++g) {
          if (!gemm_bf16(true, false, K, NL, Og, wp + g * Og * K, K, gbp + g * Og * NL, NL, false,
                         dcp + g * K * NL, NL)) {
            return std::nullopt;
          }
        }
        col2im_chunk(dcp, s, n0, nc, dx32.data<float>());
      }
    }
  }
  Tensor db;
  if (need_b) {
    Tensor db32 = empty({O}, kFloat32);
    float* dbp = db32.data<float>();
    parallel_items(O, s.batch * L, [&](int64_t o) {
      double acc = 0;
      for (int64_t n = 0; n < s.batch; ++n) {
        const BFloat16* p = gp + (n * O + o) * L;
        for (int64_t l = 0; l < L; ++l) acc += static_cast<double>(static_cast<float>(p[l]));
      }
      dbp[o] = static_cast<float>(acc);
    });
    db = db32.to(kBFloat16);
  }
  return TensorList{need_x ? dx32.to(kBFloat16) : Tensor(), need_w ? dw32.to(kBFloat16) : Tensor(),
                    db};
}

ConvShape check_conv_args(const Tensor& x, const Tensor& w, const Tensor& b,
                          const Conv2dOptions& o) {
  const char* op = "conv2d";
  detail::check_cpu(x, op);
  detail::check_cpu(w, op);
  LS_CHECK(x.dim() == 4, "conv2d: expected input of shape (N, C, H, W), got ", x.shape().str());
  LS_CHECK(w.dim() == 4, "conv2d: expected weight of shape (O, C/groups, kh, kw), got ",
           w.shape().str());
  LS_CHECK(is_floating(x.dtype()), "conv2d: expected a floating-point input, got ",
           dtype_name(x.dtype()));
  LS_CHECK(w.dtype() == x.dtype(), "conv2d: input is ", dtype_name(x.dtype()), " but weight is ",
           dtype_name(w.dtype()), "; convert one with .to()");
  LS_CHECK(o.stride_h >= 1 && o.stride_w >= 1, "conv2d: stride must be positive, got (", o.stride_h,
           ", ", o.stride_w, ")");
  LS_CHECK(o.dilation_h >= 1 && o.dilation_w >= 1, "conv2d: dilation must be positive, got (",
           o.dilation_h, ", ", o.dilation_w, ")");
  LS_CHECK(o.pad_h >= 0 && o.pad_w >= 0, "conv2d: padding must be non-negative, got (", o.pad_h,
           ", ", o.pad_w, ")");
  LS_CHECK(o.groups >= 1, "conv2d: groups must be positive, got ", o.groups);
  ConvShape s;
  s.batch = x.shape()[0];
  s.in_channels = x.shape()[1];
  s.out_channels = w.shape()[0];
  s.groups = o.groups;
  LS_CHECK(s.in_channels % o.groups == 0, "conv2d: groups ", o.groups,
           " does not divide the input's ", s.in_channels, " channels (input ", x.shape().str(),
           ")");
  LS_CHECK(s.out_channels % o.groups == 0, "conv2d: groups ", o.groups,
           " does not divide the weight's ", s.out_channels, " output channels (weight ",
           w.shape().str(), ")");
  if (o.groups == 1) {
    LS_CHECK(w.shape()[1] == s.in_channels, "conv2d: input has ", s.in_channels,
             " channels but weight expects ", w.shape()[1], " (input ", x.shape().str(),
             ", weight ", w.shape().str(), ")");
  } else {
    LS_CHECK(w.shape()[1] * o.groups == s.in_channels, "conv2d: input has ", s.in_channels,
             " channels but weight expects ", w.shape()[1] * o.groups, " (", w.shape()[1],
             " per group x ", o.groups, " groups; input ", x.shape().str(), ", weight ",
             w.shape().str(), ")");
  }
  if (b.defined()) {
    detail::check_cpu(b, op);
    LS_CHECK(b.dim() == 1 && b.shape()[0] == s.out_channels, "conv2d: bias of shape ",
             b.shape().str(), " does not match the weight's ", s.out_channels,
             " output channels (weight ", w.shape().str(), "); expected [", s.out_channels, "]");
    LS_CHECK(b.dtype() == x.dtype(), "conv2d: input is ", dtype_name(x.dtype()), " but bias is ",
             dtype_name(b.dtype()));
  }
  cpu::ConvGeometry& g = s.geo;
  g.height = x.shape()[2];
  g.width = x.shape()[3];
  g.kernel_h = w.shape()[2];
  g.kernel_w = w.shape()[3];
  g.stride_h = o.stride_h, g.stride_w = o.stride_w;
  g.pad_h = o.pad_h, g.pad_w = o.pad_w;
  g.dilation_h = o.dilation_h, g.dilation_w = o.dilation_w;
  const int64_t span_h = o.dilation_h * (g.kernel_h - 1) + 1;
  const int64_t span_w = o.dilation_w * (g.kernel_w - 1) + 1;
  LS_CHECK(g.kernel_h >= 1 && g.kernel_w >= 1 && span_h <= g.height + 2 * o.pad_h &&
               span_w <= g.width + 2 * o.pad_w,
           "conv2d: input of size ", g.height, "x", g.width, " (", g.height + 2 * o.pad_h, "x",
           g.width + 2 * o.pad_w, " with padding) is smaller than the kernel ", g.kernel_h, "x",
           g.kernel_w, " (", span_h, "x", span_w, " with dilation); input ", x.shape().str(),
           ", weight ", w.shape().str());
  g.out_h = (g.height + 2 * o.pad_h - span_h) / o.stride_h + 1;
  g.out_w = (g.width + 2 * o.pad_w - span_w) / o.stride_w + 1;
  return s;
}

}  // namespace

namespace {

// conv2d of bf16 tensors through oneDNN products (Note [bf16 conv]), with its backward;
// undefined when oneDNN declines the shapes.
Tensor conv2d_bf16(const Tensor& x, const Tensor& weight, const Tensor& bias, const ConvShape& s) {
  const Tensor xc = x.detach().contiguous();
  const Tensor wc = weight.detach().contiguous();
  const Tensor bc = bias.defined() ? bias.detach().contiguous() : Tensor();
  Tensor out = empty({s.batch, s.out_channels, s.geo.out_h, s.geo.out_w}, kBFloat16);
  if (out.numel() == 0 || !conv_forward_bf16(xc, wc, bc, s, out)) return Tensor();
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  const bool need_b = bias.defined() && bias.requires_grad();
  autograd::record("Conv2dBackward", {x, weight, bias}, out,
                   [xc, wc, s, need_x, need_w, need_b](const TensorList& g) {
                     const Tensor gc = g[0].to(kBFloat16).contiguous();
                     if (auto r = conv_backward_bf16(gc, xc, wc, s, need_x, need_w, need_b)) {
                       return *r;
                     }
                     // oneDNN declined a backward product: f32 from converted operands.
                     TensorList r32 =
                         conv_backward<float>(gc.to(kFloat32), xc.to(kFloat32), wc.to(kFloat32), s,
                                              need_x, need_w, need_b);
                     for (auto& t : r32) {
                       if (t.defined()) t = t.to(kBFloat16);
                     }
                     return r32;
                   });
  return out;
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
              const Conv2dOptions& opts) {
  LS_AUTOCAST("conv2d", conv2d, x, weight, bias, opts);
  const ConvShape s = check_conv_args(x, weight, bias, opts);
  if (x.dtype() == kBFloat16 && cpu::bf16_gemm_available()) {
    Tensor y = conv2d_bf16(x, weight, bias, s);
    if (y.defined()) return y;
  }
  if (is_half(x.dtype())) {
    // 16-bit floats are computed in f32; autograd flows through the conversions.
    Tensor b32 = bias.defined() ? bias.to(kFloat32) : Tensor();
    return conv2d(x.to(kFloat32), weight.to(kFloat32), b32, opts).to(x.dtype());
  }
  const Tensor xc = x.detach().contiguous();
  const Tensor wc = weight.detach().contiguous();
  const Tensor bc = bias.defined() ? bias.detach().contiguous() : Tensor();
  Tensor out = empty({s.batch, s.out_channels, s.geo.out_h, s.geo.out_w}, x.dtype());
  if (out.numel() > 0) {
    cpu::dispatch_float(x.dtype(), "conv2d",
                        [&]<typename T>() { conv_forward<T>(xc, wc, bc, s, out); });
  }
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  const bool need_b = bias.defined() && bias.requires_grad();
  autograd::record("Conv2dBackward", {x, weight, bias}, out,
                   [xc, wc, s, need_x, need_w, need_b](const TensorList& g) {
                     const DType dt = xc.dtype();
                     const Tensor gc = (g[0].dtype() == dt ? g[0] : g[0].to(dt)).contiguous();
                     return cpu::dispatch_float(dt, "conv2d backward", [&]<typename T>() {
                       return conv_backward<T>(gc, xc, wc, s, need_x, need_w, need_b);
                     });
                   });
  return out;
}

}  // namespace lockstep
