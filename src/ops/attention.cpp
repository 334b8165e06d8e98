// scaled_dot_product_attention: checks, dtypes and the backward it records; the device's kernels
// compute it tile by tile (src/ops/cpu/attention.cpp).
#include "lockstep/ops/attention.h"

#include <cmath>
#include <cstdint>
#include <memory>

#include "lockstep/autograd/node.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;
using detail::Kernels;

// Note [Fused attention]
// softmax(q k^T * scale) v, composed of matmul, softmax and matmul, holds the (T, T) scores and
// probabilities of every head, and its backward keeps the probabilities until it runs: at
// GPT-2's T = 1024 and 12 heads that is 48 MiB per sequence per layer, more than the rest of
// the layer's activations. The fused op never forms them. Its forward walks a head's keys in
// tiles of 64 (FlashAttention's online softmax): for each tile of query rows it keeps the
// running max m and sum of exponentials l of every row, rescales the partial output when m
// grows, and adds the tile's exp(s - m) v; at the end it divides by l and saves
// lse = m + log(l) per row, one number per query instead of a row of probabilities. The
// backward recomputes each tile's probabilities as exp(s - lse), exactly those the forward
// normalized, and needs besides only delta = rowsum(g * out), since
// d(scores) = p * (dp - delta) with dp = g v^T. A causal mask never computes the tiles above
// the diagonal, so the causal op does about half the work of the full one. All the tile
// products go to BLAS, which is what lets the op run near GEMM speed.
//
// Under autocast the op is left alone (it is not in the table of src/ops/autocast.cpp, so it
// takes its inputs as they come): q, k, v from bf16 linears arrive in bf16 and the kernels
// compute in f32, returning bf16.

namespace {

struct AttentionSaved {
  Tensor q, k, v, out;  // (N, T, D), contiguous, compute dtype
  Tensor lse;           // (N, Tq)
  Dims q_shape, k_shape, v_shape;
  double scale = 0;
  bool causal = false;
};

constexpr const char* kOp = "scaled_dot_product_attention";

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  detail::check_defined(q, kOp, "q");
  detail::check_defined(k, kOp, "k");
  detail::check_defined(v, kOp, "v");
  detail::check_same_device(q, k, kOp);
  detail::check_same_device(q, v, kOp);
  LS_CHECK(is_floating(q.dtype()), kOp, ": expected floating-point q, k, v, got ",
           dtype_name(q.dtype()));
  LS_CHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype(), kOp,
           ": expected q, k, v of one dtype, got ", dtype_name(q.dtype()), ", ",
           dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  LS_CHECK(q.dim() >= 3 && k.dim() == q.dim() && v.dim() == q.dim(), kOp,
           ": expected q, k, v of shape (..., T, D) with the same number (>= 3) of dims, got ",
           q.shape().str(), ", ", k.shape().str(), ", ", v.shape().str());
  for (int64_t d = 0; d < q.dim() - 2; ++d)
    LS_CHECK(k.size(d) == q.size(d) && v.size(d) == q.size(d), kOp,
             ": expected q, k, v with the same leading (batch, head) dims, got ", q.shape().str(),
             ", ", k.shape().str(), ", ", v.shape().str());
  LS_CHECK(k.size(-1) == q.size(-1), kOp, ": expected k's last dim to be q's (", q.size(-1),
           "), got ", k.size(-1));
  LS_CHECK(v.size(-2) == k.size(-2), kOp, ": expected as many values as keys (", k.size(-2),
           "), got ", v.size(-2));
  LS_CHECK(q.size(-1) >= 1, kOp, ": expected a head dim of at least 1, got ", q.size(-1));
  LS_CHECK(k.size(-2) >= 1 || q.size(-2) == 0, kOp, ": expected at least one key for ", q.size(-2),
           " queries, got none");
  LS_CHECK(!causal || q.size(-2) == k.size(-2), kOp,
           ": is_causal expects as many queries as keys, got ", q.size(-2), " and ", k.size(-2));
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& opts) {
  check_inputs(q, k, v, opts.is_causal);
  const auto forward = detail::kernel(&Kernels::attention, q.device(), kOp);
  const DType dt = q.dtype();
  const DType ct = is_half(dt) ? kFloat32 : dt;
  const int64_t tq = q.size(-2), d = q.size(-1), dv = v.size(-1);
  int64_t heads = 1;  // every leading dim: batch, heads, ...
  for (int64_t i = 0; i < q.dim() - 2; ++i) heads *= q.size(i);
  auto flat = [ct, heads](const Tensor& t) {
    return t.detach().to(ct).contiguous().reshape({heads, t.size(-2), t.size(-1)});
  };

  auto s = std::make_shared<AttentionSaved>();
  s->q = flat(q);
  s->k = flat(k);
  s->v = flat(v);
  s->q_shape = q.shape();
  s->k_shape = k.shape();
  s->v_shape = v.shape();
  s->scale = opts.scale != 0.0 ? opts.scale : 1.0 / std::sqrt(static_cast<double>(d));
  s->causal = opts.is_causal;
  const auto o = detail::options_on(q, ct);
  s->out = empty({heads, tq, dv}, o);
  s->lse = empty({heads, tq}, o);
  forward(s->out, s->lse, s->q, s->k, s->v, s->scale, s->causal);
  Dims out_shape = q.shape();
  out_shape[out_shape.size() - 1] = dv;
  Tensor y = s->out.view(out_shape).to(dt);

  record("ScaledDotProductAttentionBackward", {q, k, v}, y,
         [s, dt, rq = q.requires_grad(), rk = k.requires_grad(),
          rv = v.requires_grad()](const TensorList& g) {
           const auto backward = detail::kernel(&Kernels::attention_backward, s->q.device(), kOp);
           const auto o = detail::options_on(s->q, s->q.dtype());
           const Tensor gc = g[0].to(s->q.dtype()).contiguous().reshape(s->out.shape());
           Tensor dq = empty(s->q.shape(), o), dk = empty(s->k.shape(), o),
                  dv = empty(s->v.shape(), o);
           backward(dq, dk, dv, gc, s->q, s->k, s->v, s->out, s->lse, s->scale, s->causal);
           auto back = [dt](bool wanted, const Tensor& t, const Dims& shape) {
             return wanted ? t.view(shape).to(dt) : Tensor();
           };
           return TensorList{back(rq, dq, s->q_shape), back(rk, dk, s->k_shape),
                             back(rv, dv, s->v_shape)};
         });
  return y;
}

}  // namespace lockstep
