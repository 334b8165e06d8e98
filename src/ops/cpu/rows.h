// Rows along one dimension of strided tensors, and row-parallel loops, for row-wise kernels
// (softmax, losses, normalization).
#pragma once

#include <array>
#include <cstdint>

#include "lockstep/tensor/tensor.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

// The rows of N operands of one shape along `dim`: row r is the r-th position (row-major) over
// all the other dims, and its elements are `length()` steps of `step(k)` elements apart. Any
// strides work (views, expanded tensors), so kernels read their inputs without a copy.
template <int N>
class Rows {
 public:
  Rows(const Dims& shape, int64_t dim, const std::array<const Tensor*, N>& ops) {
    length_ = shape[dim];
    for (int k = 0; k < N; ++k) step_[k] = ops[k]->stride(dim);
    for (int64_t d = 0; d < shape.size(); ++d) {
      if (d == dim || shape[d] == 1) continue;
      outer_[ndim_] = shape[d];
      for (int k = 0; k < N; ++k) strides_[k][ndim_] = ops[k]->stride(d);
      count_ *= shape[d];
      ++ndim_;
    }
  }

  int64_t count() const { return count_; }
  int64_t length() const { return length_; }
  int64_t step(int k) const { return step_[k]; }

  // Element offsets (from each operand's data_ptr()) of row r's first element.
  void offsets(int64_t r, int64_t* off) const {
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int64_t d = ndim_ - 1; d >= 0; --d) {
      const int64_t i = r % outer_[d];
      r /= outer_[d];
      for (int k = 0; k < N; ++k) off[k] += i * strides_[k][d];
    }
  }

 private:
  int64_t length_ = 0;
  int64_t count_ = 1;
  int64_t ndim_ = 0;
  std::array<int64_t, N> step_{};
  int64_t outer_[Dims::kMaxDims] = {};
  int64_t strides_[N][Dims::kMaxDims] = {};
};

// Calls f(r) for every row in [0, rows), in parallel when the rows hold enough work: the grain
// keeps a chunk at about kElementwiseGrain elements, so small tensors stay on one thread.
template <typename F>
void parallel_rows(int64_t rows, int64_t row_length, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(row_length, 1));
  parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) f(r);
  });
}

}  // namespace lockstep::cpu
