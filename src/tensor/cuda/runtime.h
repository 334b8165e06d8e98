// lockstep's own view of the CUDA runtime: the checking macros, the calling thread's current
// stream as a cudaStream_t, and the allocators' internal entry points. Included only by sources
// under src/**/cuda/ and src/distributed/nccl/, which a build without CUDA does not compile.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "lockstep/base/error.h"
#include "lockstep/tensor/cuda.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::cuda {

// Throws lockstep::Error naming the call, file:line and CUDA's own words for the error.
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);

#define LS_CUDA_CHECK(call)                                                          \
  do {                                                                               \
    cudaError_t ls_cuda_err_ = (call);                                               \
    if (ls_cuda_err_ != cudaSuccess) [[unlikely]]                                    \
      ::lockstep::cuda::throw_cuda_error(ls_cuda_err_, #call, __FILE__, __LINE__);   \
  } while (0)

// After every kernel launch: cudaGetLastError, and on failure an Error naming the op and the
// shape it was launched for ("add: CUDA kernel launch failed for shape [64, 10] of f32: ...").
void check_launch(const char* op, const Tensor& t);
void check_launch(const char* op);

// The calling thread's current stream on the current device.
cudaStream_t current_cuda_stream();
inline cudaStream_t raw(const Stream& s) { return static_cast<cudaStream_t>(s.handle()); }

// The device of a cuda tensor made current for a scope (cheap when it already is).
class TensorDeviceGuard {
 public:
  explicit TensorDeviceGuard(const Tensor& t);
  ~TensorDeviceGuard();
  TensorDeviceGuard(const TensorDeviceGuard&) = delete;
  TensorDeviceGuard& operator=(const TensorDeviceGuard&) = delete;

 private:
  int prev_ = -1;  // -1: nothing to restore
};

// The caching device allocator of `device` (src/tensor/cuda/allocator.cpp).
Allocator& device_allocator(int device);

// Pinned (page-locked) host memory for staging copies, cached by size class. free_pinned()
// gives a block back once the work queued on `stream` so far has finished, so a block is never
// reused while an asynchronous copy still reads or writes it.
void* alloc_pinned(size_t nbytes);
void free_pinned(void* ptr, cudaStream_t stream);
// A pinned block (its base address) is read or written by work queued on `stream`: when freed,
// it waits for that work before it is reused.
void fence_pinned(void* block, cudaStream_t stream);
// An Allocator over the pinned pool, for CPU tensors in page-locked memory (pin_memory()).
Allocator& pinned_allocator();
bool is_pinned(const void* ptr);

}  // namespace lockstep::cuda
