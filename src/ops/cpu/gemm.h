// The CPU's one matrix product, under the gemm kernel (matmul, linear) and the conv kernels:
// OpenBLAS for f32 and f64, oneDNN for bf16 operands (Note [bf16 GEMM] in bf16_gemm.cpp).
#pragma once

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "lockstep/base/error.h"
#include "lockstep/tensor/half.h"
#include "ops/cpu/bf16_gemm.h"

namespace lockstep::cpu {

// BLAS takes 32-bit sizes; `op` names the caller in the error.
inline void check_blas_size(int64_t m, int64_t n, int64_t k, const char* op) {
  LS_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX, op, ": matrix sizes (", m, ", ", n, ", ",
           k, ") exceed what BLAS takes (", INT_MAX, ")");
}

// c (m x n, row-major, leading dim ldc) = op(a) @ op(b) + beta * c, where op(a) (m x k) is the
// matrix stored at a with leading dim lda, transposed when trans_a (likewise b). Sizes are
// checked by the caller (check_blas_size; leading dims within INT_MAX).
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS may not touch C at all for k == 0; the product is zero
    if (beta == T(0))
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, T(0));
    return;
  }
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  const auto M = static_cast<blasint>(m), N = static_cast<blasint>(n), K = static_cast<blasint>(k);
  const auto la = static_cast<blasint>(lda), lb = static_cast<blasint>(ldb),
             lc = static_cast<blasint>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, a, la, b, lb, beta, c, lc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, 1.0, a, la, b, lb, beta, c, lc);
  }
}

// c (m x n, f32, ldc) = op(a) @ op(b) (+ c when accumulate) with bf16 a and b, as gemm above;
// false when oneDNN is unavailable or declines the layout (the caller then computes in f32).
// A row-major bf16 operand with leading dimension ld, transposed or not, as oneDNN's strides.
inline Bf16Matrix bf16_operand(const BFloat16* p, int64_t ld, bool trans) {
  Bf16Matrix m;
  m.data = reinterpret_cast<const uint16_t*>(p);
  m.rs = trans ? 1 : ld;
  m.cs = trans ? ld : 1;
  return m;
}

inline bool gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                      const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb,
                      bool accumulate, float* c, int64_t ldc) {
  return bf16_gemm(m, n, k, bf16_operand(a, lda, trans_a), bf16_operand(b, ldb, trans_b), c, ldc,
                   accumulate);
}

// The same with c (bf16) = round(op(a) @ op(b) + bias), bias (n, f32) or nullptr.
inline bool gemm_bf16_out(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb,
                          const float* bias, BFloat16* c, int64_t ldc) {
  return bf16_gemm_bf16_out(m, n, k, bf16_operand(a, lda, trans_a), bf16_operand(b, ldb, trans_b),
                            bias, reinterpret_cast<uint16_t*>(c), ldc);
}

}  // namespace lockstep::cpu
