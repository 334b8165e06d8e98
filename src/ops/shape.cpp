// Ops that assemble or pick from tensors: cat, stack, split, index_select, gather, and their
// gradients (slices of g for cat, scatter-add into zeros for the index ops). The kernels are the
// copy kernel (cat) and src/ops/cpu/index.cpp.
#include "lockstep/ops/shape.h"

#include <memory>
#include <string>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/tensor/tensor_impl.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::TensorList;
using detail::BadIndex;
using detail::Kernels;

namespace {

// `record` for an op whose inputs come as a list (cat).
void record_list(const char* name, const std::vector<Tensor>& inputs, Tensor& output,
                 autograd::BackwardFn fn) {
  if (!autograd::needs_grad(inputs)) return;
  auto node = std::make_shared<autograd::FunctionNode>(name, std::move(fn));
  autograd::set_history(node, inputs, {&output});
}

// Checks that every entry of an integer index tensor lies in [0, size); names the first bad one.
void check_index_range(const Tensor& index, int64_t size, const char* op, int64_t dim,
                       const Tensor& t) {
  BadIndex bad;
  detail::kernel(&Kernels::index_bounds, index.device(), op)(index, size, &bad);
  LS_CHECK(bad.position < 0, op, ": index ", bad.value, " at position ", bad.position,
           " is out of range for dimension ", dim, " of size ", size, " (input ", t.shape().str(),
           ", index ", index.shape().str(), ")");
}

// "[2, 3, 4]" for a list that may be longer than a Dims holds.
std::string join(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The gradient of an index op's input: zeros of `shape` into which `add(gi, g)` accumulates g,
// in f32/f64 (16-bit floats via f32), returned in the input's dtype.
template <typename Add>
Tensor scatter_grad(const Tensor& g_in, const Dims& shape, DType dtype, const Add& add) {
  const DType compute = is_half(dtype) ? kFloat32 : dtype;
  const Tensor g = (g_in.dtype() == compute ? g_in : g_in.to(compute)).contiguous();
  Tensor gi = zeros(shape, detail::options_on(g, compute));
  add(gi, g);
  return compute == dtype ? gi : gi.to(dtype);
}

}  // namespace

// ---- cat / stack / split ----

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  LS_CHECK(!tensors.empty(), "cat: expected a non-empty list of tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    LS_CHECK(tensors[i].defined(), "cat: tensor ", i, " is an undefined tensor");
    LS_CHECK(tensors[i].device() == tensors[0].device(), "cat: tensor ", i, " is on ",
             tensors[i].device().str(), " but tensor 0 is on ", tensors[0].device().str());
  }
  const Tensor& first = tensors[0];
  const auto copy = detail::kernel(&Kernels::copy, first.device(), "cat");
  LS_CHECK(first.dim() > 0,
           "cat: zero-dimensional tensor 0 cannot be concatenated; unsqueeze "
           "it or use stack");
  const int64_t d = detail::normalize_dim(dim, first.dim(), "cat");
  Dims out_shape = first.shape();
  out_shape[d] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    LS_CHECK(t.dtype() == first.dtype(), "cat: tensor ", i, " has dtype ", dtype_name(t.dtype()),
             " but tensor 0 has dtype ", dtype_name(first.dtype()), "; convert with .to()");
    LS_CHECK(t.dim() == first.dim(), "cat: tensor ", i, " has shape ", t.shape().str(),
             " but tensor 0 has shape ", first.shape().str(),
             " (tensors must have the same number of dimensions)");
    for (int64_t k = 0; k < t.dim(); ++k) {
      LS_CHECK(k == d || t.shape()[k] == first.shape()[k], "cat: tensor ", i, " has shape ",
               t.shape().str(), " but tensor 0 has shape ", first.shape().str(),
               " (sizes must match except in dimension ", d, "; they differ in dimension ", k, ")");
    }
    out_shape[d] += t.shape()[d];
  }
  Tensor out = empty(out_shape, detail::options_on(first, first.dtype()));
  std::vector<int64_t> sizes;
  std::vector<bool> needs;
  {
    NoGradGuard no_grad;
    int64_t off = 0;
    for (const Tensor& t : tensors) {
      const int64_t n = t.shape()[d];
      if (n > 0) copy(out.narrow(d, off, n), t);  // fresh output: nothing aliases
      off += n;
      sizes.push_back(n);
      needs.push_back(t.requires_grad());
    }
  }
  record_list("CatBackward", tensors, out, [d, sizes, needs](const TensorList& g) {
    TensorList grads(sizes.size());
    int64_t off = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (needs[i]) grads[i] = g[0].narrow(d, off, sizes[i]);
      off += sizes[i];
    }
    return grads;
  });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  LS_CHECK(!tensors.empty(), "stack: expected a non-empty list of tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    LS_CHECK(tensors[i].defined(), "stack: tensor ", i, " is an undefined tensor");
    LS_CHECK(tensors[i].shape() == tensors[0].shape(), "stack: tensor ", i, " has shape ",
             tensors[i].shape().str(), " but tensor 0 has shape ", tensors[0].shape().str(),
             " (stack needs equal shapes)");
  }
  const int64_t d = detail::normalize_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  parts.reserve(tensors.size());
  for (const Tensor& t : tensors) parts.push_back(t.unsqueeze(d));
  return cat(parts, d);
}

