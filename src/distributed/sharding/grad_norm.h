// The 2-norm of a gradient held in shards across ranks, summed exactly (Note [Exact norm]), so
// that it is the norm optim::clip_grad_norm gives over the whole gradient, bit for bit.
#pragma once

#include <vector>

#include "lockstep/distributed/process_group.h"

namespace lockstep::dist {

// Collective: the 2-norm of every element of `shards` on every rank together (each element held
// by one rank only; device tensors are read back to the host, as optim::clip_grad_norm reads
// them). NaN or inf when any element is. optim::scale_to_max_norm then scales the shards.
double sharded_grad_norm(ProcessGroup& pg, const std::vector<Tensor>& shards);

}  // namespace lockstep::dist
