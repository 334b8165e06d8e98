// The CPU gemm kernel of matmul and linear: batched products with broadcast batch dims and an
// optional bias row, through oneDNN (bf16; f32 where it runs its brgemm, Note [f32 GEMM]) or
// BLAS (f64, other f32); f16, and bf16 shapes oneDNN declines, are computed in f32 from
// converted operands.
#include <algorithm>
#include <bit>
#include <climits>
#include <cstring>
#include <type_traits>
#include <vector>

#include "lockstep/ops/linalg.h"
#include "lockstep/tensor/parallel.h"
#include "ops/cpu/avx2_math.h"
#include "ops/cpu/gemm.h"
#include "ops/cpu/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

namespace {

// Note [BLAS operands]
// Row-major BLAS reads a (rows x cols) matrix either as stored (NoTrans: element (i, j) at
// i * ld + j) or as the transpose of a stored (cols x rows) one (Trans: at i + j * ld). A strided
// view fits one of the two when one of its strides is 1 and the other is a valid leading
// dimension, which covers contiguous tensors and their .t() / .transpose(-1, -2) views, and
// row slices of either. Those go to BLAS as they are; anything else (an expanded matrix dim, a
// column step > 1 in both directions) is copied once first.

struct Matrix {
  bool trans = false;
  int64_t ld = 1;
};

// Fills `out` with the BLAS view of a (rows x cols) matrix with strides (rs, cs); false when
// neither layout fits. Strides of size-1 dims are never used, so they are free.
bool blas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, Matrix* out) {
  const int64_t min_row_ld = std::max<int64_t>(1, cols), min_col_ld = std::max<int64_t>(1, rows);
  if ((cs == 1 || cols <= 1) && (rows <= 1 || rs >= min_row_ld)) {
    out->trans = false;
    out->ld = rows <= 1 ? min_row_ld : rs;
  } else if ((rs == 1 || rows <= 1) && (cols <= 1 || cs >= min_col_ld)) {
    out->trans = true;
    out->ld = cols <= 1 ? min_col_ld : cs;
  } else {
    return false;
  }
  return out->ld <= INT_MAX;
}

// The last two dims of `t` as a BLAS operand.
bool blas_layout(const Tensor& t, Matrix* out) {
  return blas_layout(t.size(-2), t.size(-1), t.stride(-2), t.stride(-1), out);
}

// `t` when its last two dims fit BLAS, else a contiguous copy (see Note [BLAS operands]).
Tensor blas_ready(const Tensor& t) {
  Matrix m;
  return blas_layout(t, &m) ? t : t.contiguous();
}

// Note [Batched GEMM threading]
// A batch of small products (attention: one 64 x 64 matrix per head) leaves BLAS's threads
// without enough work in any one of them, so such a batch is spread over OpenMP threads, one
// whole gemm per entry: OpenBLAS's OpenMP build runs a gemm called inside a parallel region on
// the calling thread. Larger products go one at a time from the calling thread, where BLAS
// threads each of them. OpenBLAS's pthreads build would start its own threads from every OpenMP
// thread, so with it the batch always runs serially (see Note [OpenMP BLAS] in CMakeLists.txt).
constexpr int64_t kSmallGemmFlops = int64_t{1} << 21;  // m * n * k of a "small" product

bool blas_runs_serially_in_parallel_regions() {
  static const bool serial = std::strcmp(blas_threading(), "pthreads") != 0;
  return serial;
}

// Leading (batch) dims of a shape of at least 2 dims.
Dims batch_dims(Dims shape) {
  shape.resize(shape.size() - 2);
  return shape;
}

Dims with_matrix(Dims batch, int64_t rows, int64_t cols) {
  batch.push_back(rows);
  batch.push_back(cols);
  return batch;
}

// Element offsets of batch entry i (row-major over `batch`) in a and b (expanded to it).
std::pair<int64_t, int64_t> batch_offsets(int64_t i, const Dims& batch, const Tensor& a,
                                          const Tensor& b) {
  int64_t oa = 0, ob = 0, rem = i;
  for (int64_t d = batch.size() - 1; d >= 0; --d) {
    const int64_t idx = rem % batch[d];
    rem /= batch[d];
    oa += idx * a.stride(d);
    ob += idx * b.stride(d);
  }
  return {oa, ob};
}

