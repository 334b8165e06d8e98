// FullyShardedDataParallel (ZeRO-2 and ZeRO-3): each rank keeps 1/world_size of every unit's
// flattened parameters, gathers a unit whole only around its forward and backward, and
// reduce-scatters its gradients into the rank's shard as the backward goes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/distributed/comm_hook.h"
#include "lockstep/distributed/parallel_module.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/io/sharded_checkpoint.h"
#include "lockstep/nn/module.h"
#include "lockstep/optim/optimizer.h"

namespace lockstep::dist {

class Join;

// Which submodules become units (Note [FSDP units] in src/distributed/sharding/fsdp.cpp): asked
// of every submodule, outermost first, with its dotted path; a module it accepts is one unit with
// all of its parameters (its submodules are not asked). The parameters of no accepted module form
// the root unit, gathered for the whole forward and backward.
using WrapPolicy = std::function<bool(const std::string& path, const nn::Module& m)>;
// Modules of these types (nn::Module::type_name(), e.g. "GptBlock"), as PyTorch's
// transformer_auto_wrap_policy.
WrapPolicy wrap_by_type(std::vector<std::string> type_names);
// Modules holding at least `min_params` parameter elements whose children hold fewer each, as
// PyTorch's size_based_auto_wrap_policy (the default, with kDefaultMinUnitParams).
WrapPolicy wrap_by_size(int64_t min_params);
inline constexpr int64_t kDefaultMinUnitParams = int64_t{1} << 16;

struct FSDPOptions {
  // true: ZeRO-3, a unit's full parameters are freed after its forward and gathered again for
  // its backward; false: ZeRO-2, kept from the forward to the end of the unit's backward.
  bool reshard_after_forward = true;
  WrapPolicy wrap = nullptr;  // null: wrap_by_size(kDefaultMinUnitParams)
  // Gather the next unit while this one computes (forward: the next in order; backward: the
  // previous one). Off, each gather is waited for at once (for measuring what prefetch hides).
  bool prefetch = true;
  // Note [FSDP mixed precision] (src/distributed/sharding/fsdp.cpp): the dtype units are gathered
  // and compute in (bf16: half the gathers' bytes and memory), while the master shards, the
  // optimizer and its state keep the parameters' dtype; unset: the parameters' own. And the
  // dtype each unit's gradient is summed and reduce-scattered in (f32 for accuracy, bf16 for half
  // the bytes); unset: param_dtype's. The forward's floating inputs are cast to param_dtype.
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  // How each unit's gradient is reduced (comm_hook.h): a sharding hook, which leaves this rank's
  // average in GradBucket::shard; the unit is the bucket (its flat gradient, padded to a multiple
  // of the world size, in reduce_dtype).
  CommHook comm_hook = reduce_scatter_hook();
};

// What a user tunes FSDP with, and what each rank's memory holds (bytes).
struct FSDPStats {
  int64_t units = 0;
  int64_t total_elements = 0;   // parameter elements of the model
  int64_t padded_elements = 0;  // summed over units, each padded to a multiple of world_size
  int64_t shard_elements = 0;   // this rank's (padded / world_size)
  int64_t shard_bytes = 0;      // this rank's master shards
  int64_t grad_shard_bytes = 0;
  // The largest the gathered parameters and full gradients of units were at one moment, since
  // construction (what prefetch and reshard_after_forward trade).
  int64_t peak_gathered_bytes = 0;
  int64_t peak_full_grad_bytes = 0;
  int64_t all_gathers = 0;      // unit gathers issued
  int64_t reduce_scatters = 0;  // unit gradient reductions issued
  // Seconds the forward and backward spent blocked on gathers not finished yet (what prefetch
  // left exposed), over all steps.
  double exposed_gather_seconds = 0;
};

// Construction (collective, on every rank of `pg`): checks that every rank built the same model,
// broadcasts rank 0's parameters and buffers, lays every unit's parameters out flat (padded to a
// multiple of the world size, so any parameter count shards: Note [FSDP]) and keeps this rank's
// shard; the wrapped module's parameters then hold no memory outside the forward and backward
// (reading one throws, naming FSDP: go through full_state_dict() or summon_full_params()).
//
// The optimizer steps the shards: build it over shard_groups(groups over the wrapped module's
// parameters), or over parameters() (one flat shard per unit, one group), and give it to
// wrap_optimizer() so that a GradScaler's inf check and state_dict() are collective. backward()
// returns with each rank's shards holding the average over ranks of their gradients (each
// synchronized backward replaces them: zero_grad() between steps as usual). Gradient
// accumulation: no_sync(). The training loop's interface is ParallelModule's, as DDP's.
class FullyShardedDataParallel : public ParallelModule {
 public:
  FullyShardedDataParallel(std::shared_ptr<nn::Module> module, ProcessGroupPtr pg,
                           FSDPOptions opts = {});
  ~FullyShardedDataParallel() override;

  Tensor forward(const Tensor& x) override;
  const std::shared_ptr<nn::Module>& module() const override { return module_; }
  const ProcessGroupPtr& process_group() const override { return pg_; }

  // The same groups (lr, weight decay) over this rank's pieces of their parameters: one piece
  // per parameter, a 1-D view of the shard it lies in (0 elements where it lies in no part of
  // this rank's shard), in the groups' order. Every rank gets the same number of pieces.
  std::vector<optim::ParamGroup> shard_groups(const std::vector<optim::ParamGroup>& groups) const;

  // no_sync() (ParallelModule's), Note [FSDP gradient accumulation]: backward passes inside the
  // scope keep the full, unsharded gradients of this rank (summed over micro-batches) without
  // communicating; the first backward after it adds its own and reduce-scatters them. Bitwise
  // DDP's no_sync.

