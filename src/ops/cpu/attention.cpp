// CPU kernels of scaled_dot_product_attention: the tiled forward with an online softmax and the
// backward that recomputes each tile's probabilities from the saved log-sum-exp (Note [Fused
// attention] in src/ops/attention.cpp). Tile products go to BLAS; one head per OpenMP thread.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "lockstep/tensor/parallel.h"
#include "ops/cpu/attention_avx2.h"
#include "ops/cpu/gemm.h"
#include "ops/cpu/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

namespace {

// Query rows and key columns of one tile of scores: the only (T, T)-like buffer a head holds,
// 16 KiB in f32, so that it and the q, k, v rows it multiplies stay in L1/L2. Measured at
// (B, H, T, D) = (8, 4, 128, 32) on the 2-core VM: 64 x 64 ran the forward fastest; 128 x 64,
// 128 x 128 and 32 x 64 were 5-40% slower (docs/PERFORMANCE.md). Nothing else assumes
// the two are equal.
constexpr int64_t kRows = 64, kCols = 64;

// Note [Vectorized exp]
// The softmax of a tile costs one exp per score next to 4 * D multiply-adds of its two products,
// so at D = 32 a libm call per element costs more than the GEMMs (it did: 60% of the forward's
// time). exp_f32 is the classic range reduction (x = n ln2 + r, |r| <= ln2 / 2) with a degree-5
// polynomial for e^r and 2^n built in the exponent bits; within 1 ulp of exp for x in [-87, 88]
// (checked against the f64 exp by the attention tests' tolerances). Nothing in it branches, so
// the loops over it vectorize: GCC leaves a loop scalar for a float compare (`x < -87 ? ..`,
// std::max), so the clamp of x at -87 is an unsigned min on its bits, which orders negative
// floats by magnitude and leaves every non-negative one alone. Below -87 (and for -inf) it gives
// exp(-87) ~ 1.6e-38 instead of a denormal or 0: next to the 1 a row's largest score
// contributes, far below f32's resolution. f64 (the gradient checks) uses std::exp.
inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;       // 1.5 * 2^23: adding it rounds to an integer
  constexpr uint32_t kMinus87 = 0xC2AE0000u;  // the bits of -87.0f
  x = std::bit_cast<float>(std::min(std::bit_cast<uint32_t>(x), kMinus87));
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.0f;
  return er * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// Note [Attention row kernels]
// The library is built for baseline x86-64 (SSE2), where the exp above runs 4 lanes wide and
// still cost a third of the forward. The two row loops of the softmax are therefore compiled
// twice, for baseline and for x86-64-v3 (AVX2 + FMA: 8 lanes, fused multiply-adds), and the
// loader picks the clone the CPU runs (GCC's target_clones, an ifunc); the rest of the library is
// untouched. row_max is compiled without trapping math: with it GCC keeps a loop with a float
// compare scalar; nothing here reads floating-point exception flags.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define LS_ROW_CLONES gnu::target_clones("arch=x86-64-v3", "default")
#define LS_ROW_NO_TRAPS gnu::optimize("no-trapping-math")
#else
#define LS_ROW_CLONES
#define LS_ROW_NO_TRAPS
#endif

// row[c] = exp(row[c] * scale - sub) for c < n; returns their sum (in 8 interleaved partial
// sums, so that the loop vectorizes).
[[LS_ROW_CLONES]] float exp_row_f32(float* __restrict row, int64_t n, float scale, float sub) {
  for (int64_t c = 0; c < n; ++c) row[c] = exp_f32(row[c] * scale - sub);
  float acc[8] = {};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int j = 0; j < 8; ++j) acc[j] += row[c + j];
  float sum = 0;
  for (; c < n; ++c) sum += row[c];
  for (int j = 0; j < 8; ++j) sum += acc[j];
  return sum;
}

// max of row[0, n), n >= 1, in 8 interleaved partial maxima. Ternaries, not std::max, which
// would not inline into a function of other optimization options.
[[LS_ROW_CLONES, LS_ROW_NO_TRAPS]] float max_row_f32(const float* row, int64_t n) {
  float acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = row[0];
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int j = 0; j < 8; ++j) acc[j] = row[c + j] > acc[j] ? row[c + j] : acc[j];
  float m = acc[0];
  for (; c < n; ++c) m = row[c] > m ? row[c] : m;
  for (int j = 1; j < 8; ++j) m = acc[j] > m ? acc[j] : m;
  return m;
}

