// FullyShardedDataParallel's unit: a run of parameters laid out flat, sharded and gathered
// together (Note [FSDP] in src/distributed/sharding/fsdp.cpp); shared by fsdp.cpp and
// fsdp_state.cpp.
#pragma once

#include <string>
#include <vector>

#include "lockstep/distributed/fsdp.h"

namespace lockstep::dist {

struct FullyShardedDataParallel::Unit {
  int index = 0;
  std::string name;              // the module's path; "" for the root
  nn::Module* module = nullptr;  // null for the root
  std::vector<size_t> params;    // indices into params_, in layout order
  int64_t numel = 0, padded = 0, shard_numel = 0;
  DType dtype = DType::f32;    // the master shard's (the parameters' as built)
  DType compute = DType::f32;  // the gathered run's (FSDPOptions::param_dtype)
  DType reduce = DType::f32;   // the full gradient's and its reduction's (reduce_dtype)
  Tensor gather_input;         // the shard cast to `compute` while its gather is in flight
  Storage full;       // what the parameters view: padded elements while gathered, else none
  Tensor shard;       // (shard_numel): this rank's master values, the registered parameter
  Tensor grad_full;   // (padded): summed local gradients of this backward (and no_sync's)
  Tensor grad_shard;  // (shard_numel): the averaged gradient of the shard
  WorkPtr gather;     // in flight
  bool gathered = false;
  GradBucket bucket;          // what the comm hook reduces: grad_full into grad_shard
  WorkPtr scatter;            // in flight
  bool reduced = false;       // its reduction was issued in this backward
  int pending = -1;           // gradients not yet arrived in this backward (-1: none arrived yet)
  int grad_params = 0;        // parameters that require grad
  std::vector<int> hook_ids;  // on `module`

  int64_t bytes() const { return padded * dtype_size(compute); }
  Tensor full_flat() const {
    return Tensor(std::make_shared<TensorImpl>(full, Dims{padded}, Dims{1}, 0, compute));
  }
};

}  // namespace lockstep::dist
