// scaled_dot_product_attention: checks, dtypes and the backward it records; the device's kernels
// compute it tile by tile (src/ops/cpu/attention.cpp, src/ops/cuda/attention.cu).
#include "lockstep/ops/attention.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "lockstep/autograd/node.h"
#include "lockstep/tensor/tensor_impl.h"
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
// Note [Strided attention inputs]
// A GPT's q, k, v are views of one projection: (B, T, 3, H, D) memory read as three (B, H, T, D)
// tensors (unbind, then transpose), whose rows are 3C apart and whose heads start D apart. The
// kernels take such views as they are: every head's rows at one stride, each row contiguous,
// head offsets from the leading dims' strides. (Copying the three contiguous was 3.3% of an f32
// train_gpt step, with the copy of the output below.) The output, and the gradients of q, k
// and v, are allocated with their dims in memory in q's order (by stride): for those views that
// is (B, T, H, D), so the model's transpose back to (B, T, C) is already contiguous and costs
// no copy, and the gradients reach unbind's backward in rows of C. Inputs whose last dim is not
// contiguous, or whose rows overlap, are copied first. When q, k and v are such sibling views
// (one storage, one shape and strides, k and v at equal steps past q) and all three need a
// gradient, dq, dk and dv are the same views of one new buffer laid out like the projection, so
// unbind's backward finds its input's whole gradient already in place and copies nothing (Note
// [unbind's backward]).
//
// Under autocast the op is left alone (it is not in the table of src/ops/autocast.cpp, so it
// takes its inputs as they come): q, k, v from bf16 linears arrive in bf16 and the kernels
// compute in f32, returning bf16.

namespace {

struct AttentionSaved {
  // (..., T, D) each, rows contiguous (Note [Strided attention inputs]), compute dtype.
  Tensor q, k, v, out;
  Tensor lse;  // (N, Tq)
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

// t detached, in the compute dtype, as the kernels read it: rows of contiguous elements at one
// stride that does not overlap them; a copy only where t is not such a view.
Tensor kernel_input(const Tensor& t, DType ct) {
  Tensor x = t.detach().to(ct);
  const bool rows_ok = x.stride(-1) == 1 || x.size(-1) <= 1;
  const bool ld_ok = x.size(-2) <= 1 || (x.stride(-2) >= x.size(-1) && x.stride(-2) <= INT_MAX);
  return rows_ok && ld_ok ? x : x.contiguous();
}

// An empty tensor of like's shape but for the last dim, `last`, whose dims lie in memory in the
// order of like's strides, largest first, the last dim innermost (Note [Strided attention
// inputs]); contiguous for a contiguous `like`.
Tensor empty_in_order_of(const Tensor& like, int64_t last, const TensorOptions& o) {
  const int64_t nd = like.dim();
  if (like.is_contiguous()) {
    Dims shape = like.shape();
    shape[nd - 1] = last;
    return empty(shape, o);
  }
  // Size-1 dims outermost (where they lie does not matter), then the others by stride.
  std::vector<int64_t> order, rest;
  for (int64_t d = 0; d < nd - 1; ++d) (like.size(d) == 1 ? order : rest).push_back(d);
  std::stable_sort(rest.begin(), rest.end(),
                   [&](int64_t a, int64_t b) { return like.stride(a) > like.stride(b); });
  order.insert(order.end(), rest.begin(), rest.end());
  order.push_back(nd - 1);
  Dims mem_shape, inverse = Dims::filled(nd, 0);
  for (int64_t j = 0; j < nd; ++j) {
    mem_shape.push_back(order[j] == nd - 1 ? last : like.size(order[j]));
    inverse[order[j]] = j;
  }
  return empty(mem_shape, o).permute(inverse);
}

// dq, dk, dv as views of one new buffer with q's, k's and v's strides and relative offsets,
// when q, k, v are sibling views of one storage (Note [Strided attention inputs]); false (and
// nothing set) otherwise.
bool sibling_gradients(const Tensor& q, const Tensor& k, const Tensor& v, Tensor* dq, Tensor* dk,
                       Tensor* dv) {
  if (q.storage() != k.storage() || q.storage() != v.storage()) return false;
  if (k.shape() != q.shape() || v.shape() != q.shape()) return false;
  if (k.strides() != q.strides() || v.strides() != q.strides()) return false;
  const int64_t step = k.offset() - q.offset();
  if (step <= 0 || v.offset() - k.offset() != step) return false;
  // The three views must not share an element: (size, stride) of q's dims and of a dim of 3
  // at `step`, sorted by stride, each stride past the extent of the one before (unbind's views
  // of one tensor are so).
  std::vector<std::pair<int64_t, int64_t>> dims{{3, step}};
  int64_t last = 0;  // the offset of q's last element from its first
  for (int64_t d = 0; d < q.dim(); ++d) {
    if (q.size(d) == 0 || q.stride(d) < 0) return false;
    if (q.size(d) > 1) dims.push_back({q.size(d), q.stride(d)});
    last += (q.size(d) - 1) * q.stride(d);
  }
  std::sort(dims.begin(), dims.end(), [](auto& a, auto& b) { return a.second < b.second; });
  for (size_t i = 1; i < dims.size(); ++i)
    if (dims[i].second < dims[i - 1].first * dims[i - 1].second) return false;
  const Tensor buf = empty({2 * step + last + 1}, detail::options_on(q, q.dtype()));
  auto view = [&](int64_t at) {
    return Tensor(std::make_shared<TensorImpl>(buf.storage(), q.shape(), q.strides(),
                                               buf.offset() + at, q.dtype()));
  };
  *dq = view(0);
  *dk = view(step);
  *dv = view(2 * step);
  return true;
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

  auto s = std::make_shared<AttentionSaved>();
  s->q = kernel_input(q, ct);
  s->k = kernel_input(k, ct);
  s->v = kernel_input(v, ct);
  s->scale = opts.scale != 0.0 ? opts.scale : 1.0 / std::sqrt(static_cast<double>(d));
  s->causal = opts.is_causal;
  const auto o = detail::options_on(q, ct);
  s->out = empty_in_order_of(s->q, dv, o);
  s->lse = empty({heads, tq}, o);
  forward(s->out, s->lse, s->q, s->k, s->v, s->scale, s->causal);
  // A handle of its own for the result (the closure below must not hold its own output).
  Tensor y = s->out.detach().to(dt);

  record("ScaledDotProductAttentionBackward", {q, k, v}, y,
         [s, dt, rq = q.requires_grad(), rk = k.requires_grad(),
          rv = v.requires_grad()](const TensorList& g) {
           const auto backward = detail::kernel(&Kernels::attention_backward, s->q.device(), kOp);
           const DType ct = s->q.dtype();
           const auto o = detail::options_on(s->q, ct);
           const Tensor gc = kernel_input(g[0], ct);
           Tensor dq, dk, dv;
           if (!(rq && rk && rv && sibling_gradients(s->q, s->k, s->v, &dq, &dk, &dv))) {
             dq = empty_in_order_of(s->q, s->q.size(-1), o);
             dk = empty_in_order_of(s->k, s->k.size(-1), o);
             dv = empty_in_order_of(s->v, s->v.size(-1), o);
           }
           backward(dq, dk, dv, gc, s->q, s->k, s->v, s->out, s->lse, s->scale, s->causal);
           auto back = [dt](bool wanted, const Tensor& t) { return wanted ? t.to(dt) : Tensor(); };
           return TensorList{back(rq, dq), back(rk, dk), back(rv, dv)};
         });
  return y;
}

}  // namespace lockstep
