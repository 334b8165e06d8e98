// matmul (1-D, 2-D, batched with broadcast batch dims) and linear with the bias fused into the
// product: checks, shapes and gradients. Every product runs in the device's gemm kernel
// (src/ops/cpu/gemm.cpp on the CPU; Note [Kernel tables] in src/ops/kernels.h).
#include "lockstep/ops/linalg.h"

#include <algorithm>

#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/reduce.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;
using detail::Kernels;

namespace {

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

// Rows of x (..., in) as a matrix: the product of its leading dims.
int64_t leading_rows(const Tensor& x) {
  Dims lead = x.shape();
  lead.erase(lead.size() - 1);
  return lead.numel();
}

// The dtype the gemm kernel accumulates and returns the product in: f32 for 16-bit floats.
DType product_dtype(DType dt) { return is_half(dt) ? kFloat32 : dt; }

// The dtype the gemm kernel writes for operands of `t`'s dtype: the CPU's takes a bf16 output
// and rounds it itself (Note [bf16 GEMM] in src/ops/cpu/bf16_gemm.cpp); others write f32 for
// 16-bit operands, rounded afterwards.
DType gemm_out_dtype(const Tensor& t) {
  return t.dtype() == kBFloat16 && t.device().is_cpu() ? kBFloat16 : product_dtype(t.dtype());
}

void check_matmul_args(const Tensor& a, const Tensor& b, const char* op) {
  detail::check_defined(a, op);
  detail::check_defined(b, op);
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

// matmul's value without autograd; a and b are checked, detached and of one floating dtype.
// This is matmul's one kernel call (Note [Kernel tables] in src/ops/kernels.h); 16-bit floats
// come back from the kernel in f32 and are rounded once.
Tensor matmul_nograd(const Tensor& a, const Tensor& b, const char* op = "matmul") {
  const auto gemm = detail::kernel(&Kernels::gemm, a.device(), op);
  const Tensor a2 = a.dim() == 1 ? a.unsqueeze(0) : a;  // (1, k)
  const Tensor b2 = b.dim() == 1 ? b.unsqueeze(1) : b;  // (k, 1)
  const Dims batch = broadcast_batch(a2, b2, op);
  Tensor out = empty(with_matrix(batch, a2.size(-2), b2.size(-1)),
                     detail::options_on(a, gemm_out_dtype(a)));
  gemm(out, a2, b2, Tensor());
  if (out.dtype() != a.dtype()) out = out.to(a.dtype());
  if (a.dim() > 1 && b.dim() > 1) return out;
  Dims shape = batch;
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

// linear's value without autograd; inputs checked and detached. The bias starts the kernel's
// accumulator, so it costs no pass of its own over the output.
Tensor linear_nograd(const Tensor& x, const Tensor& w, const Tensor& bias) {
  const auto gemm = detail::kernel(&Kernels::gemm, x.device(), "linear");
  const DType pt = product_dtype(x.dtype());
  const int64_t in = w.size(1), out_f = w.size(0);
  Dims out_shape = x.shape();
  out_shape[out_shape.size() - 1] = out_f;
  const int64_t rows = leading_rows(x);
  Tensor y = empty({rows, out_f}, detail::options_on(x, gemm_out_dtype(x)));  // (M, out)
  // (M, in) @ (in, out), w's transpose as a view.
  gemm(y, x.reshape({rows, in}), w.t(), bias.defined() ? bias.to(pt) : bias);
  if (y.dtype() != x.dtype()) y = y.to(x.dtype());
  return y.view(out_shape);
}

// Column sums of g2 (M x out) -> (out), for linear's bias gradient; 16-bit floats sum in f32
// (the CPU kernel reads them as they are, the CUDA one from an f32 copy).
Tensor bias_grad(const Tensor& g2) {
  const auto sum_rows = detail::kernel(&Kernels::sum_rows, g2.device(), "linear");
  const DType pt = product_dtype(g2.dtype());
  Tensor out = empty({g2.size(1)}, detail::options_on(g2, pt));
  sum_rows(out, g2.device().is_cpu() ? g2 : g2.to(pt));
  return pt == g2.dtype() ? out : out.to(g2.dtype());
}

}  // namespace

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
  detail::check_defined(x, "linear");
  detail::check_defined(w, "linear", "weight");
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
           const int64_t rows = leading_rows(xd);
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
