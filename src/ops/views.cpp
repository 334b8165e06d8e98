// Tensor views: view, reshape, permute, slice, expand, squeeze, ... Each shares the storage and
// records its backward, which is why they are ops and not tensor/ (the Tensor methods are
// declared in include/lockstep/tensor/tensor.h).
#include <algorithm>

#include "lockstep/autograd/node.h"
#include "lockstep/ops/reduce.h"
#include "lockstep/tensor/tensor.h"
#include "ops/common.h"

namespace lockstep {

using detail::normalize_dim;

namespace {

// A new handle over the same storage with other geometry; no autograd history.
Tensor make_view(const Tensor& t, const Dims& shape, const Dims& strides, int64_t offset) {
  return Tensor(std::make_shared<TensorImpl>(t.storage(), shape, strides, offset, t.dtype()));
}

// Infers a -1 entry and checks the element count.
Dims infer_shape(const Dims& shape, int64_t numel, const char* op) {
  Dims out = shape;
  int64_t infer = -1, prod = 1;
  for (int64_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      LS_CHECK(infer < 0, op, ": only one dimension can be -1, got ", shape.str());
      infer = i;
    } else {
      LS_CHECK(out[i] >= 0, op, ": invalid size ", out[i], " in ", shape.str());
      prod *= out[i];
    }
  }
  if (infer >= 0) {
    LS_CHECK(prod != 0 && numel % prod == 0, op, ": shape ", shape.str(),
             " is invalid for a tensor of ", numel, " elements");
    out[infer] = numel / prod;
  } else {
    LS_CHECK(prod == numel, op, ": shape ", shape.str(), " is invalid for a tensor of ", numel,
             " elements");
  }
  return out;
}

// Strides for viewing (old shape, old strides) as new_shape without copying, or false when the
// layout does not allow it. Groups of old dims that are contiguous among themselves can be
// split or merged freely.
bool view_strides(const Dims& old_shape, const Dims& old_strides, const Dims& new_shape,
                  Dims& new_strides) {
  new_strides = Dims::filled(new_shape.size(), 0);
  if (old_shape.numel() == 0 || old_shape.empty()) {
    new_strides = contiguous_strides(new_shape);
    return true;
  }
  int64_t view_d = new_shape.size() - 1;
  int64_t chunk_base_stride = old_strides.size() ? old_strides.back() : 1;
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t tensor_d = old_shape.size() - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    if (tensor_d == 0 ||
        (old_shape[tensor_d - 1] != 1 &&
         old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (tensor_d > 0) {
        chunk_base_stride = old_strides[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

}  // namespace

Tensor Tensor::view(const Dims& shape_in) const {
  Dims shape = infer_shape(shape_in, numel(), "view");
  Dims strides;
  LS_CHECK(view_strides(this->shape(), this->strides(), shape, strides), "view: a tensor of shape ",
           this->shape().str(), " with strides ", this->strides().str(),
           " cannot be viewed as ", shape.str(), " without a copy; use reshape()");
  Tensor out = make_view(*this, shape, strides, offset());
  Dims orig = this->shape();
  autograd::record("ViewBackward", {*this}, out, [orig](const autograd::TensorList& g) {
    return autograd::TensorList{g[0].reshape(orig)};
  });
  return out;
}

Tensor Tensor::reshape(const Dims& shape_in) const {
  Dims shape = infer_shape(shape_in, numel(), "reshape");
  Dims strides;
  if (view_strides(this->shape(), this->strides(), shape, strides)) return view(shape);
  return contiguous().view(shape);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  int64_t s = normalize_dim(start_dim, dim(), "flatten");
  int64_t e = normalize_dim(end_dim, dim(), "flatten");
  LS_CHECK(s <= e, "flatten: start_dim ", start_dim, " comes after end_dim ", end_dim);
  Dims shape;
  for (int64_t d = 0; d < s; ++d) shape.push_back(this->shape()[d]);
  int64_t p = 1;
  for (int64_t d = s; d <= e; ++d) p *= this->shape()[d];
  shape.push_back(p);
  for (int64_t d = e + 1; d < dim(); ++d) shape.push_back(this->shape()[d]);
  return reshape(shape);
}

Tensor Tensor::permute(const Dims& order) const {
  LS_CHECK(order.size() == dim(), "permute: got ", order.size(), " dimensions ", order.str(),
           " for a tensor with ", dim());
  Dims shape, strides, inverse = Dims::filled(dim(), -1);
  for (int64_t i = 0; i < dim(); ++i) {
    int64_t d = normalize_dim(order[i], dim(), "permute");
    LS_CHECK(inverse[d] < 0, "permute: dimension ", d, " repeated in ", order.str());
    inverse[d] = i;
    shape.push_back(this->shape()[d]);
    strides.push_back(this->strides()[d]);
  }
  Tensor out = make_view(*this, shape, strides, offset());
  autograd::record("PermuteBackward", {*this}, out, [inverse](const autograd::TensorList& g) {
    return autograd::TensorList{g[0].permute(inverse)};
  });
  return out;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  if (dim() == 0) return *this;
  d0 = normalize_dim(d0, dim(), "transpose");
  d1 = normalize_dim(d1, dim(), "transpose");
  Dims order;
  for (int64_t i = 0; i < dim(); ++i) order.push_back(i);
  std::swap(order[d0], order[d1]);
  return permute(order);
}

Tensor Tensor::t() const {
  LS_CHECK(dim() <= 2, "t(): expects a tensor with at most 2 dimensions, got ", shape().str());
  return dim() < 2 ? *this : transpose(0, 1);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = normalize_dim(d, dim(), "slice");
  LS_CHECK(step > 0, "slice: step must be positive, got ", step);
  const int64_t n = shape()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Dims shp = shape(), str = strides();
  shp[d] = (end - start + step - 1) / step;
  str[d] *= step;
  Tensor out = make_view(*this, shp, str, offset() + start * strides()[d]);
  Dims orig = shape();
  autograd::record("SliceBackward", {*this}, out,
                   [orig, d, start, end, step](const autograd::TensorList& g) {
                     Tensor gi = zeros(orig, detail::options_on(g[0], g[0].dtype()));
                     gi.slice(d, start, end, step).copy_(g[0]);
                     return autograd::TensorList{gi};
                   });
  return out;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = normalize_dim(d, dim(), "narrow");
  const int64_t n = shape()[d];
  if (start < 0) start += n;
  LS_CHECK(start >= 0 && length >= 0 && start + length <= n, "narrow: range [", start, ", ",
           start + length, ") is out of bounds for dimension ", d, " of size ", n);
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = normalize_dim(d, dim(), "select");
  const int64_t n = shape()[d];
  LS_CHECK(index >= -n && index < n, "select: index ", index, " is out of bounds for dimension ",
           d, " of size ", n);
  if (index < 0) index += n;
  return narrow(d, index, 1).squeeze(d);
}

Tensor Tensor::expand(const Dims& shape_in) const {
  LS_CHECK(shape_in.size() >= dim(), "expand: cannot expand ", shape().str(), " to ",
           shape_in.str(), " (fewer dimensions)");
  const int64_t lead = shape_in.size() - dim();
  Dims shp = shape_in, str = Dims::filled(shape_in.size(), 0);
  for (int64_t i = 0; i < shape_in.size(); ++i) {
    if (i < lead) {
      LS_CHECK(shape_in[i] >= 0, "expand: size -1 is not allowed for a new leading dimension");
      continue;
    }
    const int64_t own = shape()[i - lead];
    if (shp[i] == -1) shp[i] = own;
    if (own == shp[i]) {
      str[i] = strides()[i - lead];
    } else {
      LS_CHECK(own == 1, "expand: cannot expand ", shape().str(), " to ", shape_in.str(),
               " (dimension ", i, ": ", own, " vs ", shp[i], ")");
    }
  }
  if (shp == shape()) return *this;
  Tensor out = make_view(*this, shp, str, offset());
  Dims orig = shape();
  autograd::record("ExpandBackward", {*this}, out, [orig](const autograd::TensorList& g) {
    return autograd::TensorList{sum_to(g[0], orig)};
  });
  return out;
}

Tensor Tensor::squeeze() const {
  Dims shp;
  for (int64_t s : shape())
    if (s != 1) shp.push_back(s);
  return shp == shape() ? *this : reshape(shp);
}

Tensor Tensor::squeeze(int64_t d) const {
  if (dim() == 0) return *this;
  d = normalize_dim(d, dim(), "squeeze");
  if (shape()[d] != 1) return *this;
  Dims shp = shape(), str = strides();
  shp.erase(d);
  str.erase(d);
  Tensor out = make_view(*this, shp, str, offset());
  Dims orig = shape();
  autograd::record("SqueezeBackward", {*this}, out, [orig](const autograd::TensorList& g) {
    return autograd::TensorList{g[0].reshape(orig)};
  });
  return out;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = normalize_dim(d, dim() + 1, "unsqueeze");
  Dims shp = shape(), str = strides();
  const int64_t s = d < dim() ? strides()[d] * shape()[d] : 1;
  shp.insert(d, 1);
  str.insert(d, s);
  Tensor out = make_view(*this, shp, str, offset());
  Dims orig = shape();
  autograd::record("UnsqueezeBackward", {*this}, out, [orig](const autograd::TensorList& g) {
    return autograd::TensorList{g[0].reshape(orig)};
  });
  return out;
}

}  // namespace lockstep