template <typename T>
T exp_row(T* row, int64_t n, T scale, T sub) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_row_f32(row, n, scale, sub);
  } else {
    T sum = 0;
    for (int64_t c = 0; c < n; ++c) sum += row[c] = std::exp(row[c] * scale - sub);
    return sum;
  }
}

template <typename T>
T max_row(const T* row, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return max_row_f32(row, n);
  } else {
    T m = row[0];
    for (int64_t c = 1; c < n; ++c) m = std::max(m, row[c]);
    return m;
  }
}

// How many of the `cols` keys from j0 on query row i may attend to (all of them when not causal).
inline int64_t visible(int64_t i, int64_t j0, int64_t cols, bool causal) {
  return causal ? std::clamp<int64_t>(i - j0 + 1, 0, cols) : cols;
}

// One head of the forward: o (tq, dv) and lse (tq), rows at n's strides. s is a kRows x kCols
// scratch tile, m and l kRows each: the running max and sum of exponentials of the current query
// tile's rows.
template <typename T>
void forward_head(const T* q, const T* k, const T* v, T* o, T* lse, const AttentionHead& n, T scale,
                  bool causal, T* s, T* m, T* l) {
  for (int64_t i0 = 0; i0 < n.tq; i0 += kRows) {
    const int64_t rows = std::min(kRows, n.tq - i0);
    T* oi = o + i0 * n.ldo;
    for (int64_t r = 0; r < rows; ++r) std::fill(oi + r * n.ldo, oi + r * n.ldo + n.dv, T(0));
    std::fill(m, m + rows, -std::numeric_limits<T>::infinity());
    std::fill(l, l + rows, T(0));
    // Causal: key tiles past this query tile's last row are all masked; skip them.
    const int64_t kend = causal ? std::min(n.tk, i0 + rows) : n.tk;
    for (int64_t j0 = 0; j0 < kend; j0 += kCols) {
      const int64_t cols = std::min(kCols, kend - j0);
      gemm<T>(false, true, rows, cols, n.d, q + i0 * n.ldq, n.ldq, k + j0 * n.ldk, n.ldk, T(0), s,
              kCols);
      for (int64_t r = 0; r < rows; ++r) {
        T* row = s + r * kCols;
        const int64_t vis = visible(i0 + r, j0, cols, causal);
        if (vis == 0) {  // causal: this row sees none of these keys
          std::fill(row, row + cols, T(0));
          continue;
        }
        const T m_new = std::max(m[r], max_row(row, vis) * scale);
        const T alpha = std::exp(m[r] - m_new);  // 0 for the first tile (m = -inf)
        const T sum = exp_row(row, vis, scale, m_new);
        std::fill(row + vis, row + cols, T(0));
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
        if (alpha != T(1))
          for (int64_t c = 0; c < n.dv; ++c) oi[r * n.ldo + c] *= alpha;
      }
      gemm<T>(false, false, rows, n.dv, cols, s, kCols, v + j0 * n.ldv, n.ldv, T(1), oi, n.ldo);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const T inv = T(1) / l[r];
      for (int64_t c = 0; c < n.dv; ++c) oi[r * n.ldo + c] *= inv;
      lse[i0 + r] = m[r] + std::log(l[r]);
    }
  }
}

