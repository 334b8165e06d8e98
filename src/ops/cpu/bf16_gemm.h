// Matrix products through oneDNN's matmul primitive: bf16 x bf16 -> f32 (or bf16) on the CPU's
// AVX-512 BF16 / AMX instructions where it has them (Note [bf16 GEMM] in bf16_gemm.cpp), and
// f32 x f32 -> f32 where oneDNN runs its brgemm kernel (Note [f32 GEMM]).
#pragma once

#include <cstdint>

namespace lockstep::cpu {

// Whether this build has the oneDNN path (LOCKSTEP_HAVE_ONEDNN) and it works on this CPU.
bool bf16_gemm_available();
// The oneDNN implementation chosen for a bf16 product, e.g. "brg:avx512_core_bf16" ("" when
// unavailable); for benchmarks and logs.
const char* bf16_gemm_impl();

// A row-major (rows x cols) bf16 matrix at `data`, element (i, j) at i * rs + j * cs (one of the
// two strides is 1; see Note [BLAS operands] in src/ops/cpu/gemm.cpp).
struct Bf16Matrix {
  const uint16_t* data = nullptr;
  int64_t rs = 0, cs = 1;
};

// c (m x n, row-major, leading dim ldc, f32) = a (m x k) @ b (k x n) + (accumulate ? c : 0).
// Returns false when the oneDNN path is unavailable or refuses the layout; the caller then
// converts and calls sgemm.
bool bf16_gemm(int64_t m, int64_t n, int64_t k, const Bf16Matrix& a, const Bf16Matrix& b, float* c,
               int64_t ldc, bool accumulate);
// The same product rounded once to bf16 into c (m x n, ldc), plus bias (n, f32) before the
// rounding when not null: autocast's Linear and matmul outputs, without an f32 copy in memory.
bool bf16_gemm_bf16_out(int64_t m, int64_t n, int64_t k, const Bf16Matrix& a, const Bf16Matrix& b,
                        const float* bias, uint16_t* c, int64_t ldc);

// A row-major (rows x cols) f32 matrix, as Bf16Matrix.
struct F32Matrix {
  const float* data = nullptr;
  int64_t rs = 0, cs = 1;
};

// Whether f32 products go to oneDNN (Note [f32 GEMM]): this CPU runs its brgemm kernel and
// set_f32_gemm_onednn(false) was not called.
bool f32_gemm_onednn_enabled();
// Sends f32 products to OpenBLAS (false) or back to oneDNN where it runs (true, the default);
// for tests and A/B measurements.
void set_f32_gemm_onednn(bool enabled);
// c (m x n, row-major, ldc) = a (m x k) @ b (k x n) + bias (n, or nullptr: none); false when
// f32_gemm_onednn_enabled() is not or oneDNN refuses the layout (the caller then calls sgemm).
bool f32_gemm_onednn(int64_t m, int64_t n, int64_t k, const F32Matrix& a, const F32Matrix& b,
                     const float* bias, float* c, int64_t ldc);

}  // namespace lockstep::cpu
