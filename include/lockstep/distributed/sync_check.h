// Silent divergence: are the ranks' parameters and buffers still the same?
#pragma once

#include <cstdint>

#include "lockstep/distributed/process_group.h"
#include "lockstep/nn/module.h"

namespace lockstep::dist {

// Note [Sync check]
// Data-parallel ranks hold the same model only as long as every rank applies the same update;
// a bug (a rank-dependent branch, an optimizer stepped on one rank, a buffer updated outside the
// forward) makes them drift apart silently. check_in_sync hashes every parameter and buffer of
// `module` (64 bits each, over their bytes) and all-gathers the hashes: one small collective.
// Every rank then sees the same table; when a tensor's hash differs between ranks, every rank
// throws the same Error naming the first such tensor (in named_parameters, then named_buffers
// order) and the ranks on each side: "parameters diverged: 'fc1.weight' differs between ranks:
// ranks 0, 2 hold one value (hash ...), rank 1 another (hash ...)". Collective: every rank of
// `pg` must call it at the same point. DDPOptions::check_sync_every runs it from DDP's forward.
void check_in_sync(const nn::Module& module, ProcessGroup& pg);

// The 64-bit hash check_in_sync compares: of the tensor's bytes in row-major order (so a
// non-contiguous view hashes as its contiguous copy), its dtype and its shape.
uint64_t tensor_hash(const Tensor& t);

}  // namespace lockstep::dist
