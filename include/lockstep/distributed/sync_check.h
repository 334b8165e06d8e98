// Silent divergence: are the ranks' parameters and buffers still the same?
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// Note [Same settings]
// Some settings must be the same on every rank or the job trains on something else than what
// was asked, without a word: a rank-dependent --seed makes each rank's sampler shuffle its own
// way, so that samples are trained twice and others never; another batch size on one rank makes
// the consumed-samples count of a checkpoint wrong; other hyperparameters step the ranks
// differently. check_same_settings all-gathers a 64-bit hash of each (name, value) and, where a
// setting differs, the values themselves, so that every rank throws the same Error naming the
// setting and the values on each side: "ranks disagree on --seed: rank 0 has 1, rank 1 has 2
// (...)". Collective: every rank of `pg` calls it with the same names in the same order (a
// different count of settings is an error too). `why` ends the message: what goes wrong when the
// ranks disagree, and how to start them alike.
struct Setting {
  std::string name;   // as the user knows it: "--seed", "the training data"
  std::string value;  // as the user would write it
};
void check_same_settings(ProcessGroup& pg, const std::vector<Setting>& settings,
                         const std::string& why);

}  // namespace lockstep::dist
