// The CPU conv2d kernels: im2col + one GEMM per group (BLAS for f32/f64, oneDNN for bf16), and
// the backward (GEMMs + col2im).
#include <algorithm>

#include "ops/cpu/gemm.h"
#include "ops/cpu/im2col.h"
#include "ops/cpu/kernels.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

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
  ConvGeometry geo;
  int64_t in_per_group() const { return in_channels / groups; }
  int64_t out_per_group() const { return out_channels / groups; }
  // Rows of a group's column matrix: Cg * kh * kw.
  int64_t k_per_group() const { return in_per_group() * geo.kernel_h * geo.kernel_w; }
  int64_t in_plane() const { return geo.height * geo.width; }
};

// Calls f(i) for i in [0, n) in parallel, each i moving about `per_item` elements.
template <typename F>
void parallel_items(int64_t n, int64_t per_item, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kPlaneGrainElements / std::max<int64_t>(per_item, 1));
  parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
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

ConvShape conv_shape(const Tensor& x, const Tensor& w, const ConvGeometry& geo, int64_t groups) {
  ConvShape s;
  s.batch = x.size(0);
  s.in_channels = x.size(1);
  s.out_channels = w.size(0);
  s.groups = groups;
  s.geo = geo;
  // The widest product is a chunk's: its columns for the largest chunk (1-byte elements).
  const int64_t K = s.k_per_group(), NL = chunk_samples(s, 1) * geo.out_plane();
  LS_CHECK(K <= INT_MAX && NL <= INT_MAX && s.out_per_group() <= INT_MAX,
           "conv2d: matrix product of ", s.out_per_group(), "x", K, " by ", K, "x", NL,
           " exceeds the 32-bit sizes BLAS takes");
  return s;
}

// cols (C * kh * kw, nc * L) <- samples [n0, n0 + nc) of x (N, C, H, W).
template <typename T>
void im2col_chunk(const T* x, const ConvShape& s, int64_t n0, int64_t nc, T* cols) {
  const int64_t L = s.geo.out_plane(), ld = nc * L, taps = s.geo.kernel_h * s.geo.kernel_w;
  parallel_items(nc * s.in_channels, taps * L, [&](int64_t i) {
    const int64_t n = i / s.in_channels, c = i % s.in_channels;
    im2col_plane(x + ((n0 + n) * s.in_channels + c) * s.in_plane(), s.geo,
                 cols + c * taps * ld + n * L, ld);
  });
}

