// embedding: row lookup with checked indices, and its scatter-add backward.
#include <algorithm>

#include "lockstep/autograd/node.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/cpu/rows.h"
#include "tensor/dispatch.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;

namespace {

// Indices as contiguous i64, each checked against [0, num).
Tensor checked_indices(const Tensor& indices, int64_t num) {
  Tensor idx = indices.to(kInt64).contiguous();
  const int64_t* p = idx.data<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    LS_CHECK(p[i] >= 0 && p[i] < num, "embedding: index ", p[i], " is out of range for ", num,
             " embeddings (expected 0 <= index < ", num, ")");
  }
  return idx;
}

// grad_weight[idx[i], :] += g[i, :]. Threads split the columns, never the indices, so repeated
// indices never race and the sums keep one order.
template <typename T>
void scatter_add_rows(const Tensor& g, const Tensor& idx, const Tensor& gw) {
  const int64_t count = idx.numel(), dim = gw.size(1);
  const int64_t* pi = idx.data<int64_t>();
  const T* pg = g.data<T>();
  T* pw = gw.data<T>();
  const int64_t grain = std::max<int64_t>(16, cpu::kElementwiseGrain / std::max<int64_t>(count, 1));
  cpu::parallel_for(0, dim, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = 0; i < count; ++i) {
      T* dst = pw + pi[i] * dim;
      const T* src = pg + i * dim;
      for (int64_t j = b; j < e; ++j) dst[j] += src[j];
    }
  });
}

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  detail::check_cpu(weight, "embedding");
  detail::check_cpu(indices, "embedding");
  LS_CHECK(weight.dim() == 2,
           "embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape ",
           weight.shape().str());
  LS_CHECK(indices.dtype() == kInt64 || indices.dtype() == kInt32,
           "embedding: indices must be i64 or i32, got ", dtype_name(indices.dtype()));
  const int64_t num = weight.size(0), dim = weight.size(1);
  const Tensor idx = checked_indices(indices, num);
  Dims out_shape = indices.shape();
  out_shape.push_back(dim);
  Tensor out = empty(out_shape, weight.dtype());
  const int64_t count = idx.numel(), rs = weight.stride(0), cs = weight.stride(1);
  cpu::dispatch_all(weight.dtype(), "embedding", [&]<typename T>() {
    const T* pw = static_cast<const T*>(weight.data_ptr());
    const int64_t* pi = idx.data<int64_t>();
    T* po = static_cast<T*>(out.data_ptr());
    cpu::parallel_rows(count, dim, [&](int64_t i) {
      const T* src = pw + pi[i] * rs;
      T* dst = po + i * dim;
      if (cs == 1) {
        std::copy(src, src + dim, dst);
      } else {
        for (int64_t j = 0; j < dim; ++j) dst[j] = src[j * cs];
      }
    });
  });
  const Dims wshape = weight.shape();
  const DType dt = weight.dtype();
  record("EmbeddingBackward", {weight}, out, [idx, wshape, dt](const TensorList& g) {
    const DType ct = is_half(dt) ? kFloat32 : dt;
    const Tensor gc = g[0].to(ct).contiguous();
    Tensor gw = zeros(wshape, ct);
    cpu::dispatch_float(ct, "embedding_backward",
                        [&]<typename T>() { scatter_add_rows<T>(gc, idx, gw); });
    return TensorList{gw.to(dt)};
  });
  return out;
}

}  // namespace lockstep
