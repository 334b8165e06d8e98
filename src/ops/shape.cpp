// Ops that assemble or pick from tensors: cat, stack, split, index_select, gather, and their
// gradients (slices of g for cat, scatter-add into zeros for the index ops).
#include "lockstep/ops/shape.h"

#include <memory>
#include <string>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "ops/common.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep {

using autograd::TensorList;

namespace {

// Rows (or lines) per thread chunk below which index kernels stay on one thread.
constexpr int64_t kIndexGrainElements = 32768;

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
  const Tensor ic = index.contiguous();
  cpu::dispatch_index(ic.dtype(), op, [&]<typename I>() {
    const I* p = static_cast<const I*>(ic.data_ptr());
    for (int64_t i = 0; i < ic.numel(); ++i) {
      const int64_t v = static_cast<int64_t>(p[i]);
      LS_CHECK(v >= 0 && v < size, op, ": index ", v, " at position ", i,
               " is out of range for dimension ", dim, " of size ", size, " (input ",
               t.shape().str(), ", index ", index.shape().str(), ")");
    }
  });
}

// A 1-D index tensor as int64 values (after the range check).
std::vector<int64_t> index_values(const Tensor& index, const char* op) {
  const Tensor ic = index.contiguous();
  std::vector<int64_t> out(ic.numel());
  cpu::dispatch_index(ic.dtype(), op, [&]<typename I>() {
    const I* p = static_cast<const I*>(ic.data_ptr());
    for (int64_t i = 0; i < ic.numel(); ++i) out[i] = static_cast<int64_t>(p[i]);
  });
  return out;
}

// "[2, 3, 4]" for a list that may be longer than a Dims holds.
std::string join(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Product of shape[begin, end).
int64_t span_numel(const Dims& shape, int64_t begin, int64_t end) {
  int64_t n = 1;
  for (int64_t d = begin; d < end; ++d) n *= shape[d];
  return n;
}

// Runs f(lo, hi) over [0, n) in parallel with a grain of about kIndexGrainElements elements,
// where one unit of n moves `per_unit` elements.
template <typename F>
void parallel_units(int64_t n, int64_t per_unit, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kIndexGrainElements / std::max<int64_t>(per_unit, 1));
  cpu::parallel_for(0, n, grain, f);
}

// Gradient dtype handling: index-op gradients are accumulated in f32/f64 (16-bit floats via
// f32) and returned in the input's dtype.
template <typename Body>
Tensor scatter_grad(const Tensor& g_in, const Dims& shape, DType dtype, const char* op,
                    const Body& body) {
  const DType compute = is_half(dtype) ? kFloat32 : dtype;
  const Tensor g = (g_in.dtype() == compute ? g_in : g_in.to(compute)).contiguous();
  Tensor gi = zeros(shape, compute);
  cpu::dispatch_float(compute, op, [&]<typename T>() {
    body(static_cast<const T*>(g.data_ptr()), static_cast<T*>(gi.data_ptr()));
  });
  return compute == dtype ? gi : gi.to(dtype);
}

// Iteration over the "lines" of a shape along `dim`: every position of the other dims, with
// the element offsets of each operand's start of line.
struct Lines {
  Dims shape;  // the iteration shape (gather's index shape)
  int64_t dim = 0;
  int64_t count = 1;  // number of lines

  Lines(const Dims& s, int64_t d) : shape(s), dim(d) {
    for (int64_t k = 0; k < s.size(); ++k)
      if (k != d) count *= s[k];
  }
  // Offset of line `line` for an operand with `strides`.
  int64_t offset(int64_t line, const Dims& strides) const {
    int64_t off = 0;
    for (int64_t k = shape.size() - 1; k >= 0; --k) {
      if (k == dim) continue;
      off += (line % shape[k]) * strides[k];
      line /= shape[k];
    }
    return off;
  }
};

// gi (outer, n, inner) += g (outer, k, inner) with row i of g going to row idx[i].
template <typename T>
void index_add_rows(const T* g, T* gi, const std::vector<int64_t>& idx, int64_t outer, int64_t n,
                    int64_t inner) {
  const int64_t k = idx.size();
  auto rows = [&](int64_t oi, int64_t j0, int64_t j1) {
    for (int64_t i = 0; i < k; ++i) {
      const T* from = g + (oi * k + i) * inner;
      T* to = gi + (oi * n + idx[i]) * inner;
      for (int64_t j = j0; j < j1; ++j) to[j] += from[j];
    }
  };
  // Repeated indices collide within one outer slice, so threads split the outer slices (or,
  // when there is only one, the columns of the inner rows).
  if (outer > 1) {
    parallel_units(outer, k * inner, [&](int64_t b, int64_t e) {
      for (int64_t oi = b; oi < e; ++oi) rows(oi, 0, inner);
    });
  } else {
    parallel_units(inner, k, [&](int64_t b, int64_t e) { rows(0, b, e); });
  }
}