// One head of the backward (the key-tile-outer order of FlashAttention-2: dk and dv of a key
// tile are finished before the next, dq accumulates over key tiles). p and dp are kRows x kCols
// scratch tiles; delta (tq) holds rowsum(g * o).
template <typename T>
void backward_head(T* dq, T* dk, T* dv, const T* g, const T* q, const T* k, const T* v, const T* o,
                   const T* lse, const AttentionHead& n, T scale, bool causal, T* p, T* dp,
                   T* delta) {
  for (int64_t i = 0; i < n.tq; ++i) {
    T acc = 0;
    for (int64_t c = 0; c < n.dv; ++c) acc += g[i * n.ldg + c] * o[i * n.ldo + c];
    delta[i] = acc;
  }
  for (int64_t i = 0; i < n.tq; ++i) std::fill(dq + i * n.lddq, dq + i * n.lddq + n.d, T(0));
  for (int64_t j0 = 0; j0 < n.tk; j0 += kCols) {
    const int64_t cols = std::min(kCols, n.tk - j0);
    T* dkj = dk + j0 * n.lddk;
    T* dvj = dv + j0 * n.lddv;
    for (int64_t t = 0; t < cols; ++t) {
      std::fill(dkj + t * n.lddk, dkj + t * n.lddk + n.d, T(0));
      std::fill(dvj + t * n.lddv, dvj + t * n.lddv + n.dv, T(0));
    }
    // Causal (tq == tk): query tiles that end before key j0 see none of this tile's keys.
    for (int64_t i0 = causal ? j0 / kRows * kRows : 0; i0 < n.tq; i0 += kRows) {
      const int64_t rows = std::min(kRows, n.tq - i0);
      gemm<T>(false, true, rows, cols, n.d, q + i0 * n.ldq, n.ldq, k + j0 * n.ldk, n.ldk, T(0), p,
              kCols);
      for (int64_t r = 0; r < rows; ++r) {
        T* row = p + r * kCols;
        const int64_t vis = visible(i0 + r, j0, cols, causal);
        exp_row(row, vis, scale, lse[i0 + r]);
        std::fill(row + vis, row + cols, T(0));
      }
      const T* gi = g + i0 * n.ldg;
      // dv_j += p^T g_i; dp = g_i v_j^T.
      gemm<T>(true, false, cols, n.dv, rows, p, kCols, gi, n.ldg, T(1), dvj, n.lddv);
      gemm<T>(false, true, rows, cols, n.dv, gi, n.ldg, v + j0 * n.ldv, n.ldv, T(0), dp, kCols);
      // ds = p * (dp - delta) * scale, the gradient of the scaled scores times the scale.
      for (int64_t r = 0; r < rows; ++r) {
        T* ds = dp + r * kCols;
        const T* pr = p + r * kCols;
        const T di = delta[i0 + r];
        for (int64_t c = 0; c < cols; ++c) ds[c] = pr[c] * (ds[c] - di) * scale;
      }
      // dq_i += ds k_j; dk_j += ds^T q_i.
      gemm<T>(false, false, rows, n.d, cols, dp, kCols, k + j0 * n.ldk, n.ldk, T(1),
              dq + i0 * n.lddq, n.lddq);
      gemm<T>(true, false, cols, n.d, rows, dp, kCols, q + i0 * n.ldq, n.ldq, T(1), dkj, n.lddk);
    }
  }
}

// Heads in parallel, one whole head per task, each gemm on its thread (Note [Batched GEMM
// threading] in gemm.cpp); a single head, or OpenBLAS's pthreads build, runs on the calling
// thread and lets BLAS thread its products.
template <typename F>
void for_each_head(int64_t heads, const F& f) {
  static const bool serial = std::strcmp(blas_threading(), "pthreads") == 0;
  parallel_for(0, heads, serial ? heads : 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) f(h);
  });
}

// Element offsets of every head of t (..., T, D): row-major over the leading dims, at t's
// strides (Note [Strided attention inputs] in src/ops/attention.cpp).
std::vector<int64_t> head_offsets(const Tensor& t) {
  const int64_t lead = t.dim() - 2;
  int64_t heads = 1;
  for (int64_t d = 0; d < lead; ++d) heads *= t.size(d);
  std::vector<int64_t> out(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) {
    int64_t off = 0, rem = h;
    for (int64_t d = lead - 1; d >= 0; --d) {
      off += rem % t.size(d) * t.stride(d);
      rem /= t.size(d);
    }
    out[static_cast<size_t>(h)] = off;
  }
  return out;
}

// The row stride of t (..., T, D); a single row's stride is free, so it reads as D.
int64_t row_stride(const Tensor& t) {
  return t.size(-2) > 1 ? t.stride(-2) : std::max<int64_t>(1, t.size(-1));
}

// Sizes and row strides of every head of q, k, v, out (and for the backward g, dq, dk, dv).
AttentionHead head_sizes(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out) {
  AttentionHead n{q.size(-2), k.size(-2), q.size(-1), v.size(-1)};
  n.ldq = row_stride(q);
  n.ldk = row_stride(k);
  n.ldv = row_stride(v);
  n.ldo = row_stride(out);
  return n;
}

