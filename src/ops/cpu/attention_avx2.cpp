// scaled_dot_product_attention's f32 kernels for AVX2 + FMA: one register-blocked micro-kernel
// for every product of the forward and the backward, and the softmax on 8-lane vectors.
#include "ops/cpu/attention_avx2.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/cpu/avx2_math.h"

namespace lockstep::cpu {

// Note [Attention micro-kernel]
// With OpenBLAS per tile the fused attention ran at 27-37% of sgemm's peak at T = 128, D = 32
// (docs/PERFORMANCE.md): a 64 x 64 x 32 product is too small for BLAS's packing and calls to pay
// off, and the score tile went through memory between the product, the softmax and the next
// product. Here every product, forward and backward, is one micro-kernel: C[R x 16] (+)= A B
// over k, R <= 6 rows of A read through two strides (so A may be a transposed tile, as P^T and
// dS^T of the backward are, without copying it) and 16 columns of a row-major B, 12 of the 16
// ymm registers holding C. The operands are packed once per head into padded row-major panels
// (k^T, v, and for the backward k, v^T, q, g) whose rows are multiples of 8 floats, so the
// kernel needs no masked loads; the padding is zero, so it adds nothing. The scores of a block
// of 6 queries against up to kKeyTile keys stay in L1 between the product, the softmax and the
// product with v. Causal blocks stop at the last key a row of theirs sees, rounded up to 8.
//
// The softmax is the online one of attention.cpp (Note [Fused attention]): q is pre-scaled, so
// the scores are already scaled; a row's running max and sum rescale its output when a later
// key tile raises the max. Masked keys (past vis) get probability exactly 0. exp8 is the same
// range reduction as exp_f32 (Note [Vectorized exp]) on 8 lanes; its clamp at -87 keeps a NaN
// (vmaxps returns its second operand when either is NaN), so a NaN input still gives NaN out.

namespace {

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_avx512{true};

}  // namespace

void set_attention_avx2(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

void set_attention_avx512(bool enabled) { g_avx512.store(enabled, std::memory_order_relaxed); }

bool attention_avx512_enabled() {
  return cpu_has_avx512() && g_avx512.load(std::memory_order_relaxed);
}

#if LS_HAVE_AVX2

namespace {

constexpr int64_t kMr = 6;         // rows of C per micro-kernel call
constexpr int64_t kKeyTile = 256;  // keys per tile of the forward (one tile up to T = 256)
constexpr int64_t kBwdKeys = 64;   // keys per tile of the backward
// Queries per block of the backward. Causal blocks on the diagonal compute only up to the last
// key their last query sees, so small blocks skip most of the masked half: with 16 (64 before)
// a 64-key diagonal tile computes 10 of its 16 cells of 16 x 16, not all 16, and the p and ds
// tiles (16 x 64 floats each) stay in L1. docs/PERFORMANCE.md has the measurement.
constexpr int64_t kBwdRows = 16;

int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }

// C[R x 8 NV] = (acc ? C : 0) + sum over k < kn of A(r, k) B[k][0 .. 8 NV), where
// A(r, k) = a[r * ars + k * aks]. The accumulators are named variables, not an array: GCC
// stored an array's registers back to the stack on every k (measured: 3x slower).
template <int R, int NV>
LS_AVX2 void micro(int64_t kn, const float* a, int64_t ars, int64_t aks, const float* b,
                   int64_t ldb, float* c, int64_t ldc, bool acc) {
  static_assert(R >= 1 && R <= 6 && (NV == 1 || NV == 2));
  __m256 x00, x01, x10, x11, x20, x21, x30, x31, x40, x41, x50, x51;
  x00 = x01 = x10 = x11 = x20 = x21 = x30 = x31 = x40 = x41 = x50 = x51 = _mm256_setzero_ps();
#define LS_LOAD(r, v, x) \
  if constexpr (R > r && NV > v) x = _mm256_loadu_ps(c + r * ldc + 8 * v);
  // clang-format off
  if (acc) {
    LS_LOAD(0, 0, x00) LS_LOAD(0, 1, x01) LS_LOAD(1, 0, x10) LS_LOAD(1, 1, x11)
    LS_LOAD(2, 0, x20) LS_LOAD(2, 1, x21) LS_LOAD(3, 0, x30) LS_LOAD(3, 1, x31)
    LS_LOAD(4, 0, x40) LS_LOAD(4, 1, x41) LS_LOAD(5, 0, x50) LS_LOAD(5, 1, x51)
  }
  // clang-format on
#undef LS_LOAD
  const float* a0 = a;
  for (int64_t k = 0; k < kn; ++k, a0 += aks, b += ldb) {
    const __m256 b0 = _mm256_loadu_ps(b);
    const __m256 b1 = NV > 1 ? _mm256_loadu_ps(b + 8) : b0;
#define LS_ROW(r, x0, x1)                                   \
  if constexpr (R > r) {                                    \
    const __m256 av = _mm256_broadcast_ss(a0 + r * ars);    \
    x0 = _mm256_fmadd_ps(av, b0, x0);                       \
    if constexpr (NV > 1) x1 = _mm256_fmadd_ps(av, b1, x1); \
  }
    // clang-format off
    LS_ROW(0, x00, x01) LS_ROW(1, x10, x11) LS_ROW(2, x20, x21)
    LS_ROW(3, x30, x31) LS_ROW(4, x40, x41) LS_ROW(5, x50, x51)
    // clang-format on
#undef LS_ROW
  }
#define LS_STORE(r, v, x) \
  if constexpr (R > r && NV > v) _mm256_storeu_ps(c + r * ldc + 8 * v, x);
  // clang-format off
  LS_STORE(0, 0, x00) LS_STORE(0, 1, x01) LS_STORE(1, 0, x10) LS_STORE(1, 1, x11)
  LS_STORE(2, 0, x20) LS_STORE(2, 1, x21) LS_STORE(3, 0, x30) LS_STORE(3, 1, x31)
  LS_STORE(4, 0, x40) LS_STORE(4, 1, x41) LS_STORE(5, 0, x50) LS_STORE(5, 1, x51)
  // clang-format on
#undef LS_STORE
}

using MicroFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                         int64_t, bool);

template <int NV>
MicroFn micro_for(int64_t rows) {
  switch (rows) {
    case 1:
      return micro<1, NV>;
    case 2:
      return micro<2, NV>;
    case 3:
      return micro<3, NV>;
    case 4:
      return micro<4, NV>;
    case 5:
      return micro<5, NV>;
    default:
      return micro<6, NV>;
  }
}

// Note [Attention exps on AVX-512]
// Where the CPU has AVX-512F, the softmax's exps run 16 lanes at a time (row_exp512: exp16, the
// same bits per lane as exp8, the row sum added 8 lanes at a time in row_exp's order), so the
// results are the same bits as on AVX2 (tests/ops/attention_test.cpp compares them). The
// products stay on the 8-lane micro-kernel: a 6 x 32 zmm tile (masked column tail) ran 101-111
// GFLOP/s on L1-resident operands against 92-97 for the 6 x 16 ymm tile, but inside the
// attention, after the backward's 16-query blocks (k = 16 for dv and dk), it made the forward
// and the backward 2-3% slower (interleaved, (16, 4, 128, 32), operands in and out of cache), so
// it was taken out again (docs/PERFORMANCE.md).

// C[m x n] (+)= A B over kn, n a multiple of 8 (the panels' padding makes it one); column
// panels of 16 outside, so a panel of B stays in L1 while the row blocks pass over it.
LS_AVX2 void gemm(int64_t m, int64_t n, int64_t kn, const float* a, int64_t ars, int64_t aks,
                  const float* b, int64_t ldb, float* c, int64_t ldc, bool acc) {
  for (int64_t j = 0; j < n; j += 16) {
    const bool two = n - j >= 16;
    for (int64_t i = 0; i < m; i += kMr) {
      const int64_t rows = std::min(kMr, m - i);
      const MicroFn f = two ? micro_for<2>(rows) : micro_for<1>(rows);
      f(kn, a + i * ars, ars, aks, b + j, ldb, c + i * ldc + j, ldc, acc);
    }
  }
}

// Lanes c + 0 .. c + 7 that are below vis.
LS_AVX2 inline __m256 below(int64_t c, int64_t vis) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(c))),
                       _mm256_set1_ps(static_cast<float>(vis)), _CMP_LT_OQ);
}

