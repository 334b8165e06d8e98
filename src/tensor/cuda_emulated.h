// Emulated CUDA devices (Note [Emulated CUDA devices] in cuda_emulated.cpp): what the runtime
// (src/tensor/cuda/runtime.cpp, or cuda_none.cpp in a build without CUDA), the tensor factory,
// the kernel table and the process groups need of them. cuda::emulated() is public (cuda.h).
#pragma once

#include <cstdint>

#include "lockstep/tensor/allocator.h"
#include "lockstep/tensor/cuda.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::cuda::emulation {

// The number of emulated devices (LOCKSTEP_TEST_EMULATE_GPUS), 0 when emulation is off. Read
// once; a value that is not an integer in [1, 64] is an Error naming the variable.
int device_count();
// Throws unless `index` is an emulated device.
void check_index(int index, const char* what);
// Host memory labelled cuda:`device`, with the statistics memory_stats() reports.
Allocator& allocator(int device);
MemoryStats memory_stats(int device);
void reset_peak_stats(int device);
// A monotonic clock for Event timing (nanoseconds).
int64_t now_ns();

}  // namespace lockstep::cuda::emulation

namespace lockstep::detail {

// The memory of a tensor on an emulated device, seen as the CPU tensor it is (same shape,
// strides, offset and dtype; it keeps the storage alive). Only kernels and the emulated NCCL
// group use it: code outside the device seam must copy with .to(kCPU), as on a real GPU.
Tensor emulated_as_host(const Tensor& t);

}  // namespace lockstep::detail
