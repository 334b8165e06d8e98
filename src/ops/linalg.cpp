// Matrix products through BLAS: matmul (1-D, 2-D, batched with broadcast batch dims), linear
// with the bias fused into the product, and their gradients.
#include "lockstep/ops/linalg.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/tensor/parallel.h"
#include "ops/common.h"
#include "ops/cpu/bf16_gemm.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep {

using autograd::record;
using autograd::sum_to;
using autograd::TensorList;

namespace {

// Note [BLAS operands]
// Row-major BLAS reads a (rows x cols) matrix either as stored (NoTrans: element (i, j) at
// i * ld + j) or as the transpose of a stored (cols x rows) one (Trans: at i + j * ld). A strided
// view fits one of the two when one of its strides is 1 and the other is a valid leading
// dimension, which covers contiguous tensors and their .t() / .transpose(-1, -2) views, and
// row slices of either. Those go to BLAS as they are; anything else (an expanded matrix dim, a
// column step > 1 in both directions) is copied once first.

struct Matrix {
  const void* data = nullptr;
  CBLAS_TRANSPOSE trans = CblasNoTrans;
  int64_t ld = 1;
};

// Fills `out` with the BLAS view of a (rows x cols) matrix with strides (rs, cs); false when
// neither layout fits. Strides of size-1 dims are never used, so they are free.
bool blas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, Matrix* out) {
  const int64_t min_row_ld = std::max<int64_t>(1, cols), min_col_ld = std::max<int64_t>(1, rows);
  if ((cs == 1 || cols <= 1) && (rows <= 1 || rs >= min_row_ld)) {
    out->trans = CblasNoTrans;
    out->ld = rows <= 1 ? min_row_ld : rs;
  } else if ((rs == 1 || rows <= 1) && (cols <= 1 || cs >= min_col_ld)) {
    out->trans = CblasTrans;
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

void check_blas_size(int64_t m, int64_t n, int64_t k, const char* op) {
  LS_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX, op, ": matrix sizes (", m, ", ", n, ", ",
           k, ") exceed what BLAS takes (", INT_MAX, ")");
}

// c (m x n, row-major, leading dim ldc) = a @ b + beta * c; a is (m x k), b is (k x n).
template <typename T>
void gemm(int64_t m, int64_t n, int64_t k, const Matrix& a, const Matrix& b, T beta, T* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS may not touch C at all for k == 0; the product is zero
    if (beta == T(0))
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, T(0));
    return;
  }
  const auto M = static_cast<blasint>(m), N = static_cast<blasint>(n), K = static_cast<blasint>(k);
  const auto lda = static_cast<blasint>(a.ld), ldb = static_cast<blasint>(b.ld);
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, a.trans, b.trans, M, N, K, 1.0f, static_cast<const float*>(a.data),
                lda, static_cast<const float*>(b.data), ldb, beta, c, static_cast<blasint>(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, a.trans, b.trans, M, N, K, 1.0, static_cast<const double*>(a.data),
                lda, static_cast<const double*>(b.data), ldb, beta, c, static_cast<blasint>(ldc));
  }
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

// Leading (batch) dims of a tensor of at least 2 dims.
Dims batch_dims(const Dims& shape) {
  Dims out;
  for (int64_t d = 0; d + 2 < shape.size(); ++d) out.push_back(shape[d]);
  return out;
}

Dims with_matrix(Dims batch, int64_t rows, int64_t cols) {
  batch.push_back(rows);
  batch.push_back(cols);
  return batch;
}

void check_matmul_args(const Tensor& a, const Tensor& b, const char* op) {
  detail::check_cpu(a, op);
  detail::check_cpu(b, op);
  detail::check_same_device(a, b, op);
  LS_CHECK(a.dim() >= 1 && b.dim() >= 1, op, ": both arguments need at least 1 dimension, got ",
           a.shape().str(), " and ", b.shape().str());
  LS_CHECK(a.dtype() == b.dtype(), op, ": dtypes ", dtype_name(a.dtype()), " and ",
           dtype_name(b.dtype()), " differ (shapes ", a.shape().str(), " and ", b.shape().str(),
           "); convert one with .to()");
  LS_CHECK(is_floating(a.dtype()), op,
           ": expected floating-point tensors (f32, f64, bf16, f16), got ", dtype_name(a.dtype()));
  const int64_t ka = a.size(-1), kb = b.dim() == 1 ? b.size(0) : b.size(-2);
  LS_CHECK(ka == kb, op, ": shapes ", a.shape().str(), " and ", b.shape().str(),
           " cannot be multiplied (", ka, " != ", kb, ")");
}

