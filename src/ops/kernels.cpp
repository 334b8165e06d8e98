// Which device types have a kernel table in this build, and the error for a missing kernel.
#include "ops/kernels.h"

#include "lockstep/tensor/cuda.h"

#ifdef LOCKSTEP_WITH_CUDA
#include "ops/cuda/kernels.h"
#endif

namespace lockstep::detail {

// Note [Emulated kernels]
// The table of emulated CUDA devices (Note [Emulated CUDA devices] in
// src/tensor/cuda_emulated.cpp): the CPU's kernels, which read the host memory behind those
// devices, so an emulated run computes the bits of the same run on CPUs (the copy kernel takes
// either side on the CPU or on an emulated GPU, which is how data moves between them, and how
// the CPU kernels' own f32 scratch reaches a bf16 output). The CUDA table has every kernel the
// CPU's has, so an op fails on an emulated GPU only where it would on a real one
// (Emulated.KernelTableLacksWhatTheCudaTableLacks in tests/cuda/emulated_test.cpp compares the
// two tables in a CUDA build; an entry CUDA leaves null must be nulled here). The multi-tensor
// entries, which the CPU leaves to loops, stay null, so optimizers and the GradScaler take
// their host loops there (the CUDA multi-tensor kernels are checked on a GPU only).
const Kernels& emulated_kernels() {
  static const Kernels k = kCpuKernels;
  return k;
}

const Kernels* device_kernels(DeviceType type) {
  switch (type) {
    case DeviceType::cpu:
      return &kCpuKernels;
    case DeviceType::cuda:
      if (cuda::emulated()) return &emulated_kernels();
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
