// The one place the average over the world size becomes the average over the ranks that
// contributed (Note [Join] in include/lockstep/distributed/join.h): DDP's buckets after their
// hooks finished, FSDP's gradient shards after their reduce-scatter.
#pragma once

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::dist::detail {

// Inside a dist::Join the ranks out of data contribute zeros, and a hook divides the sum by the
// world size; this multiplies `average` in place by world / contributors. contributors 0 (no Join)
// or equal to the world: nothing to do.
inline void rescale_to_contributors(Tensor average, int contributors, int world) {
  if (contributors <= 0 || contributors == world) return;
  autograd::NoGradGuard no_grad;
  average.mul_(static_cast<double>(world) / contributors);
}

}  // namespace lockstep::dist::detail
