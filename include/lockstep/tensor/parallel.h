// Intra-op threads: one number for OpenMP loops and OpenBLAS.
#pragma once

namespace lockstep {

// Sets the threads used by kernels and by BLAS. The default comes from OMP_NUM_THREADS, else
// the number of cores.
void set_num_threads(int n);
int get_num_threads();

// How the linked OpenBLAS runs in parallel: "openmp" (what lockstep is built for, sharing
// one thread team with the kernels), "pthreads" or "sequential".
const char* blas_threading();

}  // namespace lockstep