// a (..., m, k) @ b (..., k, n) -> (batch..., m, n) with broadcast batch dims, in f32 or f64,
// no autograd. The operands are passed to BLAS as views (Note [BLAS operands]).
// The broadcast batch dims of a (..., m, k) @ b (..., k, n).
Dims broadcast_batch(const Tensor& a, const Tensor& b, const char* op) {
  const Dims ab = batch_dims(a.shape()), bb = batch_dims(b.shape());
  Dims batch;
  const int64_t nd = std::max(ab.size(), bb.size());
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t da = i - (nd - ab.size()) >= 0 ? ab[i - (nd - ab.size())] : 1;
    const int64_t db = i - (nd - bb.size()) >= 0 ? bb[i - (nd - bb.size())] : 1;
    LS_CHECK(da == db || da == 1 || db == 1, op, ": batch dimensions of shapes ", a.shape().str(),
             " and ", b.shape().str(), " cannot be broadcast (", da, " vs ", db,
             " at batch dimension ", i, ")");
    batch.push_back(da == 1 ? db : da);
  }
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

// A BLAS-layout bf16 operand (Note [BLAS operands]) as oneDNN strides.
cpu::Bf16Matrix as_bf16(const Tensor& t, const Matrix& m, int64_t offset = 0) {
  cpu::Bf16Matrix r;
  r.data = static_cast<const uint16_t*>(t.data_ptr()) + offset;
  r.rs = m.trans == CblasNoTrans ? m.ld : 1;
  r.cs = m.trans == CblasNoTrans ? 1 : m.ld;
  return r;
}

// bf16 (..., m, k) @ (..., k, n) through oneDNN (Note [bf16 GEMM] in src/ops/cpu/bf16_gemm.cpp),
// accumulated and returned in f32; undefined when oneDNN declines, and the caller converts.
Tensor bmm_bf16(Tensor a, Tensor b, const char* op) {
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  const Dims batch = broadcast_batch(a, b, op);
  check_blas_size(m, n, k, op);
  if (m == 0 || n == 0 || k == 0) return Tensor();
  Tensor out = empty(with_matrix(batch, m, n), kFloat32);
  a = blas_ready(a).expand(with_matrix(batch, m, k));
  b = blas_ready(b).expand(with_matrix(batch, k, n));
  Matrix ma, mb;
  blas_layout(a, &ma);
  blas_layout(b, &mb);
  float* c = out.data<float>();
  const int64_t nb = batch.numel();
  for (int64_t i = 0; i < nb; ++i) {
    const auto [oa, ob] = batch_offsets(i, batch, a, b);
    if (!cpu::bf16_gemm(m, n, k, as_bf16(a, ma, oa), as_bf16(b, mb, ob), c + i * m * n, n, false)) {
      return Tensor();
    }
  }
  return out;
}

template <typename T>
Tensor bmm_kernel(Tensor a, Tensor b, const char* op) {
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  const Dims batch = broadcast_batch(a, b, op);
  check_blas_size(m, n, k, op);
  Tensor out = empty(with_matrix(batch, m, n), dtype_of<T>::value);
  const int64_t nb = batch.numel();
  if (out.numel() == 0) return out;
  a = blas_ready(a).expand(with_matrix(batch, m, k));
  b = blas_ready(b).expand(with_matrix(batch, k, n));
  T* c = out.data<T>();
  Matrix mb;
  mb.data = b.data_ptr();
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
    ma.data = a.data_ptr();
    if (merge && nb * m <= INT_MAX && blas_layout(nb * m, k, rs, a.stride(-1), &ma)) {
      gemm<T>(nb * m, n, k, ma, mb, T(0), c, n);
      return out;
    }
  }
  // One gemm per batch entry (Note [Batched GEMM threading]).
  Matrix ma0;
  blas_layout(a, &ma0);
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  auto run = [&](int64_t begin, int64_t end) {
    Matrix ma = ma0, mbi = mb;
    for (int64_t i = begin; i < end; ++i) {
      const auto [oa, ob] = batch_offsets(i, batch, a, b);
      ma.data = pa + oa;
      mbi.data = pb + ob;
      gemm<T>(m, n, k, ma, mbi, T(0), c + i * m * n, n);
    }
  };
  const int64_t flops = m * n * k;
  if (flops < kSmallGemmFlops && blas_runs_serially_in_parallel_regions()) {
    cpu::parallel_for(0, nb, std::max<int64_t>(1, kSmallGemmFlops / std::max<int64_t>(flops, 1)),
                      run);
  } else {
    run(0, nb);
  }
  return out;
}

