// ZeroRedundancyOptimizer (ZeRO stage 1): each rank keeps the optimizer state of a 1/world_size
// shard of the flattened parameters, steps only that shard, and all-gathers the updated values.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/distributed/comm_hook.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/optim/optimizer.h"

namespace lockstep::dist {

// Builds the wrapped optimizer over the groups it is handed: this rank's pieces of the user's
// groups, with their lr and weight decay (e.g. [](auto g) { return
// std::make_unique<optim::AdamW>(std::move(g), opts); }).
using OptimizerFactory =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

struct ZeroOptions {
  // Note [ZeRO-1], Reduce-scatter: DDP's buckets are reduce-scattered during the backward pass
  // instead of all-reduced, each rank receiving the average of its shard of every bucket only.
  // Register comm_hook() with the DDP model (DistributedDataParallel::register_comm_hook, before
  // the first backward). Each bucket is reduce-scattered in place: after backward .grad() holds
  // the average in this rank's shard and local values elsewhere (anything that reads gradients
  // before step() sees them: clip with clip_grad_norm() below, or the DDP model's; a
  // GradScaler goes through step_gradients() and agree_found_inf(), so it works as usual).
  // Bitwise equal to plain DDP where the backend's reduce_scatter adds like its all_reduce: shm
  // and Gloo (both in rank order, any number of ranks) and any backend with 2 ranks.
  bool reduce_scatter_gradients = false;
  // Note [ZeRO-1], Overlap: step() leaves the parameters' all-gathers running and returns; the
  // next forward of the DDP model (comm_hook()'s before_forward), the next step(),
  // clip_grad_norm(), step_gradients() (a GradScaler), load_state_dict() and wait_parameters()
  // wait for them and write the parameters. Anything else that reads or writes the parameters in
  // between (an evaluation through the inner module, saving or loading the model) must call
  // wait_parameters() first, or go through the DDP model (its forward, summon_full_params(),
  // full_state_dict(), load_full_state_dict() wait): a write would be overwritten. Needs
  // reduce_scatter_gradients.
  bool overlap_all_gather = false;
};

// What ZeRO saves, on this rank.
struct ZeroStats {
  int64_t total_elements = 0;       // parameter elements over all groups
  int64_t shard_elements = 0;       // elements this rank steps (the same on every rank)
  int64_t replicated_elements = 0;  // of those, stepped on every rank (< world per segment)
  int64_t segments = 0;             // 1, or DDP's buckets with reduce_scatter_gradients
  int64_t state_bytes = 0;          // this rank's optimizer state (all fields, scalars included)
  // Seconds step() and the waits spent on the parameters' all-gathers (launching, blocked in
  // wait, writing the parameters), over all steps: with overlap_all_gather, what was left
  // exposed after the work between a step and the next forward.
  double gather_seconds = 0;
};

// Note [ZeRO-1] (src/distributed/sharding/zero.cpp): the parameters are cut into segments (all of
// them, flattened in group then parameter order; or, with reduce_scatter_gradients, each of
// DDP's buckets), and each segment into world_size equal contiguous shards and a tail of fewer
// than world_size elements; rank r owns shard r of every segment, and every rank steps the
// tails. step() steps the wrapped optimizer over this rank's pieces (the parts of parameters in
// its shards and the tails, with their averaged gradients) and all-gathers the shards back into
// every rank's parameters. With an element-wise optimizer (SGD, AdamW) the parameters are
// bitwise those of the wrapped optimizer stepping everything.
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
  // The wrapped optimizer over this rank's pieces; replaced when the pieces change (with
  // reduce_scatter_gradients, at the first step), so do not keep the pointer.
  optim::Optimizer* local_optimizer() { return local_.get(); }

  // ZeroOptions::reduce_scatter_gradients: DDP's comm hook that reduce-scatters each bucket into
  // this optimizer's shards (register it with the DDP model before its first backward). It
  // holds no reference that outlives this optimizer: used after it, it throws.
  CommHook comm_hook();
  // ZeroOptions::overlap_all_gather: waits for the all-gathers the last step() left running and
  // writes the parameters (nothing when none are running). Local.
  void wait_parameters();
  // Collective, with reduce_scatter_gradients, between backward and step(): clips the averaged
  // gradient (the shards this rank holds, the tails counted once) to total 2-norm max_norm as
  // optim::clip_grad_norm does the whole gradient, and returns the norm before clipping.
  double clip_grad_norm(double max_norm);

  // With reduce_scatter_gradients a GradScaler unscales and checks the averaged shards (and the
  // tails) this rank steps, and the ranks agree on an inf by a one-element all-reduce
  // (collective); otherwise the plain optimizer's behaviour.
  std::vector<Tensor> step_gradients() override;
  bool agree_found_inf(bool found) override;