// Every row of c (rows x n, contiguous) = bias: a gemm with beta = 1 then adds the product, so
// the bias costs no pass of its own over the output.
template <typename T>
void fill_rows_with_bias(T* c, int64_t rows, int64_t n, const Tensor& bias) {
  const T* pb = bias.data<T>();
  const int64_t bs = bias.stride(0);
  parallel_for(0, rows, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(n, 1)),
               [&](int64_t b, int64_t e) {
                 for (int64_t i = b; i < e; ++i)
                   for (int64_t j = 0; j < n; ++j) c[i * n + j] = pb[j * bs];
               });
}

// c (m x n, contiguous) = op(a) @ op(b) (+ bias, when defined): oneDNN's f32 matmul where
// `onednn` and it runs (Note [f32 GEMM] in bf16_gemm.cpp), else the bias rows and BLAS on top.
// bias_c is bias made contiguous once by the caller.
template <typename T>
void product(const Matrix& ma, const Matrix& mb, int64_t m, int64_t n, int64_t k, const T* a,
             const T* b, const Tensor& bias, const Tensor& bias_c, bool onednn, T* c) {
  if constexpr (std::is_same_v<T, float>) {
    auto op = [](const float* p, const Matrix& x) {
      return F32Matrix{p, x.trans ? 1 : x.ld, x.trans ? x.ld : 1};
    };
    const float* pbias = bias_c.defined() ? bias_c.data<float>() : nullptr;
    if (onednn && f32_gemm_onednn(m, n, k, op(a, ma), op(b, mb), pbias, c, n)) return;
  }
  if (bias.defined()) fill_rows_with_bias(c, m, n, bias);
  gemm<T>(ma.trans, mb.trans, m, n, k, a, ma.ld, b, mb.ld, bias.defined() ? T(1) : T(0), c, n);
}

// f32 or f64: c = a @ b (+ bias), operands passed to BLAS or oneDNN as views (Note [BLAS
// operands]).
template <typename T>
void gemm_float(const Tensor& c, Tensor a, Tensor b, const Tensor& bias) {
  const int64_t m = c.size(-2), n = c.size(-1), k = a.size(-1);
  const Dims batch = batch_dims(c.shape());
  const int64_t nb = batch.numel();
  a = blas_ready(a).expand(with_matrix(batch, m, k));
  b = blas_ready(b).expand(with_matrix(batch, k, n));
  T* pc = c.data<T>();
  const Tensor bias_c = bias.defined() ? bias.contiguous() : bias;
  Matrix mb;
  blas_layout(b, &mb);

  // When b is the same matrix for every batch entry and a's batch dims merge into its rows,
  // the whole product is one (nb * m) x k times k x n gemm.
  bool b_shared = true;
  for (int64_t d = 0; d < batch.size(); ++d)
    b_shared = b_shared && (b.stride(d) == 0 || batch[d] == 1);
  if (b_shared) {
    // The rows of all of a's matrices are one evenly strided run when each non-trivial dim of
    // (batch..., m) steps over exactly the dims inside it.
    bool merge = true, first = true;
    int64_t rs = a.stride(-2), expected = 0;
    for (int64_t d = batch.size(); d >= 0; --d) {
      if (a.size(d) == 1) continue;
      if (first) {
        rs = a.stride(d);
        expected = rs * a.size(d);
        first = false;
      } else {
        merge = merge && a.stride(d) == expected;
        expected *= a.size(d);
      }
    }
    Matrix ma;
    if (merge && nb * m <= INT_MAX && blas_layout(nb * m, k, rs, a.stride(-1), &ma)) {
      product<T>(ma, mb, nb * m, n, k, a.data<T>(), b.data<T>(), bias, bias_c, true, pc);
      return;
    }
  }
  // One gemm per batch entry (Note [Batched GEMM threading]); small ones stay with BLAS, whose
  // per-call cost is lower.
  Matrix ma;
  blas_layout(a, &ma);
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  const int64_t flops = m * n * k;
  const bool small = flops < kSmallGemmFlops;
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [oa, ob] = batch_offsets(i, batch, a, b);
      product<T>(ma, mb, m, n, k, pa + oa, pb + ob, bias, bias_c, !small, pc + i * m * n);
    }
  };
  if (small && blas_runs_serially_in_parallel_regions()) {
    parallel_for(0, nb, std::max<int64_t>(1, kSmallGemmFlops / std::max<int64_t>(flops, 1)), run);
  } else {
    run(0, nb);
  }
}

