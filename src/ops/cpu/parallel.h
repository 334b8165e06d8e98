// parallel_for over an index range with OpenMP; serial below a grain size or inside a region.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>

#include "lockstep/ops/parallel.h"

namespace lockstep::cpu {

// Elementwise work below this many elements runs on the calling thread: waking a team costs
// a few microseconds, more than the work itself.
inline constexpr int64_t kElementwiseGrain = 32768;

// Calls f(b, e) on disjoint chunks covering [begin, end). Exceptions from f reach the caller.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int nt = get_num_threads();
  if (nt <= 1 || n <= grain || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  const int64_t chunks = std::min<int64_t>(nt, (n + grain - 1) / grain);
  const int64_t per = (n + chunks - 1) / chunks;
  std::exception_ptr error;
#pragma omp parallel num_threads(static_cast<int>(chunks))
  {
    // OpenMP may grant fewer threads than asked (OMP_DYNAMIC, OMP_THREAD_LIMIT): each thread
    // takes every team-size-th chunk, so all chunks run whatever the team size.
    const int64_t team = omp_get_num_threads();
    for (int64_t c = omp_get_thread_num(); c < chunks; c += team) {
      const int64_t b = begin + c * per;
      const int64_t e = std::min(end, b + per);
      if (b >= e) continue;
      try {
        f(b, e);
      } catch (...) {
#pragma omp critical(lockstep_parallel_for_error)
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace lockstep::cpu
