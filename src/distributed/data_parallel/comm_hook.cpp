// DDP's communication hooks (comm_hook.h): the named interface through which the reducer has a
// bucket reduced, and the built-in hooks (all-reduce, bf16 and fp16 compression).
//
// What a hook must do: start() launches the bucket's reduction and returns its Work (never null;
// the reducer waits on it before finish()), and is called for the buckets in index order on
// every rank, so its collectives match across ranks as long as every rank holds the same hook
// (register_comm_hook: before the first synchronized backward only). After finish(),
// bucket.buffer holds the average over the world size of every element the reducer reads: the
// gradients (unless the hook hands their average elsewhere, as ZeRO's reduce-scatter into its
// shards does) and always the reducer's own elements after `numel` (the unused-parameter status;
// in bucket 0 the ranks' compute times, Note [Slow rank]), which the reducer reads back after
// finish(). A hook divides by the world size even inside a dist::Join: the reducer rescales by
// `contributors` afterwards (Note [Join]).
// What a hook may do: send something else on the wire (a narrower dtype, a shard), keep state
// between start() and finish() in bucket.scratch or in its own closure, and follow DDP's layout
// (on_buckets) or run before each forward (before_forward).
#include "lockstep/distributed/comm_hook.h"

#include <string>
#include <utility>

#include "lockstep/autograd/grad_mode.h"

namespace lockstep::dist {

CommHook allreduce_hook() {
  return {"allreduce",
          [](ProcessGroup& pg, GradBucket& b) {
            return pg.all_reduce(b.buffer, {.op = ReduceOp::avg});
          },
          nullptr, nullptr, nullptr};
}

namespace {

CommHook compress_hook(std::string name, DType wire) {
  return {std::move(name),
          [wire](ProcessGroup& pg, GradBucket& b) {
            b.scratch = b.buffer.to(wire);
            if (b.scratch.is_same(b.buffer)) b.scratch = b.buffer.clone();
            return pg.all_reduce(b.scratch, {.op = ReduceOp::avg});
          },
          [](GradBucket& b) {
            autograd::NoGradGuard no_grad;
            b.buffer.copy_(b.scratch);
            b.scratch = Tensor();
          },
          nullptr, nullptr};
}

}  // namespace

CommHook bf16_compress_hook() { return compress_hook("bf16_compress", kBFloat16); }
CommHook fp16_compress_hook() { return compress_hook("fp16_compress", kFloat16); }

}  // namespace lockstep::dist
