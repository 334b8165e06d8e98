// The vendor libraries behind the CUDA kernels: cuBLASLt and cuDNN handles leased per device,
// and the checks of their status codes.
#pragma once

#include <cublasLt.h>
#include <cudnn.h>

#include "lockstep/base/error.h"

namespace lockstep::cuda_ops {

// Throw lockstep::Error naming the call, file:line and the library's own words for the status.
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                     int line);
[[noreturn]] void throw_cudnn_error(cudnnStatus_t status, const char* call, const char* file,
                                    int line);

// The one shape of a vendor call's check (as LS_CUDA_CHECK in src/tensor/cuda/runtime.h).
#define LS_VENDOR_CHECK(Status, kOk, thrower, call)          \
  do {                                                       \
    const Status ls_vendor_status_ = (call);                 \
    if (ls_vendor_status_ != kOk) [[unlikely]]               \
      thrower(ls_vendor_status_, #call, __FILE__, __LINE__); \
  } while (0)

#define LS_CUBLAS_CHECK(call)                                                                      \
  LS_VENDOR_CHECK(cublasStatus_t, CUBLAS_STATUS_SUCCESS, ::lockstep::cuda_ops::throw_cublas_error, \
                  call)
#define LS_CUDNN_CHECK(call)                                                                    \
  LS_VENDOR_CHECK(cudnnStatus_t, CUDNN_STATUS_SUCCESS, ::lockstep::cuda_ops::throw_cudnn_error, \
                  call)

// Note [Vendor handles]
// A cuBLASLt or cuDNN handle belongs to the device that was current when it was created, and a
// cuDNN handle carries a stream (cudnnSetStream), so two threads must not use one at the same
// time (DDP's ranks may be threads sharing a device). Each device keeps a pool of handles: an
// op leases one for its duration (creating one only when every handle of the device is in use)
// and gives it back, so a steady training step creates none. The pools live until the process
// ends and never destroy their handles: at exit the CUDA runtime may already be gone, and
// destroying a handle then can crash (PyTorch leaks its handles for the same reason).

// The current device's cuBLASLt handle for the lifetime of this object.
class CublasLtLease {
 public:
  CublasLtLease();
  ~CublasLtLease();
  CublasLtLease(const CublasLtLease&) = delete;
  CublasLtLease& operator=(const CublasLtLease&) = delete;
  cublasLtHandle_t get() const { return handle_; }

 private:
  int device_ = 0;
  cublasLtHandle_t handle_ = nullptr;
};

// The current device's cuDNN handle, set to the calling thread's current stream.
class CudnnLease {
 public:
  CudnnLease();
  ~CudnnLease();
  CudnnLease(const CudnnLease&) = delete;
  CudnnLease& operator=(const CudnnLease&) = delete;
  cudnnHandle_t get() const { return handle_; }

 private:
  int device_ = 0;
  cudnnHandle_t handle_ = nullptr;
};

}  // namespace lockstep::cuda_ops