std::vector<Tensor> split(const Tensor& t, int64_t split_size, int64_t dim) {
  detail::check_defined(t, "split");
  const int64_t d = detail::normalize_dim(dim, t.dim(), "split");
  LS_CHECK(t.dim() > 0, "split: cannot split a zero-dimensional tensor");
  const int64_t n = t.shape()[d];
  LS_CHECK(split_size > 0 || (split_size == 0 && n == 0),
           "split: split_size must be positive, got ", split_size, " for dimension ", d,
           " of size ", n);
  if (n == 0) return {t.narrow(d, 0, 0)};
  std::vector<Tensor> out;
  for (int64_t start = 0; start < n; start += split_size)
    out.push_back(t.narrow(d, start, std::min(split_size, n - start)));
  return out;
}

std::vector<Tensor> split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim) {
  detail::check_defined(t, "split");
  LS_CHECK(t.dim() > 0, "split: cannot split a zero-dimensional tensor");
  const int64_t d = detail::normalize_dim(dim, t.dim(), "split");
  const int64_t n = t.shape()[d];
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    LS_CHECK(sizes[i] >= 0, "split: size ", i, " is ", sizes[i], "; sizes must be non-negative");
    total += sizes[i];
  }
  LS_CHECK(total == n, "split: sizes ", join(sizes), " add up to ", total, " but dimension ", d,
           " of ", t.shape().str(), " has size ", n);
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(t.narrow(d, start, s));
    start += s;
  }
  return out;
}