  // Collective, between backward and step: clips the averaged gradient (all shards, each element
  // counted once) to total 2-norm max_norm, and returns the norm before clipping: the value
  // optim::clip_grad_norm gives over the whole gradient, bitwise (both sum exactly: Note [Exact
  // norm] in src/optim/optimizer.cpp).
  double clip_grad_norm(double max_norm) override;

  // Collective: the wrapped module's state_dict() (names, shapes, values), every parameter
  // gathered, on every rank. What a checkpoint saves.
  nn::NamedTensors full_state_dict() override;
  // Local (every rank, with the same `state`): the wrapped module's state_dict() from any run
  // (DDP, FSDP at any world size): this rank's slices into its shards, buffers whole.
  void load_full_state_dict(const nn::NamedTensors& state) override;

  // summon_full_params() (ParallelModule's): every unit's parameters gathered whole inside the
  // scope (read-only: writes are lost), as PyTorch's; for evaluation or inspection through
  // module().

  // An optimizer built by `make` over shard_groups(groups), wrapped so that a GradScaler's inf
  // decision is every rank's (one all-reduce) and state_dict()/load_state_dict() speak the plain
  // optimizer's full format over the wrapped module's parameters (collective state_dict()), as
  // ZeroRedundancyOptimizer does: a checkpoint of an FSDP run is an ordinary checkpoint.
  std::unique_ptr<optim::Optimizer> wrap_optimizer(
      const std::vector<optim::ParamGroup>& groups,
      const std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>& make);

  // Sharded checkpoints (io/sharded_checkpoint.h), local (no collective). This rank's slices of
  // the state: each parameter's piece as "model.<name>" (elements [begin, end) of it), the
  // buffers whole from rank 0; with `opt` (wrap_optimizer's) its per-element state as
  // "optim.<name>.<field>" pieces, its per-parameter scalars and "optim.step", "optim.group.<g>.lr"
  // from rank 0. Every element of every tensor is in exactly one rank's slices.
  std::vector<io::TensorSlice> state_slices(const optim::Optimizer* opt) const;
  // What this rank reads back at its own layout, for tensors named in `available` (the
  // checkpoint's): its pieces of the parameters and of the optimizer's per-element fields, the
  // buffers and scalars whole. A checkpoint from any world size and layout (DDP, ZeRO, FSDP).
  std::vector<io::SliceRequest> state_requests(const std::vector<std::string>& available,
                                               const optim::Optimizer* opt) const;
  // Takes what state_requests() asked for: the pieces into the shards, the buffers, and (with
  // `opt`) the optimizer's pieces and scalars. A missing parameter is an error naming it.
  void load_state_slices(const std::vector<io::TensorSlice>& slices, optim::Optimizer* opt);

  // The optimizer wrap_optimizer() built over the shards, when `opt` is such a wrapper (its
  // state, per rank, is what each rank holds); null otherwise.
  static const optim::Optimizer* local_optimizer(const optim::Optimizer& opt);

  FSDPStats stats() const;
  // Unit names ("" for the root), in forward order.
  std::vector<std::string> unit_names() const;

 protected:
  bool set_no_sync(bool no_sync) override;
  void gather_full_params() override;
  void release_full_params() noexcept override;

 private:
  struct Unit;
  class Optim;
  friend class Optim;
  friend class Join;  // Note [Join and FSDP]: the header in forward, the shadow steps

  void build_units(const FSDPOptions& opts);
  Tensor run_forward(const Tensor& x);
  // Note [Join and FSDP]: a forward and backward of `input` (else the last training input) whose
  // gradient counts for nothing, as the ranks with data take a step (synced: they reduce it).
  void shadow(const Tensor& input, bool synced, int active);
  void start_gather(Unit& u);
  void wait_gather(Unit& u);
  void reshard(Unit& u);
  void before_unit_forward(Unit& u);
  Tensor after_unit_forward(Unit& u, const Tensor& out);
  void before_unit_backward(Unit& u);
  void on_param_grad(size_t param, Tensor& leaf);
  void reduce_unit(Unit& u);
  void complete_scatter(Unit& u);
  void finish_backward();
  void note_memory();
  // This rank's piece of parameter `param`: [begin, end) of its flat elements, and where it
  // starts in its unit's shard.
  struct Piece {
    size_t unit = 0;
    int64_t begin = 0, end = 0;  // within the parameter's elements
    int64_t shard_at = 0;
  };
  Piece piece_of(size_t param, int rank) const;

  std::shared_ptr<nn::Module> module_;
  ProcessGroupPtr pg_;
  FSDPOptions opts_;
  std::vector<std::pair<std::string, Tensor>> params_;  // the wrapped module's, in order
  std::vector<size_t> unit_of_;                         // by parameter
  std::vector<int64_t> offset_of_;                      // in its unit's flat layout
  std::vector<std::unique_ptr<Unit>> units_;            // units_[0]: the root
  std::vector<Tensor> pieces_;                          // by parameter
  std::vector<int> grad_hooks_;
  bool no_sync_ = false;
  bool backward_queued_ = false;  // finish_backward() is queued for this backward
  bool summoned_ = false;
  Join* join_ = nullptr;  // the Join this model is inside, if any
  Tensor join_input_;     // inside a Join: the last training input
  int contributors_ = 0;  // inside a Join: the ranks whose gradients this backward reduces
  bool shadowing_ = false;
  FSDPStats stats_;
};

}  // namespace lockstep::dist
