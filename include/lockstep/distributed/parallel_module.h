// ParallelModule: what a training loop asks of a data-parallel model, whichever wrapper it is:
// DistributedDataParallel (every rank the whole model; with or without a sharding comm hook such
// as ZeRO-1's) or FullyShardedDataParallel (every rank its shards). A loop written against it
// (forward, no_sync, clip_grad_norm, summon_full_params, full_state_dict) does not ask which.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "lockstep/distributed/process_group.h"
#include "lockstep/nn/module.h"

namespace lockstep::dist {

class ParallelModule : public nn::Module {
 public:
  // The wrapped model, and the group its gradients are reduced over.
  virtual const std::shared_ptr<nn::Module>& module() const = 0;
  virtual const ProcessGroupPtr& process_group() const = 0;

  // Gradient accumulation: backward passes inside the scope accumulate this rank's gradients
  // locally without communicating; the first backward after it reduces what was accumulated
  // (K-1 micro-batches inside, the last outside: bitwise one large batch). Inside a dist::Join
  // the scope holds the forward too: the forward announces it.
  class NoSync {
   public:
    explicit NoSync(ParallelModule& model);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    ParallelModule& model_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // Between backward and step, on every rank: clips the averaged gradient that the optimizer
  // steps, wherever it lives (the parameters' .grad() under DDP; this rank's shards under FSDP
  // or a sharding comm hook), to total 2-norm max_norm, and returns the norm before clipping:
  // the value optim::clip_grad_norm gives over the whole gradient. Collective where the gradient
  // is sharded.
  virtual double clip_grad_norm(double max_norm) = 0;

  // Collective: inside the scope the wrapped module's parameters are the whole model and may be
  // read through module() (sampling on one rank, inspection): FSDP gathers every unit (writes
  // are lost when the scope ends, as PyTorch's summon_full_params), DDP waits for what a
  // sharding hook left in flight.
  class FullParams {
   public:
    explicit FullParams(ParallelModule& model);
    ~FullParams();
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;

   private:
    ParallelModule& model_;
  };
  [[nodiscard]] FullParams summon_full_params() { return FullParams(*this); }

  // Collective: the wrapped module's state_dict() (names, shapes, values), whole, on every rank.
  // What a checkpoint saves.
  virtual nn::NamedTensors full_state_dict() = 0;
  // Every rank with the same `state`: the wrapped module's state_dict() from any run (one
  // process, DDP, FSDP, any world size) into this rank's copy or shards.
  virtual void load_full_state_dict(const nn::NamedTensors& state) = 0;

 protected:
  explicit ParallelModule(std::string type_name) : nn::Module(std::move(type_name)) {}

  // NoSync's: whether backward passes reduce from now on (false inside the scope); returns what
  // it was.
  virtual bool set_no_sync(bool no_sync) = 0;
  // FullParams': make the parameters whole, and (never throwing) undo it.
  virtual void gather_full_params() = 0;
  virtual void release_full_params() noexcept = 0;
};

}  // namespace lockstep::dist
