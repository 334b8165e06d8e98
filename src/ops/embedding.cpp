// embedding: row lookup with checked indices, and its scatter-add backward; the kernels are
// index_select and index_add (src/ops/cpu/index.cpp).
#include "lockstep/autograd/node.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;
using detail::BadIndex;
using detail::Kernels;

namespace {

// Indices as contiguous 1-D i64, each checked against [0, num).
Tensor checked_indices(const Tensor& indices, int64_t num) {
  Tensor idx = indices.detach().to(kInt64).contiguous().reshape({-1});
  BadIndex bad;
  detail::kernel(&Kernels::index_bounds, idx.device(), "embedding")(idx, num, &bad);
  LS_CHECK(bad.position < 0, "embedding: index ", bad.value, " is out of range for ", num,
           " embeddings (expected 0 <= index < ", num, ")");
  return idx;
}

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  detail::check_defined(weight, "embedding");
  detail::check_defined(indices, "embedding", "indices");
  detail::check_same_device(weight, indices, "embedding");
  const auto kernel = detail::kernel(&Kernels::index_select, weight.device(), "embedding");
  LS_CHECK(weight.dim() == 2,
           "embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape ",
           weight.shape().str());
  LS_CHECK(indices.dtype() == kInt64 || indices.dtype() == kInt32,
           "embedding: indices must be i64 or i32, got ", dtype_name(indices.dtype()));
  const int64_t num = weight.size(0), dim = weight.size(1);
  const Tensor idx = checked_indices(indices, num);
  const int64_t count = idx.numel();
  Tensor rows = empty({count, dim}, detail::options_on(weight, weight.dtype()));
  kernel(rows, weight.detach().contiguous(), 0, idx);
  Dims out_shape = indices.shape();
  out_shape.push_back(dim);
  Tensor out = rows.view(out_shape);
  record("EmbeddingBackward", {weight}, out,
         [idx, count, wshape = weight.shape(), dt = weight.dtype()](const TensorList& g) {
           // Threads of the CPU kernel split the columns, never the indices, so repeated indices
           // never race and the sums keep one order.
           const DType ct = is_half(dt) ? kFloat32 : dt;
           const Tensor gc = g[0].to(ct).contiguous().reshape({count, wshape[1]});
           Tensor gw = zeros(wshape, detail::options_on(gc, ct));
           detail::kernel(&Kernels::index_add, gw.device(), "embedding_backward")(gw, 0, idx, gc);
           return TensorList{gw.to(dt)};
         });
  return out;
}

}  // namespace lockstep