// bf16 a and b into f32 c through oneDNN (Note [bf16 GEMM] in bf16_gemm.cpp), the bias (f32)
// folded in as the accumulator's start, or into a bf16 c, rounded once with the bias added
// before; false when oneDNN declines (c is then partly written).
bool gemm_bf16_operands(const Tensor& c, Tensor a, Tensor b, const Tensor& bias) {
  if (!bf16_gemm_available()) return false;
  const int64_t m = c.size(-2), n = c.size(-1), k = a.size(-1);
  if (k == 0) return false;  // oneDNN takes no empty products; the f32 path writes zeros
  const Dims batch = batch_dims(c.shape());
  const int64_t nb = batch.numel();
  a = blas_ready(a).expand(with_matrix(batch, m, k));
  b = blas_ready(b).expand(with_matrix(batch, k, n));
  Matrix ma, mb;
  blas_layout(a, &ma);
  blas_layout(b, &mb);
  const auto* pa = static_cast<const BFloat16*>(a.data_ptr());
  const auto* pb = static_cast<const BFloat16*>(b.data_ptr());
  if (c.dtype() == kBFloat16) {  // rounded by oneDNN (Note [bf16 GEMM])
    const Tensor bias_c = bias.defined() ? bias.contiguous() : bias;
    const float* pbias = bias_c.defined() ? bias_c.data<float>() : nullptr;
    auto* pc16 = static_cast<BFloat16*>(c.data_ptr());
    for (int64_t i = 0; i < nb; ++i) {
      const auto [oa, ob] = batch_offsets(i, batch, a, b);
      if (!gemm_bf16_out(ma.trans, mb.trans, m, n, k, pa + oa, ma.ld, pb + ob, mb.ld, pbias,
                         pc16 + i * m * n, n)) {
        return false;
      }
    }
    return true;
  }
  float* pc = c.data<float>();
  if (bias.defined()) fill_rows_with_bias(pc, nb * m, n, bias);
  for (int64_t i = 0; i < nb; ++i) {
    const auto [oa, ob] = batch_offsets(i, batch, a, b);
    if (!gemm_bf16(ma.trans, mb.trans, m, n, k, pa + oa, ma.ld, pb + ob, mb.ld, bias.defined(),
                   pc + i * m * n, n)) {
      return false;
    }
  }
  return true;
}

// A 16-bit operand as f32 in the same layout: a transposed operand (w.t() in linear) converts
// as its contiguous transpose, so the conversion reads and writes memory in order.
Tensor to_f32(const Tensor& t) {
  Matrix m;
  if (blas_layout(t, &m) && m.trans) return t.transpose(-1, -2).to(kFloat32).transpose(-1, -2);
  return t.to(kFloat32);
}

}  // namespace

void gemm_kernel(const Tensor& c, const Tensor& a, const Tensor& b, const Tensor& bias) {
  const char* op = "matmul";
  check_blas_size(c.size(-2), c.size(-1), a.size(-1), op);
  if (c.numel() == 0) return;
  switch (a.dtype()) {
    case DType::f32:
      return gemm_float<float>(c, a, b, bias);
    case DType::f64:
      return gemm_float<double>(c, a, b, bias);
    case DType::bf16:
      if (gemm_bf16_operands(c, a, b, bias)) return;
      [[fallthrough]];
    case DType::f16: {
      // No 16-bit kernel here: the rounded inputs convert exactly to f32, multiply there (into
      // an f32 copy of a bf16 c, rounded once at the end).
      if (c.dtype() == kFloat32) return gemm_float<float>(c, to_f32(a), to_f32(b), bias);
      const Tensor c32 = empty(c.shape(), kFloat32);
      gemm_float<float>(c32, to_f32(a), to_f32(b), bias);
      return copy_kernel(c, c32);
    }
    default:
      LS_THROW(op, ": dtype ", dtype_name(a.dtype()), " is not supported (expected f32, f64, ",
               "bf16 or f16)");
  }
}

