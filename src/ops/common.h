// Helpers shared by op implementations: argument checks and dimension normalization.
#pragma once

#include <cstdint>

#include "lockstep/base/error.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::detail {

inline int64_t normalize_dim(int64_t dim, int64_t ndim, const char* op) {
  int64_t n = ndim == 0 ? 1 : ndim;  // a 0-dim tensor accepts dim 0 and -1
  LS_CHECK(dim >= -n && dim < n, op, ": dimension ", dim, " is out of range for a tensor with ",
           ndim, " dimensions (expected [", -n, ", ", n - 1, "])");
  return dim < 0 ? dim + n : dim;
}

inline void check_defined(const Tensor& t, const char* op, const char* what = "input") {
  LS_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
}

// Options for a new tensor of `dtype` on `like`'s device: fronts allocate where their inputs
// live, so that the kernel of that device (Note [Kernel tables] in src/ops/kernels.h) can fill
// it.
inline TensorOptions options_on(const Tensor& like, DType dtype) {
  return TensorOptions(dtype).with_device(like.device());
}

inline void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  LS_CHECK(a.device() == b.device(), op, ": tensors on different devices (", a.device().str(),
           " and ", b.device().str(), ")");
}

}  // namespace lockstep::detail