namespace {

// The contiguous tensor of `shape` whose slices along d are g[0], g[1], ... (same storage,
// its strides, offsets one slice apart), or an undefined tensor when they are not.
Tensor slices_of_one_tensor(const TensorList& g, const Dims& shape, int64_t d) {
  Dims strides = Dims::filled(shape.size(), 1);
  for (int64_t i = shape.size() - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
  Dims slice_strides;
  for (int64_t i = 0; i < shape.size(); ++i)
    if (i != d) slice_strides.push_back(strides[i]);
  const Tensor& g0 = g[0];
  for (size_t i = 0; i < g.size(); ++i) {
    const Tensor& gi = g[i];
    if (gi.storage() != g0.storage() || gi.dtype() != g0.dtype()) return Tensor();
    if (gi.offset() != g0.offset() + static_cast<int64_t>(i) * strides[d]) return Tensor();
    for (int64_t k = 0; k < gi.dim(); ++k)  // a size-1 dim's stride is free
      if (gi.size(k) != 1 && gi.stride(k) != slice_strides[k]) return Tensor();
  }
  return Tensor(
      std::make_shared<TensorImpl>(g0.storage(), shape, strides, g0.offset(), g0.dtype()));
}

}  // namespace

// Note [unbind's backward]
// Slicing a tensor k ways through select() gives k SliceBackward nodes, each returning a
// zero-filled gradient of the whole input with its slice copied in, which the engine then adds
// up: k memsets, k copies and k - 1 additions of the whole input. One node for all k views
// writes each slice once (GPT's q, k, v out of one qkv projection: the copies and additions
// cost about as much as the attention's own backward). When the k gradients are themselves the k
// slices of one contiguous tensor of the input's shape (the attention writes them so, Note
// [Strided attention inputs] in src/ops/attention.cpp), that tensor is the gradient, no copy.
std::vector<Tensor> unbind(const Tensor& t, int64_t dim) {
  detail::check_defined(t, "unbind");
  LS_CHECK(t.dim() > 0, "unbind: cannot unbind a zero-dimensional tensor");
  const int64_t d = detail::normalize_dim(dim, t.dim(), "unbind");
  const int64_t n = t.shape()[d];
  std::vector<Tensor> out;
  out.reserve(static_cast<size_t>(n));
  {
    autograd::NoGradGuard no_grad;  // one node for all the views, recorded below
    for (int64_t i = 0; i < n; ++i) out.push_back(t.select(d, i));
  }
  if (n == 0 || !autograd::needs_grad({&t})) return out;
  auto node = std::make_shared<autograd::FunctionNode>(
      "UnbindBackward",
      [shape = t.shape(), d, n](const TensorList& g) {
        const Tensor* any = nullptr;
        bool all = true;
        for (const Tensor& gi : g) {
          if (gi.defined() && any == nullptr) any = &gi;
          all = all && gi.defined();
        }
        if (all) {
          if (Tensor whole = slices_of_one_tensor(g, shape, d); whole.defined())
            return TensorList{whole};
        }
        const auto o = detail::options_on(*any, any->dtype());
        Tensor grad = all ? empty(shape, o) : zeros(shape, o);  // (Note [unbind's backward])
        for (int64_t i = 0; i < n; ++i) {
          if (g[i].defined()) grad.select(d, i).copy_(g[i]);
        }
        return TensorList{grad};
      },
      static_cast<uint32_t>(n));
  std::vector<Tensor*> outputs;
  for (Tensor& v : out) outputs.push_back(&v);
  autograd::set_history(node, {t}, outputs);
  return out;
}

// ---- index_select ----

Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index) {
  detail::check_defined(t, "index_select");
  detail::check_defined(index, "index_select", "index");
  detail::check_same_device(t, index, "index_select");
  const auto kernel = detail::kernel(&Kernels::index_select, t.device(), "index_select");
  LS_CHECK(t.dim() > 0, "index_select: input must have at least one dimension, got shape ",
           t.shape().str());
  LS_CHECK(index.dim() <= 1, "index_select: index must be 1-D, got shape ", index.shape().str());
  LS_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32,
           "index_select: index must be i64 or i32, got ", dtype_name(index.dtype()));
  const int64_t d = detail::normalize_dim(dim, t.dim(), "index_select");
  const Tensor idx = index.detach().contiguous();
  check_index_range(idx, t.shape()[d], "index_select", d, t);
  Dims out_shape = t.shape();
  out_shape[d] = idx.numel();
  Tensor out = empty(out_shape, detail::options_on(t, t.dtype()));
  kernel(out, t.detach().contiguous(), d, idx);

  autograd::record("IndexSelectBackward", {t}, out,
                   [idx, d, in_shape = t.shape(), dtype = t.dtype()](const TensorList& g) {
                     return TensorList{scatter_grad(
                         g[0], in_shape, dtype, [&](const Tensor& gi, const Tensor& gc) {
                           detail::kernel(&Kernels::index_add, gi.device(),
                                          "index_select backward")(gi, d, idx, gc);
                         })};
                   });
  return out;
}

// ---- gather ----

Tensor gather(const Tensor& t, int64_t dim, const Tensor& index) {
  detail::check_defined(t, "gather");
  detail::check_defined(index, "gather", "index");
  detail::check_same_device(t, index, "gather");
  const auto kernel = detail::kernel(&Kernels::gather, t.device(), "gather");
  LS_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32,
           "gather: index must be i64 or i32, got ", dtype_name(index.dtype()));
  LS_CHECK(t.dim() > 0, "gather: input must have at least one dimension, got shape ",
           t.shape().str());
  LS_CHECK(index.dim() == t.dim(), "gather: index ", index.shape().str(),
           " must have as many dimensions as the input ", t.shape().str());
  const int64_t d = detail::normalize_dim(dim, t.dim(), "gather");
  for (int64_t k = 0; k < t.dim(); ++k) {
    LS_CHECK(k == d || index.shape()[k] <= t.shape()[k], "gather: index ", index.shape().str(),
             " is larger than the input ", t.shape().str(), " in dimension ", k,
             " (only dimension ", d, " may be larger)");
  }
  const Tensor idx = index.detach().contiguous();
  check_index_range(idx, t.shape()[d], "gather", d, t);
  Tensor out = empty(index.shape(), detail::options_on(t, t.dtype()));
  if (out.numel() > 0) kernel(out, t.detach(), d, idx);

  autograd::record("GatherBackward", {t}, out,
                   [idx, d, in_shape = t.shape(), dtype = t.dtype()](const TensorList& g) {
                     return TensorList{scatter_grad(
                         g[0], in_shape, dtype, [&](const Tensor& gi, const Tensor& gc) {
                           detail::kernel(&Kernels::scatter_add, gi.device(),
                                          "gather backward")(gi, d, idx, gc);
                         })};
                   });
  return out;
}

}  // namespace lockstep
