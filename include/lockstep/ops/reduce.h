// Reductions over all elements or over a set of dimensions (keepdim as in PyTorch).
#pragma once

#include <utility>

#include "lockstep/tensor/tensor.h"

namespace lockstep {

// Over everything: a 0-dim tensor. Integer and bool inputs sum to i64.
Tensor sum(const Tensor& a);
Tensor mean(const Tensor& a);
// Over `dims` (negative counts from the end; an empty list means all).
Tensor sum(const Tensor& a, const Dims& dims, bool keepdim = false);
Tensor mean(const Tensor& a, const Dims& dims, bool keepdim = false);
// Variance with Bessel's correction by default (correction = 1), as torch.var.
Tensor var(const Tensor& a, const Dims& dims, int64_t correction = 1, bool keepdim = false);
Tensor var(const Tensor& a, int64_t correction = 1);

// Largest / smallest element.
Tensor max(const Tensor& a);
Tensor min(const Tensor& a);
// Along one dim: (values, indices), indices i64; the first index wins ties.
std::pair<Tensor, Tensor> max(const Tensor& a, int64_t dim, bool keepdim = false);
std::pair<Tensor, Tensor> min(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor argmin(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& a);  // flat index

// Sums `grad` over broadcast dimensions so that it has `shape` (the reverse of expand); the
// gradient of a broadcasting op's input.
Tensor sum_to(const Tensor& grad, const Dims& shape);

}  // namespace lockstep