// matmul's value without autograd; a and b are checked, detached and of one floating dtype.
Tensor matmul_nograd(const Tensor& a, const Tensor& b, const char* op = "matmul") {
  const DType dt = a.dtype();
  const Tensor a2 = a.dim() == 1 ? a.unsqueeze(0) : a;  // (1, k)
  const Tensor b2 = b.dim() == 1 ? b.unsqueeze(1) : b;  // (k, 1)
  Tensor out;
  if (dt == kBFloat16 && cpu::bf16_gemm_available()) {
    out = bmm_bf16(a2, b2, op);
    if (out.defined()) out = out.to(kBFloat16);
  }
  if (!out.defined() && is_half(dt)) {
    // No bf16 kernel (or f16): convert, multiply in f32, round once.
    out = matmul_nograd(a2.to(kFloat32), b2.to(kFloat32), op).to(dt);
  }
  if (!out.defined()) {
    out = cpu::dispatch_float(dt, op, [&]<typename T>() { return bmm_kernel<T>(a2, b2, op); });
  }
  if (a.dim() > 1 && b.dim() > 1) return out;
  Dims shape = batch_dims(out.shape());
  if (a.dim() > 1) shape.push_back(a.size(-2));
  if (b.dim() > 1) shape.push_back(b.size(-1));
  return out.view(shape);
}

// Gradients of matmul for the inputs that need them; a and b detached.
TensorList matmul_backward(const Tensor& g, const Tensor& a, const Tensor& b, bool need_a,
                           bool need_b) {
  const Tensor a2 = a.dim() == 1 ? a.unsqueeze(0) : a;  // (..., m, k)
  const Tensor b2 = b.dim() == 1 ? b.unsqueeze(1) : b;  // (..., k, n)
  const int64_t m = a2.size(-2), k = a2.size(-1), n = b2.size(-1);
  // The forward's (batch..., m, n) shape: batch dims broadcast, so take the larger size.
  const int64_t nd = std::max(a2.dim(), b2.dim());
  Dims gshape = Dims::filled(nd, 1);
  for (int64_t i = 0; i + 2 < nd; ++i) {
    const int64_t ia = i - (nd - a2.dim()), ib = i - (nd - b2.dim());
    gshape[i] = std::max(ia >= 0 ? a2.size(ia) : 1, ib >= 0 ? b2.size(ib) : 1);
  }
  gshape[nd - 2] = m;
  gshape[nd - 1] = n;
  const Tensor g2 = g.reshape(gshape);
  Tensor ga, gb;
  if (need_a) {
    // dA = dC @ B^T, summed over the dims A was broadcast along.
    ga = sum_to(matmul_nograd(g2, b2.transpose(-1, -2)), a2.shape()).reshape(a.shape());
  }
  if (need_b) {
    if (b2.dim() == 2 && g2.dim() > 2) {
      // B was shared by every batch entry: dB = A^T @ dC with the batch folded into the rows,
      // one gemm instead of a batched product and a sum.
      const Tensor af = a2.expand(with_matrix(batch_dims(gshape), m, k)).reshape({-1, k});
      gb = matmul_nograd(af.t(), g2.reshape({-1, n}));
    } else {
      gb = sum_to(matmul_nograd(a2.transpose(-1, -2), g2), b2.shape());
    }
    gb = gb.reshape(b.shape());
  }
  return {ga, gb};
}

