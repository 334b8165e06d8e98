// Thread count shared by OpenMP kernels and OpenBLAS.
#include "lockstep/tensor/parallel.h"

#include <cblas.h>
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "lockstep/base/env_var.h"
#include "lockstep/base/error.h"
#include "lockstep/base/worker_env.h"

namespace lockstep {

namespace {
int initial_threads() {
  // OpenMP's variable, read as OpenMP reads it: "8,4" (a list for nested levels) is 8 here, and
  // what does not start with a positive number leaves the choice to the hardware.
  if (const auto v = env_string(env::kOmpNumThreads)) {
    const int n = std::atoi(v->c_str());
    if (n > 0) return n;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

std::atomic<int>& threads() {
  static std::atomic<int> n = [] {
    int v = initial_threads();
    openblas_set_num_threads(v);
    return v;
  }();
  return n;
}
}  // namespace

void set_num_threads(int n) {
  LS_CHECK(n > 0, "set_num_threads: expected a positive thread count, got ", n);
  threads().store(n);
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

int get_num_threads() { return threads().load(std::memory_order_relaxed); }

const char* blas_threading() {
  switch (openblas_get_parallel()) {
    case 0: return "sequential";
    case 1: return "pthreads";
    case 2: return "openmp";
  }
  return "unknown";
}

}  // namespace lockstep