LS_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

LS_AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// max of row[0, vis), vis >= 1; only the last vector is masked.
LS_AVX2 float row_max(const float* row, int64_t vis) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m = ninf;
  int64_t c = 0;
  for (; c + 8 <= vis; c += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(row + c));
  if (c < vis)
    m = _mm256_max_ps(m, _mm256_blendv_ps(ninf, _mm256_loadu_ps(row + c), below(c, vis)));
  return hmax(m);
}

// row[c] = exp(row[c] - sub) for c < vis, 0 for vis <= c < width (width a multiple of 8);
// returns the sum.
LS_AVX2 float row_exp(float* row, int64_t vis, int64_t width, float sub) {
  const __m256 s = _mm256_set1_ps(sub);
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= vis; c += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), s));
    _mm256_storeu_ps(row + c, p);
    acc = _mm256_add_ps(acc, p);
  }
  if (c < vis) {
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(row + c), s)), below(c, vis));
    _mm256_storeu_ps(row + c, p);
    acc = _mm256_add_ps(acc, p);
    c += 8;
  }
  for (; c < width; c += 8) _mm256_storeu_ps(row + c, _mm256_setzero_ps());
  return hsum(acc);
}

#if LS_HAVE_AVX512
// GCC 12 warns of its intrinsics' _mm512_undefined_ps() placeholders when inlined here (GCC
// bug 105593, fixed in 13); they are not read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// row_exp with the exps 16 lanes at a time (exp16, the same bits per lane as exp8) and the
// sum kept as row_exp keeps it: each 16-lane vector's low then high 8 lanes added into one
// 8-lane accumulator, the order row_exp adds its 8-lane vectors in, so the same sum.
LS_AVX512 inline __m256 add_halves(__m256 acc, __m512 p) {
  acc = _mm256_add_ps(acc, _mm512_castps512_ps256(p));
  return _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
}

