// Tensor creation by allocation: empty, zeros, from memory. Creation that runs a kernel (full,
// ones, arange, random tensors) is in src/ops/factory.cpp.
#include <cstring>

#include "lockstep/tensor/tensor.h"

#include "tensor/cuda_emulated.h"
#ifdef LOCKSTEP_WITH_CUDA
#include "tensor/cuda/runtime.h"
#endif

namespace lockstep {

namespace {

Allocator* allocator_for(Device d) {
  if (d.is_cpu()) [[likely]] return &cpu_allocator();
  if (cuda::emulated()) return &cuda::emulation::allocator(d.index);
#ifdef LOCKSTEP_WITH_CUDA
  return &cuda::device_allocator(d.index);
#else
  LS_THROW("cannot allocate on ", d.str(),
           ": this build of lockstep has no CUDA support (configure on a machine with the CUDA "
           "toolkit to enable it)");
#endif
}

// Validates a shape and returns its size in bytes for `dtype`, refusing overflow.
size_t checked_nbytes(const Dims& shape, DType dtype, const char* op) {
  for (int64_t s : shape) LS_CHECK(s >= 0, op, ": negative dimension in shape ", shape.str());
  int64_t bytes = 0;
  LS_CHECK(!__builtin_mul_overflow(shape.numel(), dtype_size(dtype), &bytes), op, ": shape ",
           shape.str(), " of ", dtype_name(dtype), " needs more bytes than fit in 64 bits");
  return static_cast<size_t>(bytes);
}

}  // namespace

Tensor empty(const Dims& shape, TensorOptions opts) {
  const size_t nbytes = checked_nbytes(shape, opts.dtype, "empty");
  auto storage = std::make_shared<StorageImpl>(nbytes, allocator_for(opts.device));
  Tensor t(std::make_shared<TensorImpl>(std::move(storage), shape, contiguous_strides(shape), 0,
                                        opts.dtype));
  if (opts.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor empty_pinned(const Dims& shape, DType dtype) {
#ifdef LOCKSTEP_WITH_CUDA
  if (cuda::is_available() && !cuda::emulated()) {  // emulated devices read any host memory
    const size_t nbytes = checked_nbytes(shape, dtype, "empty_pinned");
    auto storage = std::make_shared<StorageImpl>(nbytes, &cuda::pinned_allocator());
    return Tensor(std::make_shared<TensorImpl>(std::move(storage), shape, contiguous_strides(shape),
                                               0, dtype));
  }
#endif
  return empty(shape, dtype);
}

bool Tensor::is_pinned() const {
#ifdef LOCKSTEP_WITH_CUDA
  if (defined() && device().is_cpu() && cuda::is_available() && !cuda::emulated())
    return cuda::is_pinned(storage()->data());
#endif
  return false;
}

Tensor empty_strided(const Dims& shape, const Dims& strides, TensorOptions opts) {
  checked_nbytes(shape, opts.dtype, "empty_strided");
  LS_CHECK(shape.size() == strides.size(), "empty_strided: shape ", shape.str(), " and strides ",
           strides.str(), " differ in length");
  for (int64_t st : strides) LS_CHECK(st >= 0, "empty_strided: negative stride in ", strides.str());
  int64_t extent = shape.numel() == 0 ? 0 : 1;
  for (int64_t d = 0; d < shape.size() && extent; ++d) extent += (shape[d] - 1) * strides[d];
  auto storage = std::make_shared<StorageImpl>(static_cast<size_t>(extent * dtype_size(opts.dtype)),
                                               allocator_for(opts.device));
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), shape, strides, 0, opts.dtype));
}

Tensor zeros(const Dims& shape, TensorOptions opts) {
  bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  // A device's memory is not the host's to memset (the GPU check crashed here, in the backward
  // of slice and wherever else zeros of a CUDA tensor were made): its fill kernel zeroes it.
  if (t.device().is_cpu()) {
    std::memset(t.data_ptr(), 0, static_cast<size_t>(t.nbytes()));
  } else {
    t.zero_();
  }
  if (rg) t.requires_grad_(true);
  return t;
}

Tensor empty_like(const Tensor& t) {
  return empty(t.shape(), TensorOptions(t.dtype()).with_device(t.device()));
}
Tensor zeros_like(const Tensor& t) {
  return zeros(t.shape(), TensorOptions(t.dtype()).with_device(t.device()));
}

Tensor from_buffer(const void* data, const Dims& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  if (t.nbytes() > 0) std::memcpy(t.data_ptr(), data, static_cast<size_t>(t.nbytes()));
  return t;
}

Tensor borrow(void* data, const Dims& shape, DType dtype, Device device) {
  const size_t nbytes = checked_nbytes(shape, dtype, "borrow");
  LS_CHECK(data != nullptr || shape.numel() == 0, "borrow: null data for shape ", shape.str());
  auto storage = std::make_shared<StorageImpl>(data, nbytes, device);
  return Tensor(
      std::make_shared<TensorImpl>(std::move(storage), shape, contiguous_strides(shape), 0, dtype));
}

}  // namespace lockstep
