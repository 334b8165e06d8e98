// LS_HOST_DEVICE marks a small function that both the CPU code and CUDA kernels call: nvcc
// compiles it for both sides, a plain C++ compiler sees an inline function.
#pragma once

#if defined(__CUDACC__)
#define LS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LS_HOST_DEVICE inline
#endif
