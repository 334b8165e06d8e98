// Which device types have a kernel table in this build, and the error for a missing kernel.
#include "ops/kernels.h"

#ifdef LOCKSTEP_WITH_CUDA
#include "ops/cuda/kernels.h"
#endif

namespace lockstep::detail {

const Kernels* device_kernels(DeviceType type) {
  switch (type) {
    case DeviceType::cpu:
      return &kCpuKernels;
    case DeviceType::cuda:
#ifdef LOCKSTEP_WITH_CUDA
      return &cuda_ops::table();
#else
      return nullptr;  // a build without CUDA has no table for it
#endif
  }
  return nullptr;
}

void throw_no_kernel(const char* op, const Device& device, bool device_has_table) {
  if (!device_has_table) {
    LS_THROW(op, ": tensor on ", device.str(), " but this build of lockstep has no ", device.str(),
             " support (it has kernels for cpu only)");
  }
  LS_THROW(op, ": no kernel for ", device.str(), " (the op exists for cpu only)");
}

}  // namespace lockstep::detail