#if LS_HAVE_AVX2
// acc[j] += row[j] for j < n: f32 into f64, 8 columns per step. Each column gets the same adds in
// the same order as the scalar loop below, so the same sums (it was 1.2% of an f32 train_gpt
// step: the loop with a runtime column stride stayed scalar).
LS_AVX2 void add_row_f32_to_f64(double* acc, const float* row, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(row + j);
    _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j),
                                            _mm256_cvtps_pd(_mm256_castps256_ps128(v))));
    _mm256_storeu_pd(acc + j + 4, _mm256_add_pd(_mm256_loadu_pd(acc + j + 4),
                                                _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))));
  }
  for (; j < n; ++j) acc[j] += static_cast<double>(row[j]);
}
#endif

// Parallel over column blocks, each summing all rows in row order, so the result does not
// depend on the thread count; rows are read along their contiguous direction. A bf16 or f16 g
// is read as it is into an f32 out: under autocast a Linear's output gradient is bf16, and
// converting all of it to f32 first cost as much as the sum.
void sum_rows_kernel(const Tensor& out, const Tensor& g) {
  auto run = [&]<typename In, typename Out>() {
    const int64_t rows = g.size(0), cols = g.size(1), rs = g.stride(0), cs = g.stride(1);
    const In* p = static_cast<const In*>(g.data_ptr());
    Out* o = out.data<Out>();
    const int64_t grain = std::max<int64_t>(64, kElementwiseGrain / std::max<int64_t>(rows, 1));
    parallel_for(0, cols, grain, [&](int64_t b, int64_t e) {
      std::vector<double> acc(static_cast<size_t>(e - b), 0.0);
#if LS_HAVE_AVX2
      if constexpr (std::is_same_v<In, float>) {
        if (cs == 1 && cpu_has_avx2()) {
          for (int64_t i = 0; i < rows; ++i) add_row_f32_to_f64(acc.data(), p + i * rs + b, e - b);
          for (int64_t j = b; j < e; ++j) o[j] = static_cast<Out>(acc[j - b]);
          return;
        }
      }
#endif
      for (int64_t i = 0; i < rows; ++i) {
        const In* row = p + i * rs;
        for (int64_t j = b; j < e; ++j) {
          if constexpr (std::is_same_v<In, BFloat16>) {
            // The bits shifted into place (bf16_bits_to_float), which the compiler vectorizes.
            const uint32_t u = static_cast<uint32_t>(row[j * cs].bits) << 16;
            acc[j - b] += static_cast<double>(std::bit_cast<float>(u));
          } else {
            acc[j - b] += static_cast<double>(static_cast<float>(row[j * cs]));
          }
        }
      }
      for (int64_t j = b; j < e; ++j) o[j] = static_cast<Out>(acc[j - b]);
    });
  };
  if (g.dtype() == kBFloat16 || g.dtype() == kFloat16) {
    LS_CHECK(out.dtype() == kFloat32, "linear backward: the column sums of a ",
             dtype_name(g.dtype()), " gradient go to f32, got ", dtype_name(out.dtype()));
    if (g.dtype() == kBFloat16) return run.template operator()<BFloat16, float>();
    return run.template operator()<Half, float>();
  }
  dispatch_float(g.dtype(), "linear backward",
                 [&]<typename T>() { run.template operator()<T, T>(); });
}

}  // namespace lockstep::cpu

namespace lockstep {

// Declared with matmul (lockstep/ops/linalg.h); a property of the CPU's gemm kernel.
std::string bf16_matmul_backend() {
  if (cpu::bf16_gemm_available()) return std::string("oneDNN ") + cpu::bf16_gemm_impl();
  return "convert to f32 + sgemm";
}

}  // namespace lockstep