LS_AVX512 float row_exp512(float* row, int64_t vis, int64_t width, float sub) {
  const __m512 s = _mm512_set1_ps(sub);
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= vis; c += 16) {
    const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + c), s));
    _mm512_storeu_ps(row + c, p);
    acc = add_halves(acc, p);
  }
  if (c < vis) {
    // The last vis - c lanes, and up to 16 - (vis - c) zeros: whole 8-lane groups of zeros
    // added to acc change nothing (x + 0 = x, and -0 cannot arise: the exps are positive).
    const __mmask16 m = static_cast<__mmask16>((1u << (vis - c)) - 1u);
    const __m512 p =
        _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + c), s)));
    const int64_t lanes = std::min<int64_t>(16, width - c);  // width is a multiple of 8
    _mm512_mask_storeu_ps(row + c, static_cast<__mmask16>((1u << lanes) - 1u), p);
    acc = add_halves(acc, p);
    c += lanes;
  }
  for (; c < width; c += 8) _mm256_storeu_ps(row + c, _mm256_setzero_ps());
  return hsum(acc);
}
#pragma GCC diagnostic pop
#endif

// row_exp on 16 lanes where `wide` (attention_avx512_enabled(), read once per head).
LS_AVX2 float row_exp_widest(bool wide, float* row, int64_t vis, int64_t width, float sub) {
#if LS_HAVE_AVX512
  if (wide) return row_exp512(row, vis, width, sub);
#endif
  return row_exp(row, vis, width, sub);
}

inline int64_t visible(int64_t i, int64_t j0, int64_t cols, bool causal) {
  return causal ? std::clamp<int64_t>(i - j0 + 1, 0, cols) : cols;
}

