// Ops that assemble or pick from tensors: cat, stack, split, unbind, index_select, gather.
#pragma once

#include <vector>

#include "lockstep/tensor/tensor.h"

namespace lockstep {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Views of `split_size` along dim (the last may be smaller).
std::vector<Tensor> split(const Tensor& t, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim = 0);
// The slices of `t` along dim, as views without that dim (torch.unbind). Their backward is one
// node that writes every slice's gradient into one tensor of t's shape, not one zero-filled
// tensor per slice summed afterwards.
std::vector<Tensor> unbind(const Tensor& t, int64_t dim = 0);
// Entries of `t` at integer `index` (1-D) along dim.
Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index);
// out[i][j] = t[index[i][j]][j] for dim 0, and so on (torch.gather).
Tensor gather(const Tensor& t, int64_t dim, const Tensor& index);

}  // namespace lockstep
