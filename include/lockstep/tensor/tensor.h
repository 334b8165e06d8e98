// Tensor: a cheap-to-copy handle (shared ownership) to a strided view of typed storage.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/base/error.h"
#include "lockstep/tensor/device.h"
#include "lockstep/tensor/dims.h"
#include "lockstep/tensor/dtype.h"
#include "lockstep/tensor/generator.h"
#include "lockstep/tensor/half.h"
#include "lockstep/tensor/storage.h"
#include "lockstep/tensor/tensor_impl.h"

namespace lockstep {

struct TensorOptions {
  DType dtype = DType::f32;
  Device device = kCPU;
  bool requires_grad = false;

  TensorOptions() = default;
  TensorOptions(DType t) : dtype(t) {}  // NOLINT: `zeros({2, 3}, kFloat64)` reads well
  TensorOptions(Device d) : device(d) {}  // NOLINT
  TensorOptions with_dtype(DType t) const { auto o = *this; o.dtype = t; return o; }
  TensorOptions with_device(Device d) const { auto o = *this; o.device = d; return o; }
  TensorOptions with_requires_grad(bool r = true) const {
    auto o = *this;
    o.requires_grad = r;
    return o;
  }
};

// The C++ type stored for each DType.
template <typename T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::b8; };

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  // True when both handles refer to the same tensor (not merely equal values).
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

  // ---- metadata ----
  const Dims& shape() const { return impl_->shape_; }
  const Dims& strides() const { return impl_->strides_; }
  int64_t dim() const { return impl_->shape_.size(); }
  // Negative d counts from the end, as in PyTorch.
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t offset() const { return impl_->offset_; }
  int64_t numel() const { return impl_->shape_.numel(); }
  DType dtype() const { return impl_->dtype_; }
  Device device() const { return impl_->storage_->device(); }
  int64_t element_size() const { return dtype_size(dtype()); }
  int64_t nbytes() const { return numel() * element_size(); }
  bool is_contiguous() const;
  const Storage& storage() const { return impl_->storage_; }
  void* data_ptr() const;
  // Typed pointer to the first element; checks that T matches the dtype.
  template <typename T>
  T* data() const {
    LS_CHECK(dtype_of<T>::value == dtype(), "data<T>(): tensor has dtype ", dtype_name(dtype()),
             " but ", dtype_name(dtype_of<T>::value), " was requested");
    return static_cast<T*>(data_ptr());
  }

  // ---- views (share storage; differentiable) ----
  Tensor view(const Dims& shape) const;     // requires compatible strides; -1 infers one dim
  Tensor reshape(const Dims& shape) const;  // a view when possible, else a copy
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;  // 2-D transpose
  Tensor permute(const Dims& order) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;  // removes `dim`
  Tensor expand(const Dims& shape) const;           // -1 keeps a size
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor contiguous() const;  // this tensor if already contiguous, else a copy

  // ---- conversion and copies ----
  Tensor to(DType t) const;  // this tensor when already of dtype t
  Tensor to(Device d) const;
  Tensor clone() const;
  // A copy in pinned memory (this tensor if it is already pinned); CPU tensors only.
  Tensor pin_memory() const;
  bool is_pinned() const;

  // ---- element access (for tests and debugging; not fast) ----
  double item() const;  // a one-element tensor's value (a device tensor is copied back first)
  double at(const Dims& index) const;
  void set_at(const Dims& index, double value);
  template <typename T>
  std::vector<T> to_vector() const;  // row-major copy of all elements, converted to T

  // ---- in-place (not recorded by autograd; refuse tensors that need grad while grad mode is on)
  Tensor& zero_();
  Tensor& fill_(double value);
  Tensor& copy_(const Tensor& src);  // broadcasts src; converts dtype
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& add_(double value);
  Tensor& mul_(const Tensor& other);
  Tensor& mul_(double value);

  // ---- autograd ----
  bool requires_grad() const { return impl_->requires_grad_; }
  Tensor& requires_grad_(bool enabled = true);
  bool is_leaf() const { return impl_->grad_fn_ == nullptr; }
  const std::shared_ptr<autograd::Node>& grad_fn() const { return impl_->grad_fn_; }
  Tensor grad() const;
  void set_grad(const Tensor& g) const;
  Tensor detach() const;  // same storage, no history
  // Runs backward from this tensor; `gradient` may be omitted for a one-element tensor.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;
  // Fired once per backward, right after this leaf's .grad() received its full gradient.
  // Returns an id for remove_post_accumulate_grad_hook.
  int register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const;
  void remove_post_accumulate_grad_hook(int id) const;

  std::string to_string() const;

 private:
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// ---- creation ----
Tensor empty(const Dims& shape, TensorOptions opts = {});
Tensor empty_strided(const Dims& shape, const Dims& strides, TensorOptions opts = {});
Tensor zeros(const Dims& shape, TensorOptions opts = {});
Tensor ones(const Dims& shape, TensorOptions opts = {});
Tensor full(const Dims& shape, double value, TensorOptions opts = {});
Tensor scalar_tensor(double value, TensorOptions opts = {});
Tensor empty_like(const Tensor& t);
// A CPU tensor in page-locked (pinned) memory from the CUDA pinned pool: a copy from or to a GPU
// is then one asynchronous DMA. Where no GPU is visible (or without CUDA support) pinning has no
// purpose and this is ordinary CPU memory (is_pinned() says which).
Tensor empty_pinned(const Dims& shape, DType dtype);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
// [start, end) in steps of `step`.
Tensor arange(double start, double end, double step = 1.0, TensorOptions opts = {});
Tensor arange(int64_t end, TensorOptions opts = DType::i64);
// Copies nbytes = numel * dtype_size bytes from `data`.
Tensor from_buffer(const void* data, const Dims& shape, DType dtype);
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Dims& shape) {
  LS_CHECK(static_cast<int64_t>(values.size()) == shape.numel(), "from_vector: ", values.size(),
           " values cannot fill shape ", shape.str(), " (", shape.numel(), " elements)");
  if constexpr (std::is_same_v<T, bool>) {  // std::vector<bool> is packed: widen to bytes
    std::vector<uint8_t> bytes(values.begin(), values.end());
    return from_buffer(bytes.data(), shape, DType::b8);
  } else {
    return from_buffer(values.data(), shape, dtype_of<T>::value);
  }
}
// Wraps memory the caller owns and keeps alive; no copy.
Tensor borrow(void* data, const Dims& shape, DType dtype, Device device = kCPU);

// Uniform in [low, high).
Tensor rand(const Dims& shape, Generator& gen, TensorOptions opts = {}, double low = 0.0,
            double high = 1.0);
// Standard normal times std plus mean (Box-Muller on Philox output).
Tensor randn(const Dims& shape, Generator& gen, TensorOptions opts = {}, double mean = 0.0,
             double std = 1.0);
// Integers uniform in [low, high).
Tensor randint(int64_t low, int64_t high, const Dims& shape, Generator& gen,
               TensorOptions opts = DType::i64);

// Contiguous strides for a shape.
Dims contiguous_strides(const Dims& shape);

}  // namespace lockstep