// dst[c] = src[c] * mul for c < n: 8 lanes at a time, the tail element by element (the same
// rounding either way).
LS_AVX2 void scale_copy(float* dst, const float* src, int64_t n, float mul) {
  const __m256 m = _mm256_set1_ps(mul);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(src + c), m));
  for (; c < n; ++c) dst[c] = src[c] * mul;
}

// dst[r][c] = src[r][c] * mul for r < rows, c < cols (src rows lds apart); zero for
// cols <= c < ld.
LS_AVX2 void pack_rows(float* dst, int64_t ld, const float* src, int64_t lds, int64_t rows,
                       int64_t cols, float mul) {
  for (int64_t r = 0; r < rows; ++r) {
    scale_copy(dst + r * ld, src + r * lds, cols, mul);
    std::fill(dst + r * ld + cols, dst + (r + 1) * ld, 0.0f);
  }
}

// sum over c < n of a[c] b[c], in 8 lanes then across them.
LS_AVX2 float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
  float s = hsum(acc);
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

// dst[8 x 8] = src[8 x 8]^T: unpack pairs of rows, shuffle pairs of pairs, swap 128-bit halves.
LS_AVX2 void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// dst[c][r] = src[r][c] (src rows lds apart; a (cols, ld) panel, zero for rows <= r < ld): 8 x 8
// blocks in registers (the scalar strided loop was 8% of the forward), the edges element by
// element.
LS_AVX2 void pack_transposed(float* dst, int64_t ld, const float* src, int64_t lds, int64_t rows,
                             int64_t cols) {
  const int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
  for (int64_t r = 0; r < r8; r += 8)
    for (int64_t c = 0; c < c8; c += 8) transpose8(src + r * lds + c, lds, dst + c * ld + r, ld);
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t from = c < c8 ? r8 : 0;
    for (int64_t r = from; r < rows; ++r) dst[c * ld + r] = src[r * lds + c];
    std::fill(dst + c * ld + rows, dst + (c + 1) * ld, 0.0f);
  }
}

// Per-thread scratch, grown as needed and reused across heads and calls.
float* scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

}  // namespace

bool attention_avx2_enabled() {
  return cpu_has_avx2() && g_enabled.load(std::memory_order_relaxed);
}

// Note [Prefetching the next head]
// In a training step a head's q, k, v (and in the backward g and o) are strided rows of tensors
// other layers have pushed out of the caches, and packing them into the kernels' panels waited
// on those misses (packing was 2.6% of an f32 train_gpt step). The head loops in attention.cpp
// ask for the next head's rows before computing this one, which takes far longer than the
// loads: with the operands flushed from the caches first (as in a step), the forward of
// (16, 4, 128, 32) took 5% less time and the backward 2% less (/tmp experiment, interleaved).
void attention_prefetch_rows(const float* p, int64_t rows, int64_t ld, int64_t cols) {
  const int64_t bytes = cols * static_cast<int64_t>(sizeof(float));
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * ld);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    _mm_prefetch(row + bytes - 1, _MM_HINT_T1);
  }
}