template <typename T>
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, bool causal) {
  const AttentionHead n = head_sizes(q, k, v, out);
  check_blas_size(kRows, kCols, std::max(n.d, n.dv), "scaled_dot_product_attention");
  const std::vector<int64_t> oq = head_offsets(q), ok = head_offsets(k), ov = head_offsets(v),
                             oo = head_offsets(out);
  const int64_t heads = static_cast<int64_t>(oq.size());
  const T* pq = q.data<T>();
  const T* pk = k.data<T>();
  const T* pv = v.data<T>();
  T* po = out.data<T>();
  T* pl = lse.data<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (attention_avx2_enabled()) {  // Note [Attention micro-kernel] in attention_avx2.cpp
      parallel_for(0, heads, 1, [&](int64_t b, int64_t e) {
        for (int64_t h = b; h < e; ++h) {
          if (h + 1 < e) {  // Note [Prefetching the next head]
            attention_prefetch_rows(pq + oq[h + 1], n.tq, n.ldq, n.d);
            attention_prefetch_rows(pk + ok[h + 1], n.tk, n.ldk, n.d);
            attention_prefetch_rows(pv + ov[h + 1], n.tk, n.ldv, n.dv);
          }
          attention_forward_head_avx2(pq + oq[h], pk + ok[h], pv + ov[h], po + oo[h], pl + h * n.tq,
                                      n, static_cast<float>(scale), causal);
        }
      });
      return;
    }
  }
  for_each_head(heads, [&](int64_t h) {
    thread_local std::vector<T> scratch;
    scratch.resize(kRows * kCols + 2 * kRows);
    T* s = scratch.data();
    forward_head<T>(pq + oq[h], pk + ok[h], pv + ov[h], po + oo[h], pl + h * n.tq, n,
                    static_cast<T>(scale), causal, s, s + kRows * kCols, s + kRows * kCols + kRows);
  });
}

template <typename T>
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& g,
                        const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, double scale, bool causal) {
  AttentionHead n = head_sizes(q, k, v, out);
  n.ldg = row_stride(g);
  n.lddq = row_stride(dq);
  n.lddk = row_stride(dk);
  n.lddv = row_stride(dv);
  const std::vector<int64_t> oq = head_offsets(q), ok = head_offsets(k), ov = head_offsets(v),
                             oo = head_offsets(out), og = head_offsets(g), odq = head_offsets(dq),
                             odk = head_offsets(dk), odv = head_offsets(dv);
  const int64_t heads = static_cast<int64_t>(oq.size());
  const T *pq = q.data<T>(), *pk = k.data<T>(), *pv = v.data<T>();
  const T *pg = g.data<T>(), *po = out.data<T>(), *pl = lse.data<T>();
  T *pdq = dq.data<T>(), *pdk = dk.data<T>(), *pdv = dv.data<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (attention_avx2_enabled()) {
      parallel_for(0, heads, 1, [&](int64_t b, int64_t e) {
        for (int64_t h = b; h < e; ++h) {
          if (h + 1 < e) {  // Note [Prefetching the next head]
            attention_prefetch_rows(pq + oq[h + 1], n.tq, n.ldq, n.d);
            attention_prefetch_rows(pk + ok[h + 1], n.tk, n.ldk, n.d);
            attention_prefetch_rows(pv + ov[h + 1], n.tk, n.ldv, n.dv);
            attention_prefetch_rows(pg + og[h + 1], n.tq, n.ldg, n.dv);
            attention_prefetch_rows(po + oo[h + 1], n.tq, n.ldo, n.dv);
          }
          attention_backward_head_avx2(pdq + odq[h], pdk + odk[h], pdv + odv[h], pg + og[h],
                                       pq + oq[h], pk + ok[h], pv + ov[h], po + oo[h],
                                       pl + h * n.tq, n, static_cast<float>(scale), causal);
        }
      });
      return;
    }
  }
  for_each_head(heads, [&](int64_t h) {
    thread_local std::vector<T> scratch;
    scratch.resize(2 * kRows * kCols + n.tq);
    T* p = scratch.data();
    backward_head<T>(pdq + odq[h], pdk + odk[h], pdv + odv[h], pg + og[h], pq + oq[h], pk + ok[h],
                     pv + ov[h], po + oo[h], pl + h * n.tq, n, static_cast<T>(scale), causal, p,
                     p + kRows * kCols, p + 2 * kRows * kCols);
  });
}

}  // namespace

void attention_kernel(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                      const Tensor& v, double scale, bool causal) {
  dispatch_float(q.dtype(), "scaled_dot_product_attention",
                 [&]<typename T>() { attention_forward<T>(out, lse, q, k, v, scale, causal); });
}

void attention_backward_kernel(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                               const Tensor& g, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, const Tensor& lse, double scale, bool causal) {
  dispatch_float(q.dtype(), "scaled_dot_product_attention", [&]<typename T>() {
    attention_backward<T>(dq, dk, dv, g, q, k, v, out, lse, scale, causal);
  });
}

}  // namespace lockstep::cpu
