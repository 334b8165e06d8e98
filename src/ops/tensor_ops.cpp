// The Tensor methods that run kernels: copies and conversion (contiguous, clone, to, copy_),
// in-place fills and arithmetic (fill_, zero_, add_, mul_), and to_vector. Declared in
// include/lockstep/tensor/tensor.h; defined here because they run kernels through the table
// (Note [Kernel tables] in src/ops/kernels.h) and record backwards.
#include <cstring>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/tensor/tensor.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using detail::BinaryOp;
using detail::Kernels;

namespace {

// Errors out when an in-place op would corrupt a tensor autograd is tracking.
void check_inplace(const Tensor& self, const char* op) {
  detail::check_defined(self, op);
  LS_CHECK(!(autograd::grad_enabled() && self.requires_grad()), op,
           ": in-place operation on a "
           "tensor that requires grad; run it under NoGradGuard (as an optimizer step does) or on "
           "a detach()ed tensor");
  // An expanded destination has elements that alias each other: a write to one is a write to
  // all, and parallel writers would race.
  for (int64_t d = 0; d < self.dim(); ++d)
    LS_CHECK(self.shape()[d] <= 1 || self.strides()[d] != 0, op, ": the destination of shape ",
             self.shape().str(), " has strides ", self.strides().str(),
             " (an expanded view: "
             "several elements share memory); write into a clone() or contiguous() copy instead");
}

// Last element's offset + 1 (elements), for a tensor with non-negative strides.
int64_t extent_of(const Tensor& t) {
  int64_t e = t.offset() + 1;
  for (int64_t d = 0; d < t.dim(); ++d) e += (t.shape()[d] - 1) * t.strides()[d];
  return e;
}

// `src` (already expanded to dst's shape), or a copy of it when it shares memory with `dst` in
// another layout: an in-place loop would otherwise read elements it has already overwritten.
Tensor unaliased_source(const Tensor& src, const Tensor& dst) {
  if (src.storage() != dst.storage() || src.numel() == 0) return src;
  if (src.dtype() == dst.dtype() && src.offset() == dst.offset() && src.strides() == dst.strides())
    return src;  // the same elements in the same order: each is read before it is written
  const int64_t es = src.element_size(), ed = dst.element_size();
  const bool disjoint =
      extent_of(src) * es <= dst.offset() * ed || extent_of(dst) * ed <= src.offset() * es;
  if (disjoint) return src;
  autograd::NoGradGuard no_grad;
  return src.clone();
}

// The source of an in-place binary op: `other` in self's dtype, expanded, not aliasing self.
Tensor inplace_operand(const Tensor& self, const Tensor& other, const char* op) {
  detail::check_defined(other, op, "other");
  detail::check_same_device(self, other, op);
  autograd::NoGradGuard no_grad;
  return unaliased_source(
      (other.dtype() == self.dtype() ? other : other.to(self.dtype())).expand(self.shape()), self);
}

}  // namespace

// ---- copies and conversion ----

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  detail::check_defined(*this, "clone");
  const auto copy = detail::kernel(&Kernels::copy, device(), "clone");
  Tensor out = empty(shape(), detail::options_on(*this, dtype()));
  copy(out, *this);
  autograd::record("CloneBackward", {*this}, out,
                   [](const autograd::TensorList& g) { return autograd::TensorList{g[0]}; });
  return out;
}

Tensor Tensor::to(DType t) const {
  if (t == dtype()) return *this;
  const auto copy = detail::kernel(&Kernels::copy, device(), "to");
  Tensor out = empty(shape(), detail::options_on(*this, t));
  copy(out, *this);
  if (is_floating(t) && is_floating(dtype())) {
    DType from = dtype();
    autograd::record("ToDtypeBackward", {*this}, out, [from](const autograd::TensorList& g) {
      return autograd::TensorList{g[0].to(from)};
    });
  }
  return out;
}

Tensor Tensor::to(Device d) const {
  if (d == device()) return *this;
  // A transfer is the copy kernel of the device that is not the CPU.
  const Device other = d.is_cpu() ? device() : d;
  LS_CHECK(detail::kernels_of(other.type) != nullptr, "to(", d.str(),
           "): this build of lockstep has no ", other.str(),
           " support (CUDA kernels come with a CUDA build)");
  const auto copy = detail::kernel(&Kernels::copy, other, "to");
  Tensor out = empty(shape(), TensorOptions(dtype()).with_device(d));
  copy(out, *this);
  if (is_floating(dtype())) {
    const Device from = device();
    autograd::record("ToDeviceBackward", {*this}, out, [from](const autograd::TensorList& g) {
      return autograd::TensorList{g[0].to(from)};
    });
  }
  return out;
}

Tensor Tensor::pin_memory() const {
  detail::check_defined(*this, "pin_memory");
  LS_CHECK(device().is_cpu(), "pin_memory: expected a CPU tensor, got one on ", device().str());
  if (is_pinned()) return *this;
  Tensor out = empty_pinned(shape(), dtype());
  detail::kernel(&Kernels::copy, kCPU, "pin_memory")(out, *this);
  return out;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  detail::check_defined(*this, "to_vector");
  autograd::NoGradGuard g;
  Tensor c = to(kCPU).to(dtype_of<T>::value).contiguous();
  std::vector<T> v(static_cast<size_t>(c.numel()));
  if (!v.empty()) std::memcpy(v.data(), c.data_ptr(), v.size() * sizeof(T));
  return v;
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;

// ---- in-place ----

Tensor& Tensor::zero_() {
  check_inplace(*this, "zero_");
  detail::kernel(&Kernels::fill, device(), "zero_")(*this, 0.0);
  return *this;
}

Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_");
  detail::kernel(&Kernels::fill, device(), "fill_")(*this, value);
  return *this;
}

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace(*this, "copy_");
  detail::check_defined(src, "copy_", "source");
  // Between the CPU and a device, the device's kernel moves the data.
  const auto copy = detail::kernel(&Kernels::copy, device().is_cpu() ? src.device() : device(),
                                   "copy_");
  copy(*this, unaliased_source(src.expand(shape()), *this));
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  check_inplace(*this, "add_");
  LS_CHECK(dtype() != kBool, "add_: not defined for bool tensors");
  const auto add = detail::kernel(&Kernels::binary_inplace, device(), "add_");
  add(BinaryOp::add, *this, inplace_operand(*this, other, "add_"), alpha);
  return *this;
}

Tensor& Tensor::add_(double value) {
  return add_(full({}, value, detail::options_on(*this, dtype())));
}

Tensor& Tensor::mul_(const Tensor& other) {
  check_inplace(*this, "mul_");
  const auto mul = detail::kernel(&Kernels::binary_inplace, device(), "mul_");
  mul(BinaryOp::mul, *this, inplace_operand(*this, other, "mul_"), 1.0);
  return *this;
}

Tensor& Tensor::mul_(double value) {
  return mul_(full({}, value, detail::options_on(*this, dtype())));
}

}  // namespace lockstep