LS_AVX2 void attention_forward_head_avx2(const float* q, const float* k, const float* v, float* o,
                                         float* lse, const AttentionHead& n, float scale,
                                         bool causal) {
  const bool wide = attention_avx512_enabled();
  const int64_t tkp = round8(n.tk), dvp = round8(n.dv);
  // Panels: k^T (d, tkp), v (tkp, dvp); per query block: q scaled (kMr, d), scores
  // (kMr, kKeyTile), output (kMr, dvp).
  float* kt =
      scratch(static_cast<size_t>(n.d * tkp + tkp * dvp + kMr * n.d + kMr * kKeyTile + kMr * dvp));
  float* vp = kt + n.d * tkp;
  float* qs = vp + tkp * dvp;
  float* s = qs + kMr * n.d;
  float* acc = s + kMr * kKeyTile;
  pack_transposed(kt, tkp, k, n.ldk, n.tk, n.d);
  pack_rows(vp, dvp, v, n.ldv, n.tk, n.dv, 1.0f);
  std::fill(vp + n.tk * dvp, vp + tkp * dvp, 0.0f);

  float m[kMr], l[kMr];
  for (int64_t i0 = 0; i0 < n.tq; i0 += kMr) {
    const int64_t rows = std::min(kMr, n.tq - i0);
    for (int64_t r = 0; r < rows; ++r)
      scale_copy(qs + r * n.d, q + (i0 + r) * n.ldq, n.d, scale);
    std::fill(acc, acc + rows * dvp, 0.0f);
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.0f);
    const int64_t kend = causal ? std::min(n.tk, i0 + rows) : n.tk;
    for (int64_t j0 = 0; j0 < kend; j0 += kKeyTile) {
      const int64_t cols = std::min(kKeyTile, kend - j0), width = round8(cols);
      gemm(rows, width, n.d, qs, n.d, 1, kt + j0, tkp, s, kKeyTile, false);
      int64_t most = 0;  // the most keys of this tile any row sees
      for (int64_t r = 0; r < rows; ++r) {
        float* row = s + r * kKeyTile;
        const int64_t vis = visible(i0 + r, j0, cols, causal);
        most = std::max(most, vis);
        if (vis == 0) {
          std::fill(row, row + width, 0.0f);
          continue;
        }
        const float m_new = std::max(m[r], row_max(row, vis));
        const float alpha = std::exp(m[r] - m_new);  // 0 for the first tile (m = -inf)
        l[r] = l[r] * alpha + row_exp_widest(wide, row, vis, width, m_new);
        m[r] = m_new;
        // alpha is 0 on the first tile (acc is still zero) and also when a later tile raises
        // the max by more than ~103 (exp underflows): then the old acc must go, so multiply.
        if (alpha != 1.0f)
          scale_copy(acc + r * dvp, acc + r * dvp, dvp, alpha);
      }
      gemm(rows, dvp, most, s, kKeyTile, 1, vp + j0 * dvp, dvp, acc, dvp, true);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / l[r];
      scale_copy(o + (i0 + r) * n.ldo, acc + r * dvp, n.dv, inv);
      lse[i0 + r] = m[r] + std::log(l[r]);
    }
  }
}