// Sums the rows of a (rows x cols) matrix into `out` (cols), accumulating in double; parallel
// over column blocks, so the order of additions (and the result) does not depend on threads.
template <typename T>
void sum_rows(const Tensor& g, T* out) {
  const int64_t rows = g.size(0), cols = g.size(1), rs = g.stride(0), cs = g.stride(1);
  const T* p = g.data<T>();
  const int64_t grain = std::max<int64_t>(64, cpu::kElementwiseGrain / std::max<int64_t>(rows, 1));
  cpu::parallel_for(0, cols, grain, [&](int64_t b, int64_t e) {
    std::vector<double> acc(static_cast<size_t>(e - b), 0.0);
    for (int64_t i = 0; i < rows; ++i) {
      const T* row = p + i * rs;
      for (int64_t j = b; j < e; ++j) acc[j - b] += static_cast<double>(row[j * cs]);
    }
    for (int64_t j = b; j < e; ++j) out[j] = static_cast<T>(acc[j - b]);
  });
}

// linear's value without autograd; inputs checked and detached.
// bf16 linear through oneDNN, the bias folded in as the f32 accumulator's start; undefined when
// oneDNN declines.
Tensor linear_bf16(const Tensor& x, const Tensor& w, const Tensor& bias) {
  const int64_t in = w.size(1), out_f = w.size(0);
  Dims out_shape = x.shape();
  out_shape[out_shape.size() - 1] = out_f;
  const int64_t rows = x.numel() / std::max<int64_t>(in, 1);
  if (rows == 0 || in == 0 || out_f == 0) return Tensor();
  check_blas_size(rows, out_f, in, "linear");
  const Tensor x2 = blas_ready(x.reshape({rows, in}));  // (M, in)
  const Tensor wt = blas_ready(w.t());                  // (in, out)
  Tensor y = empty({rows, out_f}, kFloat32);
  float* c = y.data<float>();
  if (bias.defined()) {
    const Tensor bf = bias.to(kFloat32).contiguous();
    const float* pb = bf.data<float>();
    cpu::parallel_for(0, rows,
                      std::max<int64_t>(1, cpu::kElementwiseGrain / std::max<int64_t>(out_f, 1)),
                      [&](int64_t b, int64_t e) {
                        for (int64_t i = b; i < e; ++i) std::copy(pb, pb + out_f, c + i * out_f);
                      });
  }
  Matrix ma, mb;
  blas_layout(x2, &ma);
  blas_layout(wt, &mb);
  if (!cpu::bf16_gemm(rows, out_f, in, as_bf16(x2, ma), as_bf16(wt, mb), c, out_f,
                      bias.defined())) {
    return Tensor();
  }
  return y.to(kBFloat16).view(out_shape);
}

Tensor linear_nograd(const Tensor& x, const Tensor& w, const Tensor& bias) {
  const DType dt = x.dtype();
  if (dt == kBFloat16 && cpu::bf16_gemm_available()) {
    Tensor y = linear_bf16(x, w, bias);
    if (y.defined()) return y;
  }
  if (is_half(dt)) {
    return linear_nograd(x.to(kFloat32), w.to(kFloat32), bias.defined() ? bias.to(kFloat32) : bias)
        .to(dt);
  }
  const int64_t in = w.size(1), out_f = w.size(0);
  Dims out_shape = x.shape();
  out_shape[out_shape.size() - 1] = out_f;
  Dims lead = out_shape;
  lead.erase(lead.size() - 1);
  const int64_t rows = lead.numel();
  const Tensor x2 = blas_ready(x.reshape({rows, in}));  // (M, in)
  const Tensor wt = blas_ready(w.t());                  // (in, out), w's transpose as a view
  check_blas_size(rows, out_f, in, "linear");
  Tensor y = empty({rows, out_f}, dt);  // (M, out)
  cpu::dispatch_float(dt, "linear", [&]<typename T>() {
    T* c = y.data<T>();
    if (bias.defined()) {
      // C starts as the broadcast bias and the gemm adds x @ w^T to it (beta = 1): the bias
      // costs no pass of its own over the output.
      const T* pb = bias.data<T>();
      const int64_t bs = bias.stride(0);
      cpu::parallel_for(0, rows,
                        std::max<int64_t>(1, cpu::kElementwiseGrain / std::max<int64_t>(out_f, 1)),
                        [&](int64_t b, int64_t e) {
                          for (int64_t i = b; i < e; ++i)
                            for (int64_t j = 0; j < out_f; ++j) c[i * out_f + j] = pb[j * bs];
                        });
    }
    Matrix ma, mb;
    blas_layout(x2, &ma);
    blas_layout(wt, &mb);
    ma.data = x2.data_ptr();
    mb.data = wt.data_ptr();
    gemm<T>(rows, out_f, in, ma, mb, bias.defined() ? T(1) : T(0), c, out_f);
  });
  return y.view(out_shape);
}

