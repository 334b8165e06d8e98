// ZeroRedundancyOptimizer (ZeRO stage 1): each rank keeps the optimizer state of a 1/world_size
// shard of the flattened parameters, steps only that shard, and all-gathers the updated values.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/optim/optimizer.h"

namespace lockstep::dist {

// Builds the wrapped optimizer over the groups it is handed: this rank's pieces of the user's
// groups, with their lr and weight decay (e.g. [](auto g) { return
// std::make_unique<optim::AdamW>(std::move(g), opts); }).
using OptimizerFactory =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

struct ZeroOptions {
  // Note [ZeRO-1], Reduce-scatter: step() reduce-scatters the gradients itself, so each rank
  // receives only its shard's average, and DDP must not average them first: build DDP with
  // DDPOptions::comm_hook = zero_hook(). Then .grad() holds this rank's own gradient after
  // backward (clip_grad_norm, a GradScaler's unscale_ and anything else that reads gradients
  // before step() see local values). Bitwise equal to plain DDP where the backend's
  // reduce_scatter adds like its all_reduce: shm and Gloo (both in rank order, any number of
  // ranks) and any backend with 2 ranks.
  bool reduce_scatter_gradients = false;
};

// DDP's comm hook for ZeroOptions::reduce_scatter_gradients: averages only the reducer's own
// elements of each bucket (the unused-parameter status, the slow-rank times of Note [Slow rank])
// and leaves the gradients as they are, for step()'s reduce-scatter.
CommHook zero_hook();

// What ZeRO saves, on this rank.
struct ZeroStats {
  int64_t total_elements = 0;  // parameter elements over all groups
  int64_t shard_elements = 0;  // elements per rank's shard: ceil(total / world)
  int64_t padding = 0;         // shard_elements * world - total (on the last ranks)
  int64_t state_bytes = 0;     // this rank's optimizer state (all fields, scalars included)
};

// Note [ZeRO-1] (src/distributed/zero.cpp): the parameters of all groups, flattened in group
// then parameter order and padded to a multiple of the world size, are cut into world_size equal
// contiguous shards; rank r owns shard r. step() steps the wrapped optimizer over this rank's
// pieces (the parts of parameters inside its shard, with their averaged gradients) and
// all-gathers the shards back into every rank's parameters. With an element-wise optimizer (SGD,
// AdamW) the parameters are bitwise those of the wrapped optimizer stepping everything.
//
// Construct it on every rank of `pg` with the same parameters (DDP's module's parameters; every
// rank must hold the same values, as DDP's broadcast ensures). Parameters: one dtype (f32 or
// f64) and one device.
//
// It is an optim::Optimizer, so a schedule, a GradScaler and a checkpoint take it as they take the
// optimizer it wraps: param_groups() are the user's groups over the whole parameters (set_lr and
// a schedule write there; step() hands lr and weight decay on to the wrapped optimizer), and
// zero_grad() drops the whole parameters' gradients. step(), and so GradScaler::step, and
// state_dict() are collective: every rank calls them together. Inside a dist::Join, give it as
// JoinOptions::optimizer: a joined rank then takes the step with the others (Note [Join and
// ZeRO] in join.h).
class ZeroRedundancyOptimizer : public optim::Optimizer {
 public:
  ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, ProcessGroupPtr pg,
                          const OptimizerFactory& make, ZeroOptions opts = {});
  ZeroRedundancyOptimizer(const std::vector<Tensor>& params, ProcessGroupPtr pg,
                          const OptimizerFactory& make, ZeroOptions opts = {})
      : ZeroRedundancyOptimizer({optim::ParamGroup{params}}, std::move(pg), make, opts) {}
  ~ZeroRedundancyOptimizer() override;

  // Collective: steps this rank's shard, then all-gathers every shard into the parameters.
  void step() override;

  // Collective: the full state, exactly what the wrapped optimizer's state_dict() would be over
  // all parameters ("<index>.<field>" with the parameters' shapes, "step", "group.<g>.lr"), on
  // every rank. A checkpoint of a ZeRO run is therefore an ordinary checkpoint.
  optim::NamedTensors state_dict() const override;
  // Local (every rank, with the same `state`): takes this rank's shard of a full state, from
  // state_dict() of a ZeRO run of any world size or of a plain optimizer.
  void load_state_dict(const optim::NamedTensors& state) override;

  ZeroStats stats() const;
  // The wrapped optimizer over this rank's pieces; null on a rank whose shard is all padding.
  optim::Optimizer* local_optimizer() { return local_.get(); }

 protected:
  std::vector<std::string> state_fields() const override { return {}; }

 private:
  struct Piece {
    size_t param = 0;          // index over all groups' parameters, in order
    int64_t param_offset = 0;  // first element of the parameter in this piece
    int64_t shard_offset = 0;  // where it starts in shard_
    int64_t numel = 0;
    Tensor tensor;  // shard_'s slice: what the wrapped optimizer steps
  };

  ProcessGroupPtr pg_;
  ZeroOptions opts_;
  void reduce_scatter_gradients();

  std::vector<Tensor> params_;   // all groups', in order (as in groups_)
  std::vector<int64_t> offset_;  // each parameter's first element in the flat order
  std::vector<size_t> group_of_;
  int64_t total_ = 0;
  int64_t chunk_ = 0;
  Tensor shard_;  // (chunk_): this rank's shard of the flat parameters
  Tensor flat_;   // (chunk_ * world): the all-gathered parameters
  // reduce_scatter_gradients: the local gradients, flat and padded (chunk_ * world), and this
  // rank's shard of their average (chunk_).
  Tensor grad_flat_, grad_shard_;
  std::vector<Piece> pieces_;
  std::unique_ptr<optim::Optimizer> local_;
};

}  // namespace lockstep::dist