// The key-tile-outer order of FlashAttention-2, as backward_head in attention.cpp, with the
// products on the micro-kernel: p = exp(qs k_j^T - lse); dv_j += p^T g_i; dp = g_i v_j^T;
// ds = p (dp - delta); dq_i += ds k_j (times scale at the end); dk_j += ds^T qs_i.
LS_AVX2 void attention_backward_head_avx2(float* dq, float* dk, float* dv, const float* g,
                                          const float* q, const float* k, const float* v,
                                          const float* o, const float* lse, const AttentionHead& n,
                                          float scale, bool causal) {
  const bool wide = attention_avx512_enabled();
  const int64_t tkp = round8(n.tk), dp = round8(n.d), dvp = round8(n.dv);
  constexpr int64_t kP = kBwdKeys;  // row stride of the p and ds tiles
  // Panels: qs (tq, dp), k^T (d, tkp), k (tkp, dp), v^T (dv, tkp), g (tq, dvp); accumulators
  // dq (tq, dp), dk_j (kBwdKeys, dp), dv_j (kBwdKeys, dvp); tiles p, ds (kBwdRows, kP); delta.
  const int64_t floats = n.tq * dp + n.d * tkp + tkp * dp + n.dv * tkp + n.tq * dvp + n.tq * dp +
                         kBwdKeys * dp + kBwdKeys * dvp + 2 * kBwdRows * kP + n.tq;
  float* qs = scratch(static_cast<size_t>(floats));
  float* kt = qs + n.tq * dp;
  float* kp = kt + n.d * tkp;
  float* vt = kp + tkp * dp;
  float* gp = vt + n.dv * tkp;
  float* dqa = gp + n.tq * dvp;
  float* dka = dqa + n.tq * dp;
  float* dva = dka + kBwdKeys * dp;
  float* p = dva + kBwdKeys * dvp;
  float* ds = p + kBwdRows * kP;
  float* delta = ds + kBwdRows * kP;
  pack_rows(qs, dp, q, n.ldq, n.tq, n.d, scale);
  pack_transposed(kt, tkp, k, n.ldk, n.tk, n.d);
  pack_rows(kp, dp, k, n.ldk, n.tk, n.d, 1.0f);
  std::fill(kp + n.tk * dp, kp + tkp * dp, 0.0f);
  pack_transposed(vt, tkp, v, n.ldv, n.tk, n.dv);
  pack_rows(gp, dvp, g, n.ldg, n.tq, n.dv, 1.0f);
  std::fill(dqa, dqa + n.tq * dp, 0.0f);
  for (int64_t i = 0; i < n.tq; ++i) delta[i] = dot(g + i * n.ldg, o + i * n.ldo, n.dv);

  for (int64_t j0 = 0; j0 < n.tk; j0 += kBwdKeys) {
    const int64_t cols = std::min(kBwdKeys, n.tk - j0), width = round8(cols);
    std::fill(dka, dka + cols * dp, 0.0f);
    std::fill(dva, dva + cols * dvp, 0.0f);
    // Causal: queries before j0 see none of these keys.
    for (int64_t i0 = causal ? std::min(j0, n.tq) : 0; i0 < n.tq; i0 += kBwdRows) {
      const int64_t rows = std::min(kBwdRows, n.tq - i0);
      // Causal: this block's last query sees keys up to i0 + rows - 1 and no further.
      const int64_t bw = causal ? round8(visible(i0 + rows - 1, j0, cols, true)) : width;
      gemm(rows, bw, n.d, qs + i0 * dp, dp, 1, kt + j0, tkp, p, kP, false);
      int64_t most = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t vis = visible(i0 + r, j0, cols, causal);
        most = std::max(most, vis);
        row_exp_widest(wide, p + r * kP, vis, bw, lse[i0 + r]);
      }
      if (most == 0) continue;
      const int64_t most8 = round8(most);
      // dv_j += p^T g_i: A(t, r) = p[r][t].
      gemm(most, dvp, rows, p, 1, kP, gp + i0 * dvp, dvp, dva, dvp, true);
      // dp = g_i v_j^T, then ds = p (dp - delta) in place.
      gemm(rows, most8, n.dv, gp + i0 * dvp, dvp, 1, vt + j0, tkp, ds, kP, false);
      for (int64_t r = 0; r < rows; ++r) {
        const __m256 d = _mm256_set1_ps(delta[i0 + r]);
        float* dr = ds + r * kP;
        const float* pr = p + r * kP;
        for (int64_t c = 0; c < most8; c += 8) {
          const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(dr + c), d);
          _mm256_storeu_ps(dr + c, _mm256_mul_ps(_mm256_loadu_ps(pr + c), x));
        }
      }
      // dq_i += ds k_j; dk_j += ds^T qs_i.
      gemm(rows, dp, most, ds, kP, 1, kp + j0 * dp, dp, dqa + i0 * dp, dp, true);
      gemm(most, dp, rows, ds, 1, kP, qs + i0 * dp, dp, dka, dp, true);
    }
    for (int64_t t = 0; t < cols; ++t) {
      std::memcpy(dk + (j0 + t) * n.lddk, dka + t * dp, static_cast<size_t>(n.d) * sizeof(float));
      std::memcpy(dv + (j0 + t) * n.lddv, dva + t * dvp, static_cast<size_t>(n.dv) * sizeof(float));
    }
  }
  for (int64_t i = 0; i < n.tq; ++i)
    scale_copy(dq + i * n.lddq, dqa + i * dp, n.d, scale);
}

#else  // not x86-64: the portable kernels only

void attention_prefetch_rows(const float*, int64_t, int64_t, int64_t) {}

bool attention_avx2_enabled() { return false; }
void attention_forward_head_avx2(const float*, const float*, const float*, float*, float*,
                                 const AttentionHead&, float, bool) {}
void attention_backward_head_avx2(float*, float*, float*, const float*, const float*, const float*,
                                  const float*, const float*, const float*, const AttentionHead&,
                                  float, bool) {}

#endif

}  // namespace lockstep::cpu
