// Communication hooks: the named interface for how one bucket of gradients is reduced across ranks
// (GradBucket, CommHook) and the built-in hooks: all-reduce, bf16/fp16 compression, and the
// reduce-scatter into this rank's shard. DistributedDataParallel (ddp.h) reduces its buckets and
// FullyShardedDataParallel (fsdp.h) its units through whichever hook it holds and knows nothing
// else of it; ZeroRedundancyOptimizer::comm_hook() (zero.h) is a sharding hook from outside. What
// a hook may and must do: comm_hook.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::dist {

// One bucket's gradients, handed to a communication hook: `buffer` is the flat tensor whose
// slices are the parameters' .grad(), followed by elements of the reducer's that a hook reduces
// like the rest: one status element, and in bucket 0 one slot per rank for the step's compute
// time (Note [Slow rank]); `numel` is where the gradients end in it; `parameters` are the
// parameters whose gradients it holds, in buffer order, with their names; `contributors` is how
// many ranks' gradients this reduction carries (the world size, or fewer inside a dist::Join,
// whose reducer rescales the average after finish(): Note [Join]); `scratch` is the hook's to
// keep between start and finish. For a sharding hook (reduce_scatter_hook(), ZeRO-1's), `shard`
// is this rank's q = numel / world of the first world * q gradient elements, where finish()
// leaves their average (the hook makes it when it is undefined or of another size or dtype; it
// may be the buffer's own chunk rank, buffer.narrow(0, rank * q, q): then in place, as ZeRO-1's).
// An FSDP unit is a bucket too: its flat, padded gradient, numel a multiple of the world size.
// `wire_bytes` is what a hook that sends less than the buffer sets in start(): the bytes its
// collectives carry for this bucket on this step (0: not set, the buffer's).
struct GradBucket {
  int index = 0;
  Tensor buffer;
  int64_t numel = 0;
  std::vector<std::string> parameter_names;
  std::vector<Tensor> parameters;
  int contributors = 0;
  Tensor scratch;
  Tensor shard;
  int64_t wire_bytes = 0;
};

// How a bucket is reduced. start() launches the reduction and returns its Work (it runs while
// the backward pass goes on); after that Work completed, finish() (may be empty) leaves in
// bucket.buffer the average over ranks (or, for a hook that hands the average elsewhere, as
// ZeroRedundancyOptimizer::comm_hook() does, its own elements: those after `numel`).
// before_forward (may be empty) runs at the start of every forward of the DDP model, before
// anything reads the parameters (ZeRO waits there for the all-gathers it left running).
// on_buckets (may be empty) is told the buckets (index, numel, parameters; no buffers) whenever
// DDP lays them out: when the hook is set, and after the first synchronized backward, which
// rebuilds them in the order gradients became ready (`final` is true from then on).
// clip_grad_norm (may be empty) is for a hook that hands the average elsewhere: the gradient's
// home clips it there (collective) and returns the norm before clipping, when the DDP model's
// clip_grad_norm is called; empty, DDP clips the parameters' .grad().
struct CommHook {
  std::string name;
  std::function<WorkPtr(ProcessGroup&, GradBucket&)> start;
  std::function<void(GradBucket&)> finish;
  std::function<void()> before_forward;
  std::function<void(const std::vector<GradBucket>&, bool final)> on_buckets;
  std::function<double(double max_norm)> clip_grad_norm;
};
// all_reduce with avg (the default).
CommHook allreduce_hook();
// Sends bf16 / f16 copies (half the bytes), and writes the averaged result back in full width.
CommHook bf16_compress_hook();
CommHook fp16_compress_hook();
// Reduce-scatter into this rank's shard (FSDP's default; llm.c's ZeRO): the bucket's first
// world * q gradient elements (q = numel / world), averaged, land in bucket.shard, the rest of
// the buffer (fewer than world gradients and a reducer's own elements) is all-reduced in place,
// and the first world * q elements of the buffer are left as they were (but for the shard, when
// it is the buffer's own chunk). Half the bytes of an all-reduce on the wire, for an optimizer
// that steps shards.
CommHook reduce_scatter_hook();

// The reduce-scatter of a sharding hook (reduce_scatter_hook(), ZeroRedundancyOptimizer's):
// bucket.buffer's first world * q elements, averaged, into bucket.shard (made when needed), and
// the all-reduce of the elements after them. Either Work is null when it has no elements.
struct ShardReduction {
  WorkPtr scatter;
  WorkPtr rest;
};
ShardReduction reduce_scatter_bucket(ProcessGroup& pg, GradBucket& bucket);

}  // namespace lockstep::dist