// gi (contiguous, in_shape) at [.., index[p], ..] += g[p] for every position p of the
// contiguous `index` (gather's adjoint).
template <typename T>
void gather_add(const T* g, const Tensor& index, T* gi, const Dims& in_shape, int64_t d) {
  const Lines lines(index.shape(), d);
  const Dims idx_strides = contiguous_strides(index.shape());
  const Dims in_strides = contiguous_strides(in_shape);
  const int64_t len = index.shape()[d], step = idx_strides[d];
  cpu::dispatch_index(index.dtype(), "gather backward", [&]<typename I>() {
    const I* ip = static_cast<const I*>(index.data_ptr());
    // Two lines never share an input element (they differ outside `d`), so lines can run on
    // different threads.
    parallel_units(lines.count, len, [&](int64_t b, int64_t e) {
      for (int64_t l = b; l < e; ++l) {
        const int64_t io = lines.offset(l, idx_strides);
        T* dst = gi + lines.offset(l, in_strides);
        for (int64_t j = 0; j < len; ++j)
          dst[static_cast<int64_t>(ip[io + j * step]) * in_strides[d]] += g[io + j * step];
      }
    });
  });
}

}  // namespace

// ---- cat / stack / split ----

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  LS_CHECK(!tensors.empty(), "cat: expected a non-empty list of tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    LS_CHECK(tensors[i].defined(), "cat: tensor ", i, " is an undefined tensor");
    detail::check_cpu(tensors[i], "cat");
  }
  const Tensor& first = tensors[0];
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
  Tensor out = empty(out_shape, first.dtype());
  std::vector<int64_t> sizes;
  std::vector<bool> needs;
  {
    NoGradGuard no_grad;
    int64_t off = 0;
    for (const Tensor& t : tensors) {
      const int64_t n = t.shape()[d];
      if (n > 0) out.narrow(d, off, n).copy_(t);
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

// ---- index_select ----

Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index) {
  detail::check_cpu(t, "index_select");
  detail::check_cpu(index, "index_select");
  LS_CHECK(t.dim() > 0, "index_select: input must have at least one dimension, got shape ",
           t.shape().str());
  LS_CHECK(index.dim() <= 1, "index_select: index must be 1-D, got shape ", index.shape().str());
  LS_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32,
           "index_select: index must be i64 or i32, got ", dtype_name(index.dtype()));
  const int64_t d = detail::normalize_dim(dim, t.dim(), "index_select");
  const int64_t n = t.shape()[d];
  check_index_range(index, n, "index_select", d, t);
  const std::vector<int64_t> idx = index_values(index, "index_select");
  const int64_t k = idx.size();

  // (outer, n, inner) -> (outer, k, inner), rows of `inner` contiguous elements.
  const Tensor src = t.detach().contiguous();
  const int64_t outer = span_numel(t.shape(), 0, d);
  const int64_t inner = span_numel(t.shape(), d + 1, t.dim());
  Dims out_shape = t.shape();
  out_shape[d] = k;
  Tensor out = empty(out_shape, t.dtype());
  cpu::dispatch_all(t.dtype(), "index_select", [&]<typename T>() {
    const T* s = static_cast<const T*>(src.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    parallel_units(outer * k, inner, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t oi = r / k, i = r % k;
        const T* from = s + (oi * n + idx[i]) * inner;
        T* to = o + r * inner;
        for (int64_t j = 0; j < inner; ++j) to[j] = from[j];
      }
    });
  });

  const Dims in_shape = t.shape();
  const DType dtype = t.dtype();
  autograd::record("IndexSelectBackward", {t}, out,
                   [idx, in_shape, dtype, outer, inner, n](const TensorList& g) {
                     Tensor gi = scatter_grad(g[0], in_shape, dtype, "index_select backward",
                                              [&]<typename T>(const T* gp, T* gip) {
                                                index_add_rows(gp, gip, idx, outer, n, inner);
                                              });
                     return TensorList{gi};
                   });
  return out;
}

// ---- gather ----

Tensor gather(const Tensor& t, int64_t dim, const Tensor& index) {
  detail::check_cpu(t, "gather");
  detail::check_cpu(index, "gather");
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
  const int64_t n = t.shape()[d];
  check_index_range(index, n, "gather", d, t);

  const Tensor idx_t = index.contiguous();
  const Lines lines(index.shape(), d);
  const Dims idx_strides = contiguous_strides(index.shape());  // also the output's
  const int64_t len = index.shape()[d];
  const int64_t step = idx_strides[d];
  Tensor out = empty(index.shape(), t.dtype());
  if (out.numel() > 0) {
    cpu::dispatch_all(t.dtype(), "gather", [&]<typename T>() {
      cpu::dispatch_index(idx_t.dtype(), "gather", [&]<typename I>() {
        const T* s = static_cast<const T*>(t.data_ptr());
        const I* ip = static_cast<const I*>(idx_t.data_ptr());
        T* o = static_cast<T*>(out.data_ptr());
        const int64_t ts = t.strides()[d];
        parallel_units(lines.count, len, [&](int64_t b, int64_t e) {
          for (int64_t l = b; l < e; ++l) {
            const int64_t io = lines.offset(l, idx_strides);
            const T* src = s + lines.offset(l, t.strides());
            for (int64_t j = 0; j < len; ++j)
              o[io + j * step] = src[static_cast<int64_t>(ip[io + j * step]) * ts];
          }
        });
      });
    });
  }

  const Dims in_shape = t.shape();
  const DType dtype = t.dtype();
  autograd::record("GatherBackward", {t}, out, [idx_t, in_shape, dtype, d](const TensorList& g) {
    Tensor gi = scatter_grad(
        g[0], in_shape, dtype, "gather backward",
        [&]<typename T>(const T* gp, T* gip) { gather_add(gp, idx_t, gip, in_shape, d); });
    return TensorList{gi};
  });
  return out;
}

}  // namespace lockstep