 protected:
  std::vector<std::string> state_fields() const override { return {}; }

 private:
  // A run of parameters sharded together (Note [ZeRO-1]): rank r owns elements
  // [r per_rank, (r + 1) per_rank) of it; the tail [world per_rank, numel) is every rank's.
  struct Segment {
    std::vector<size_t> params;   // indices into params_, in the segment's order
    std::vector<int64_t> offset;  // each one's first element in the segment
    int64_t numel = 0;
    int64_t per_rank = 0;  // numel / world
    int64_t own_at = 0;    // where this rank's shard of it starts in shard_
    int64_t tail_at = 0;   // where its tail starts in shard_
    Tensor gathered;       // (world per_rank): the all-gathered shards
    WorkPtr gather;        // the all-gather step() left running
  };
  struct Piece {
    size_t param = 0;          // index over all groups' parameters, in order
    size_t segment = 0;        // the segment it lies in
    int64_t param_offset = 0;  // first element of the parameter in this piece
    int64_t shard_offset = 0;  // where it starts in shard_
    int64_t numel = 0;
    bool tail = false;  // in the segment's tail (stepped on every rank)
    Tensor tensor;      // shard_'s slice: what the wrapped optimizer steps
  };
  // One DDP bucket as comm_hook() saw it in this backward, with its reduce-scatter.
  struct Reduced {
    std::vector<size_t> params;
    int64_t numel = 0;
    Tensor own;  // (numel / world): this rank's shard of the average, a view of the bucket
    WorkPtr scatter;
    bool whole = false;  // all-reduced whole (before DDP's layout was final)
  };
  struct HookLink;
  // What the ranks' wrapped optimizers hold (index_state, collective): per-element fields and
  // their dtypes, which parameters have which field, scalars per (parameter, field), this rank's
  // per-element tensors by their wrapped-optimizer name, and its entries that are no piece's.
  struct StateIndex {
    std::map<std::string, DType> fields;
    std::set<std::pair<size_t, std::string>> has;
    std::map<std::pair<size_t, std::string>, Tensor> scalars;
    std::map<std::string, Tensor> local;
    optim::NamedTensors globals;
  };
  StateIndex index_state() const;
  Tensor field_shard(const StateIndex& index, const std::string& field, DType dtype) const;
  // Lays `next` out and moves the optimizer state into it (Note [ZeRO-1], Buckets).
  void reshard(std::vector<Segment> next);

  // Lays the segments out in shard_ and builds this rank's pieces and the wrapped optimizer.
  void lay_out(std::vector<Segment> segments);
  // Rank `rank`'s pieces of the current segments (without tensors).
  std::vector<Piece> pieces_of(int rank) const;
  // comm_hook()'s start and finish.
  WorkPtr reduce_bucket(ProcessGroup& pg, GradBucket& b);
  void finish_bucket(GradBucket& b);
  // The segments DDP's buckets make, from this backward's hooks; lay_out() again when they differ
  // from the current ones (the full state gathered and re-sharded, as for a checkpoint).
  void follow_buckets();
  // A piece's averaged gradient (undefined when its parameter has none).
  Tensor piece_grad(const Piece& piece) const;

  ProcessGroupPtr pg_;
  ZeroOptions opts_;
  OptimizerFactory make_;
  std::vector<optim::ParamGroup> user_groups_;  // as given (params, lr, weight decay)

  std::vector<Tensor> params_;  // all groups', in order (as in groups_)
  std::vector<size_t> group_of_;
  std::unordered_map<const TensorImpl*, size_t> index_of_;  // a parameter -> its index
  int64_t total_ = 0;
  std::vector<Segment> segments_;
  int64_t shard_size_ = 0;
  Tensor shard_;  // (shard_size_): this rank's shards and the tails, segment by segment
  std::vector<Piece> pieces_;  // in the wrapped optimizer's order (group, then parameter)
  std::unique_ptr<optim::Optimizer> local_;
  std::vector<Reduced> reduced_;         // by bucket index
  int64_t launched_ = 0, finished_ = 0;  // bucket reductions since the last step
  // CommHook::on_buckets: DDP's buckets as it last laid them out (params and numel of each), and
  // whether that layout is final (rebuilt after the first backward). Until it is, the hook
  // all-reduces whole buckets and step() reads .grad() (full_grads_): Note [ZeRO-1], Buckets.
  std::vector<Reduced> announced_;
  bool announced_final_ = false;
  bool full_grads_ = false;
  void take_buckets(const std::vector<GradBucket>& buckets, bool final);
  std::vector<size_t> params_of(const GradBucket& b) const;
  bool gathering_ = false;     // all-gathers left running (overlap_all_gather)
  double gather_seconds_ = 0;  // ZeroStats::gather_seconds
  std::shared_ptr<HookLink> link_;
};

}  // namespace lockstep::dist