// Column sums of g2 (M x out) -> (out), for the bias gradient.
Tensor bias_grad(const Tensor& g2) {
  const DType dt = g2.dtype();
  if (is_half(dt)) return bias_grad(g2.to(kFloat32)).to(dt);
  Tensor out = empty({g2.size(1)}, dt);
  cpu::dispatch_float(dt, "linear_backward", [&]<typename T>() { sum_rows<T>(g2, out.data<T>()); });
  return out;
}

}  // namespace

std::string bf16_matmul_backend() {
  if (cpu::bf16_gemm_available()) return std::string("oneDNN ") + cpu::bf16_gemm_impl();
  return "convert to f32 + sgemm";
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  LS_AUTOCAST("matmul", matmul, a, b);
  check_matmul_args(a, b, "matmul");
  Tensor out = matmul_nograd(a.detach(), b.detach());
  record("MatmulBackward", {a, b}, out,
         [ad = a.detach(), bd = b.detach(), ra = a.requires_grad(), rb = b.requires_grad()](
             const TensorList& g) { return matmul_backward(g[0], ad, bd, ra, rb); });
  return out;
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  LS_AUTOCAST("linear", linear, x, w, b);
  detail::check_cpu(x, "linear");
  detail::check_cpu(w, "linear");
  detail::check_same_device(x, w, "linear");
  LS_CHECK(w.dim() == 2, "linear: weight must be 2-D (out_features, in_features), got shape ",
           w.shape().str());
  LS_CHECK(x.dim() >= 1, "linear: input must have at least 1 dimension, got shape ",
           x.shape().str());
  LS_CHECK(x.size(-1) == w.size(1), "linear: shapes ", x.shape().str(), " and ", w.shape().str(),
           " cannot be multiplied (", x.size(-1), " != ", w.size(1),
           "; weight is (out_features, in_features))");
  LS_CHECK(x.dtype() == w.dtype(), "linear: dtypes ", dtype_name(x.dtype()), " and ",
           dtype_name(w.dtype()), " of input and weight differ; convert one with .to()");
  LS_CHECK(is_floating(x.dtype()), "linear: expected floating-point tensors, got ",
           dtype_name(x.dtype()));
  if (b.defined()) {
    detail::check_same_device(x, b, "linear");
    LS_CHECK(b.dim() == 1 && b.size(0) == w.size(0), "linear: bias of shape ", b.shape().str(),
             " does not match weight of shape ", w.shape().str(), " (expected [", w.size(0), "])");
    LS_CHECK(b.dtype() == x.dtype(), "linear: bias dtype ", dtype_name(b.dtype()),
             " differs from input dtype ", dtype_name(x.dtype()));
  }
  const Tensor xd = x.detach(), wd = w.detach();
  Tensor out = linear_nograd(xd, wd, b.defined() ? b.detach() : Tensor());
  record("LinearBackward", {x, w, b}, out,
         [xd, wd, rx = x.requires_grad(), rw = w.requires_grad(),
          rb = b.defined() && b.requires_grad()](const TensorList& g) {
           const int64_t in = wd.size(1), out_f = wd.size(0);
           Dims lead = xd.shape();
           lead.erase(lead.size() - 1);
           const int64_t rows = lead.numel();
           const Tensor g2 = g[0].reshape({rows, out_f});  // (M, out)
           TensorList grads(3);
           // dx = g @ w, dw = g^T @ x (transposes as BLAS flags), db = column sums of g.
           if (rx) grads[0] = matmul_nograd(g2, wd, "linear").reshape(xd.shape());
           if (rw) grads[1] = matmul_nograd(g2.t(), xd.reshape({rows, in}), "linear");
           if (rb) grads[2] = bias_grad(g2);
           return grads;
         });
  return out;
}

}  // namespace lockstep
