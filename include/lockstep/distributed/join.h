// Join: training with uneven inputs under DistributedDataParallel or FullyShardedDataParallel
// (PyTorch's Join context manager, Horovod's hvd.join()). A rank that runs out of batches shadows
// the collectives the others still issue, until every rank has run out; then all leave together
// with the same state.
//
//   dist::Join join(ddp, {.optimizer = &opt, .scaler = &scaler});
//   for (data::Batch& b : loader) {                 // ranks may have different numbers of batches
//     opt.zero_grad();
//     scaler.scale(loss_fn(ddp.forward(b.input), b.target)).backward();
//     scaler.step(opt);
//     scaler.update();
//   }
//   join.finish();  // shadows the others' steps; returns when every rank has called it
//
// or, with the loop's condition on the Join: `while (join.next(loader_has_batch)) {...}`.
#pragma once

#include <cstdint>
#include <functional>

#include "lockstep/distributed/ddp.h"

namespace lockstep::optim {
class Optimizer;
}
namespace lockstep::amp {
class GradScaler;
}

namespace lockstep::dist {

class FullyShardedDataParallel;
class ZeroRedundancyOptimizer;

struct JoinOptions {
  // State that moves only on ranks that still step. When every rank has joined, the optimizer's
  // state (moments, step count, learning rates) and the scaler's (scale, growth tracker) are
  // copied, with the model's parameters and buffers, from a rank that took the last step.
  optim::Optimizer* optimizer = nullptr;
  amp::GradScaler* scaler = nullptr;
  // With a ZeroRedundancyOptimizer as `optimizer` (Note [Join and ZeRO]): what the ranks with
  // data do after each synchronizing backward, up to the next forward (unscale_ and
  // clip_grad_norm, the step, the scaler's update, the schedule's step). A joined rank runs it
  // over the averaged gradients so that its shard of the parameters moves with the others'.
  // Empty: scaler->step(*optimizer) and scaler->update() with an enabled scaler, else
  // optimizer->step().
  std::function<void()> step;
  // With FullyShardedDataParallel (Note [Join and FSDP]): the input a rank out of data runs
  // through the model to take part in the others' gathers and reductions. Undefined: its last
  // training input (a rank that never had a batch must give one).
  Tensor shadow_input;
};

// Note [Join]
// Every training forward of the DDP model (grad mode on, module in training mode) inside a Join
// starts with one all-reduce of a small header: one element per rank (1 where that rank still
// has data) and one counting the ranks whose backward will synchronize (no_sync() read at
// forward, so the no_sync scope must hold the forward too, as in PyTorch). A joined rank posts
// zeros in a loop and learns from the sum what the others do next: broadcast the buffers (from
// the lowest rank still active, not rank 0, whose buffers stopped moving when it joined), and,
// when they synchronize, all-reduce every bucket, to which it contributes zeros. The gradient is
// then divided by the number of ranks that contributed (the active ones), not the world size, so
// it is the mean over the batches actually seen that step. Gradients a joined rank accumulated
// under no_sync() and never synchronized are dropped, as in PyTorch: each contribution is one
// rank's full step. A joined rank does not step its optimizer; when the header shows no rank
// active, every rank takes parameters, buffers and the optional optimizer and scaler state from
// the lowest rank active in the last step. Outside a Join, DDP issues no header and divides by
// the world size as before.
//
// Note [Join and ZeRO]
// A ZeroRedundancyOptimizer's step is a collective (each rank steps its own shard, then all
// shards are all-gathered), so a joined rank cannot sit it out: its shard would stop moving and
// the others would wait in the all-gather. Given as JoinOptions::optimizer, a joined rank takes
// the step with the others after each synchronized backward it shadows, over the gradients that
// backward left in its .grad() (the average over the ranks with data, as on those ranks; in
// ZeroOptions::reduce_scatter_gradients mode zeros in .grad(), and the comm hook scales each
// rank's reduce-scattered shard to the contributors' mean), running JoinOptions::step, which
// must do what the ranks with data do (the same clipping, scaler and schedule), or the default
// step. Every rank's optimizer and scaler state then moves as if it had data, and at the end only
// the parameters and buffers are copied (the optimizer state is each rank's shard).
//
// Note [Join and FSDP]
// Under FullyShardedDataParallel every rank holds the only copy of its shards and steps them
// itself, and a step's collectives are the units' gathers in forward and backward (prefetches
// included) and their reduce-scatters, in the order autograd runs them: a joined rank can only
// match them by running the model. So for each step of the others it runs a forward of
// JoinOptions::shadow_input (or its last training input) and a backward from the output's sum,
// inside no_sync() when they accumulate, with its gradient contribution zero (FSDP adds nothing
// of it to the units' gradients); each reduce-scatter's average is rescaled to the ranks that
// contributed, as DDP's buckets are. After each synchronizing backward it takes the step with
// the others, as under ZeRO (JoinOptions::optimizer, the wrap_optimizer() one, is required; a
// step that clips or scales goes in JoinOptions::step, since FSDP's clip_grad_norm and the
// scaler's inf check are collectives). At the end only the buffers and the groups' learning
// rates and weight decays are copied from the last active rank. The shadow assumes that the
// others' loss reaches every unit the model's output does (any common loss does).
class Join {
 public:
  // On every rank of the model's process group, at the same point (before the loop). `model`
  // is a DistributedDataParallel or (Note [Join and FSDP]: opts.optimizer is then required) a
  // FullyShardedDataParallel.
  explicit Join(ParallelModule& model, JoinOptions opts = {});
  // Detaches from the model without communicating (an exception left the loop: the other ranks'
  // collectives fail on their timeout, as any rank failure does).
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // This rank has no more batches: shadows the other ranks' steps until every rank has called
  // finish(), then makes every rank's state equal (Note [Join]). Once per Join.
  void finish();
  // true when have_batch; otherwise finish() and false. For `while (join.next(have)) {...}`.
  bool next(bool have_batch);

  // Steps of the others this rank shadowed in finish(), and the steps it took itself.
  int64_t steps_shadowed() const { return shadowed_; }
  int64_t steps_taken() const { return taken_; }

 private:
  friend class DistributedDataParallel;
  friend class FullyShardedDataParallel;
  struct Header {
    int active = 0;        // ranks that still have data
    int synced = 0;        // of those, the ones whose backward synchronizes
    int first_active = 0;  // the lowest such rank (-1 when none)
  };
  // The header all-reduce (Note [Join]); DDP's forward calls it with active = true.
  Header exchange(bool active, bool synced);
  void sync_state(int source);
  void attach(DistributedDataParallel& ddp);
  void attach(FullyShardedDataParallel& fsdp);
  // Note [Join and ZeRO], Note [Join and FSDP]: the step a joined rank takes with the others.
  void shadow_step();
  ProcessGroup& pg() const;
  nn::Module& module() const;  // the wrapped model

  DistributedDataParallel* ddp_ = nullptr;  // the model is one of these two
  FullyShardedDataParallel* fsdp_ = nullptr;
  JoinOptions opts_;
  ZeroRedundancyOptimizer* zero_ = nullptr;  // opts_.optimizer, when it is one
  optim::Optimizer* sharded_ = nullptr;      // zero_, or under FSDP opts_.optimizer
  bool finished_ = false;
  int last_first_active_ = 0;  // the lowest active rank of the last step anyone took
  int64_t shadowed_ = 0;
  int64_t taken_ = 0;
};

}  // namespace lockstep::dist
