// parallel_for over an index range with OpenMP; serial below a grain size or inside a region.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <vector>

#include "lockstep/tensor/parallel.h"

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

// Elements per block of a blocked reduction: fixed, so the result does not depend on the thread
// count (each block is summed serially, blocks are combined in order).
inline constexpr int64_t kReduceBlock = 16384;

// Sum of f(i) over [0, n) in double: blocks of kReduceBlock in parallel, deterministic.
template <typename F>
double blocked_sum(int64_t n, const F& f) {
  const int64_t blocks = (n + kReduceBlock - 1) / kReduceBlock;
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  parallel_for(0, blocks, 2, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      double acc = 0;
      const int64_t end = std::min(n, (k + 1) * kReduceBlock);
      for (int64_t i = k * kReduceBlock; i < end; ++i) acc += f(i);
      partial[static_cast<size_t>(k)] = acc;
    }
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace lockstep::cpu
