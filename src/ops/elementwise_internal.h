// Internal elementwise building blocks shared by op files (fused backward kernels and maps).
#pragma once

#include "lockstep/tensor/tensor.h"
#include "ops/common.h"
#include "ops/cpu/loops.h"
#include "tensor/dispatch.h"

namespace lockstep::detail {

// out[i] = op(a[i], b[i]) with a, b of one floating dtype and the same shape (no broadcasting,
// no autograd). Used for fused backward formulas such as relu's g * (x > 0).
template <typename Op>
Tensor map2_float(const char* name, const Tensor& a, const Tensor& b, const Op& op) {
  LS_CHECK(a.shape() == b.shape(), name, ": shapes ", a.shape().str(), " and ", b.shape().str(),
           " differ");
  const DType dt = a.dtype();
  if (is_half(dt)) return map2_float(name, a.to(kFloat32), b.to(kFloat32), op).to(dt);
  Tensor bb = b.dtype() == dt ? b : b.to(dt);
  Tensor out = empty(a.shape(), dt);
  cpu::dispatch_float(dt, name, [&]<typename T>() { cpu::binary_loop<T, T, T>(out, a, bb, op); });
  return out;
}

// out[i] = op(a[i]) for a floating tensor (no autograd).
template <typename Op>
Tensor map1_float(const char* name, const Tensor& a, const Op& op) {
  const DType dt = a.dtype();
  if (is_half(dt)) return map1_float(name, a.to(kFloat32), op).to(dt);
  Tensor out = empty(a.shape(), dt);
  cpu::dispatch_float(dt, name, [&]<typename T>() { cpu::unary_loop<T, T>(out, a, op); });
  return out;
}

// Errors out when an in-place op would corrupt a tensor autograd is tracking.
void check_inplace(const Tensor& self, const char* op);

}  // namespace lockstep::detail
