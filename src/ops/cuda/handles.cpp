// Pools of cuBLASLt and cuDNN handles per device (Note [Vendor handles] in handles.h).
#include "ops/cuda/handles.h"

#include <mutex>
#include <string>
#include <vector>

#include "lockstep/tensor/cuda.h"
#include "tensor/cuda/runtime.h"

namespace lockstep::cuda_ops {

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw Error(std::string(call) + " failed: " + cublasLtGetStatusName(status) + ": " +
                  cublasLtGetStatusString(status),
              file, line);
}

void throw_cudnn_error(cudnnStatus_t status, const char* call, const char* file, int line) {
  throw Error(std::string(call) + " failed: " + cudnnGetErrorString(status), file, line);
}

namespace {

// Free handles per device; a handle in use is held by its lease.
template <typename Handle>
class HandlePool {
 public:
  Handle take(int device, Handle (*create)()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (device < static_cast<int>(free_.size()) && !free_[device].empty()) {
        Handle h = free_[device].back();
        free_[device].pop_back();
        return h;
      }
    }
    return create();  // outside the lock: creating a cuDNN handle takes a while
  }

  void give_back(int device, Handle h) {
    std::lock_guard<std::mutex> lock(mu_);
    if (device >= static_cast<int>(free_.size())) free_.resize(device + 1);
    free_[device].push_back(h);
  }

 private:
  std::mutex mu_;
  std::vector<std::vector<Handle>> free_;
};

// Its destructor frees the lists only, never a handle (Note [Vendor handles]).
template <typename Handle>
HandlePool<Handle>& pool() {
  static HandlePool<Handle> p;
  return p;
}

cublasLtHandle_t create_cublas_lt() {
  cublasLtHandle_t h = nullptr;
  LS_CUBLAS_CHECK(cublasLtCreate(&h));
  return h;
}

cudnnHandle_t create_cudnn() {
  cudnnHandle_t h = nullptr;
  LS_CUDNN_CHECK(cudnnCreate(&h));
  return h;
}

}  // namespace

CublasLtLease::CublasLtLease()
    : device_(cuda::current_device()),
      handle_(pool<cublasLtHandle_t>().take(device_, create_cublas_lt)) {}

CublasLtLease::~CublasLtLease() { pool<cublasLtHandle_t>().give_back(device_, handle_); }

CudnnLease::CudnnLease()
    : device_(cuda::current_device()), handle_(pool<cudnnHandle_t>().take(device_, create_cudnn)) {
  const cudnnStatus_t status = cudnnSetStream(handle_, cuda::current_cuda_stream());
  if (status != CUDNN_STATUS_SUCCESS) {
    pool<cudnnHandle_t>().give_back(device_, handle_);
    throw_cudnn_error(status, "cudnnSetStream(handle_, cuda::current_cuda_stream())", __FILE__,
                      __LINE__);
  }
}

CudnnLease::~CudnnLease() { pool<cudnnHandle_t>().give_back(device_, handle_); }

}  // namespace lockstep::cuda_ops