// dx (N, C, H, W) samples [n0, n0 + nc) += col2im(cols).
template <typename T>
void col2im_chunk(const T* cols, const ConvShape& s, int64_t n0, int64_t nc, T* dx) {
  const int64_t L = s.geo.out_plane(), ld = nc * L, taps = s.geo.kernel_h * s.geo.kernel_w;
  parallel_items(nc * s.in_channels, taps * L, [&](int64_t i) {
    const int64_t n = i / s.in_channels, c = i % s.in_channels;
    col2im_plane(cols + c * taps * ld + n * L, ld, s.geo,
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

// obuf (O, nc, L) -> out (nc, O, L) samples [n0, n0 + nc), adding the bias on the way.
template <typename Acc, typename T>
void columns_to_output(const Acc* obp, const Acc* bp, const ConvShape& s, int64_t n0, int64_t nc,
                       T* op) {
  const int64_t L = s.geo.out_plane(), O = s.out_channels, NL = nc * L;
  parallel_items(nc * O, L, [&](int64_t i) {
    const int64_t n = i / O, o = i % O;
    const Acc* from = obp + o * NL + n * L;
    T* to = op + ((n0 + n) * O + o) * L;
    const Acc bias = bp ? bp[o] : Acc(0);
    for (int64_t l = 0; l < L; ++l) to[l] = T(from[l] + bias);
  });
}

// db[o] = sum of g (N, O, L) over n and l, accumulated in double.
template <typename T, typename Out>
void bias_grad(const T* gp, const ConvShape& s, Out* dbp) {
  const int64_t L = s.geo.out_plane(), O = s.out_channels;
  parallel_items(O, s.batch * L, [&](int64_t o) {
    double acc = 0;
    for (int64_t n = 0; n < s.batch; ++n) {
      const T* p = gp + (n * O + o) * L;
      for (int64_t l = 0; l < L; ++l) acc += static_cast<double>(static_cast<Out>(p[l]));
    }
    dbp[o] = static_cast<Out>(acc);
  });
}

// Zeroes a tensor the backward accumulates into.
template <typename T>
void zero(T* p, int64_t n) {
  parallel_for(0, n, kElementwiseGrain,
               [&](int64_t b, int64_t e) { std::fill(p + b, p + e, T(0)); });
}

template <typename T>
void conv_forward(const Tensor& x, const Tensor& w, const Tensor& b, const ConvShape& s,
                  const Tensor& out) {
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(w.data_ptr());
  const T* bp = b.defined() ? static_cast<const T*>(b.data_ptr()) : nullptr;
  T* op = static_cast<T*>(out.data_ptr());
  const int64_t L = s.geo.out_plane(), K = s.k_per_group(), Og = s.out_per_group();
  const int64_t chunk = chunk_samples(s, sizeof(T));
  Tensor cols = empty({s.groups * K, chunk * L}, dtype_of<T>::value);
  Tensor obuf = empty({s.out_channels, chunk * L}, dtype_of<T>::value);
  T* cp = static_cast<T*>(cols.data_ptr());
  T* obp = static_cast<T*>(obuf.data_ptr());
  for (int64_t n0 = 0; n0 < s.batch; n0 += chunk) {
    const int64_t nc = std::min(chunk, s.batch - n0), NL = nc * L;
    im2col_chunk(xp, s, n0, nc, cp);
    // (Og, K) @ (K, nc * L) per group -> obuf (O, nc * L); see Note [Conv threading].
    for (int64_t g = 0; g < s.groups; ++g)
      gemm<T>(false, false, Og, NL, K, wp + g * Og * K, K, cp + g * K * NL, NL, T(0),
              obp + g * Og * NL, NL);
    columns_to_output(obp, bp, s, n0, nc, op);
  }
}

// Writes each defined gradient (dx, dw, db).
template <typename T>
void conv_backward(const Tensor& gout, const Tensor& x, const Tensor& w, const ConvShape& s,
                   const Tensor& dx, const Tensor& dw, const Tensor& db) {
  const T* gp = static_cast<const T*>(gout.data_ptr());
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(w.data_ptr());
  const int64_t L = s.geo.out_plane(), K = s.k_per_group(), Og = s.out_per_group();
  const DType dt = dtype_of<T>::value;
  if (dx.defined()) zero(static_cast<T*>(dx.data_ptr()), dx.numel());
  if (dw.defined()) zero(static_cast<T*>(dw.data_ptr()), dw.numel());
  if (dx.defined() || dw.defined()) {
    const int64_t chunk = chunk_samples(s, sizeof(T));
    Tensor cols = empty({s.groups * K, chunk * L}, dt);
    Tensor gbuf = empty({s.out_channels, chunk * L}, dt);
    T* cp = static_cast<T*>(cols.data_ptr());
    T* gbp = static_cast<T*>(gbuf.data_ptr());
    for (int64_t n0 = 0; n0 < s.batch; n0 += chunk) {
      const int64_t nc = std::min(chunk, s.batch - n0), NL = nc * L;
      gout_to_columns(gp, s, n0, nc, gbp);
      if (dw.defined()) {
        // dW_g (Og, K) += gout_g (Og, nc * L) @ cols_g^T (nc * L, K)
        im2col_chunk(xp, s, n0, nc, cp);
        T* dwp = static_cast<T*>(dw.data_ptr());
        for (int64_t g = 0; g < s.groups; ++g)
          gemm<T>(false, true, Og, K, NL, gbp + g * Og * NL, NL, cp + g * K * NL, NL, T(1),
                  dwp + g * Og * K, K);
      }
      if (dx.defined()) {
        // dcols_g (K, nc * L) = W_g^T (K, Og) @ gout_g (Og, nc * L), then back onto the input.
        for (int64_t g = 0; g < s.groups; ++g)
          gemm<T>(true, false, K, NL, Og, wp + g * Og * K, K, gbp + g * Og * NL, NL, T(0),
                  cp + g * K * NL, NL);
        col2im_chunk(cp, s, n0, nc, static_cast<T*>(dx.data_ptr()));
      }
    }
  }
  if (db.defined()) bias_grad(gp, s, static_cast<T*>(db.data_ptr()));
}

// Note [bf16 conv]
// Under autocast a bf16 conv keeps its column matrix in bf16 and runs its products through
// oneDNN (Note [bf16 GEMM] in src/ops/cpu/bf16_gemm.cpp), accumulating in f32: the forward
// output, the weight gradient (summed over batch chunks) and the column gradient (folded back
// onto the input by col2im) stay f32 until the single rounding to bf16 at the end. When oneDNN
// is unavailable or declines a shape, the conv is computed in f32 from converted operands
// (f16 always is).

// The bf16 forward; false when oneDNN declined (out is then partly written).
bool conv_forward_bf16(const Tensor& x, const Tensor& w, const Tensor& b, const ConvShape& s,
                       const Tensor& out) {
  if (!bf16_gemm_available()) return false;
  const auto* xp = static_cast<const BFloat16*>(x.data_ptr());
  const auto* wp = static_cast<const BFloat16*>(w.data_ptr());
  const Tensor b32 = b.defined() ? b.to(kFloat32).contiguous() : Tensor();
  const float* bp = b.defined() ? b32.data<float>() : nullptr;
  auto* op = static_cast<BFloat16*>(out.data_ptr());
  const int64_t L = s.geo.out_plane(), K = s.k_per_group(), Og = s.out_per_group();
  const int64_t chunk = chunk_samples(s, sizeof(BFloat16));
  Tensor cols = empty({s.groups * K, chunk * L}, kBFloat16);
  Tensor obuf = empty({s.out_channels, chunk * L}, kFloat32);
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
    columns_to_output(obp, bp, s, n0, nc, op);
  }
  return true;
}

// The bf16 backward; false when oneDNN declined (the gradients are then partly written).
bool conv_backward_bf16(const Tensor& gout, const Tensor& x, const Tensor& w, const ConvShape& s,
                        const Tensor& dx, const Tensor& dw, const Tensor& db) {
  if (!bf16_gemm_available()) return false;
  const auto* gp = static_cast<const BFloat16*>(gout.data_ptr());
  const auto* xp = static_cast<const BFloat16*>(x.data_ptr());
  const auto* wp = static_cast<const BFloat16*>(w.data_ptr());
  const int64_t L = s.geo.out_plane(), K = s.k_per_group(), Og = s.out_per_group();
  Tensor dx32 = dx.defined() ? zeros(x.shape(), kFloat32) : Tensor();
  Tensor dw32 = dw.defined() ? zeros(w.shape(), kFloat32) : Tensor();
  if (dx.defined() || dw.defined()) {
    const int64_t chunk = chunk_samples(s, sizeof(float));
    Tensor cols = empty({s.groups * K, chunk * L}, kBFloat16);
    Tensor dcols = dx.defined() ? empty({s.groups * K, chunk * L}, kFloat32) : Tensor();
    Tensor gbuf = empty({s.out_channels, chunk * L}, kBFloat16);
    auto* cp = static_cast<BFloat16*>(cols.data_ptr());
    auto* gbp = static_cast<BFloat16*>(gbuf.data_ptr());
    for (int64_t n0 = 0; n0 < s.batch; n0 += chunk) {
      const int64_t nc = std::min(chunk, s.batch - n0), NL = nc * L;
      gout_to_columns(gp, s, n0, nc, gbp);
      if (dw.defined()) {
        // dW_g (Og, K) += gout_g (Og, nc * L) @ cols_g^T (nc * L, K), in f32.
        im2col_chunk(xp, s, n0, nc, cp);
        float* dwp = dw32.data<float>();
        for (int64_t g = 0; g < s.groups; ++g) {
          if (!gemm_bf16(false, true, Og, K, NL, gbp + g * Og * NL, NL, cp + g * K * NL, NL, true,
                         dwp + g * Og * K, K)) {
            return false;
          }
        }
      }
      if (dx.defined()) {
        // dcols_g (K, nc * L) = W_g^T (K, Og) @ gout_g (Og, nc * L), folded back in f32.
        float* dcp = dcols.data<float>();
        for (int64_t g = 0; g < s.groups; ++g) {
          if (!gemm_bf16(true, false, K, NL, Og, wp + g * Og * K, K, gbp + g * Og * NL, NL, false,
                         dcp + g * K * NL, NL)) {
            return false;
          }
        }
        col2im_chunk(dcp, s, n0, nc, dx32.data<float>());
      }
    }
  }
  if (db.defined()) {
    Tensor db32 = empty({s.out_channels}, kFloat32);
    bias_grad(gp, s, db32.data<float>());
    copy_kernel(db, db32);
  }
  if (dx.defined()) copy_kernel(dx, dx32);
  if (dw.defined()) copy_kernel(dw, dw32);
  return true;
}

// A 16-bit tensor (or undefined) as f32.
Tensor as_f32(const Tensor& t) { return t.defined() ? t.to(kFloat32) : t; }

}  // namespace

void conv2d_kernel(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& bias,
                   const ConvGeometry& geo, int64_t groups) {
  const ConvShape s = conv_shape(x, w, geo, groups);
  switch (x.dtype()) {
    case DType::f32:
      return conv_forward<float>(x, w, bias, s, out);
    case DType::f64:
      return conv_forward<double>(x, w, bias, s, out);
    case DType::bf16:
      if (conv_forward_bf16(x, w, bias, s, out)) return;
      [[fallthrough]];
    case DType::f16: {
      Tensor out32 = empty(out.shape(), kFloat32);
      conv_forward<float>(x.to(kFloat32), w.to(kFloat32), as_f32(bias), s, out32);
      return copy_kernel(out, out32);
    }
    default:
      LS_THROW("conv2d: dtype ", dtype_name(x.dtype()), " is not supported");
  }
}

void conv2d_backward_kernel(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& g,
                            const Tensor& x, const Tensor& w, const ConvGeometry& geo,
                            int64_t groups) {
  const ConvShape s = conv_shape(x, w, geo, groups);
  switch (x.dtype()) {
    case DType::f32:
      return conv_backward<float>(g, x, w, s, dx, dw, db);
    case DType::f64:
      return conv_backward<double>(g, x, w, s, dx, dw, db);
    case DType::bf16:
      if (conv_backward_bf16(g, x, w, s, dx, dw, db)) return;
      [[fallthrough]];
    case DType::f16: {
      // f32 gradients from converted operands, rounded once into the 16-bit ones.
      const auto f32_like = [](const Tensor& t) {
        return t.defined() ? empty(t.shape(), kFloat32) : Tensor();
      };
      const Tensor dx32 = f32_like(dx), dw32 = f32_like(dw), db32 = f32_like(db);
      conv_backward<float>(g.to(kFloat32), x.to(kFloat32), w.to(kFloat32), s, dx32, dw32, db32);
      if (dx.defined()) copy_kernel(dx, dx32);
      if (dw.defined()) copy_kernel(dw, dw32);
      if (db.defined()) copy_kernel(db, db32);
      return;
    }
    default:
      LS_THROW("conv2d: dtype ", dtype_name(x.dtype()), " is not supported");
  }
}

}  // namespace lockstep::cpu
