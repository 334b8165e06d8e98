// Communication hooks (comm_hook.h): the named interface through which DDP's reducer has a bucket
// reduced and FSDP a unit, and the built-in hooks (all-reduce, bf16 and fp16 compression, the
// reduce-scatter into this rank's shard).
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
// Under FSDP a hook must shard: after finish(), bucket.shard holds this rank's average of the
// unit's gradient (numel / world elements, in the buffer's dtype); FSDP rescales it inside a
// Join and never reads the buffer again (Note [FSDP units] in src/distributed/sharding/fsdp.cpp).
#include "lockstep/distributed/comm_hook.h"

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"

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

ShardReduction reduce_scatter_bucket(ProcessGroup& pg, GradBucket& b) {
  autograd::NoGradGuard no_grad;
  const int64_t world = pg.size();
  const int64_t q = b.numel / world;
  const TensorOptions like = TensorOptions(b.buffer.dtype()).with_device(b.buffer.device());
  if (!b.shard.defined() || b.shard.numel() != q || b.shard.dtype() != b.buffer.dtype() ||
      b.shard.device() != b.buffer.device())
    b.shard = empty({q}, like);
  ShardReduction out;
  if (q > 0)
    out.scatter =
        pg.reduce_scatter(b.shard, b.buffer.narrow(0, 0, world * q), {.op = ReduceOp::avg});
  const int64_t rest = b.buffer.numel() - world * q;
  if (rest > 0)
    out.rest = pg.all_reduce(b.buffer.narrow(0, world * q, rest), {.op = ReduceOp::avg});
  return out;
}

CommHook reduce_scatter_hook() {
  // A bucket whose buffer has elements after its shards: the reduce-scatter's Work, waited for
  // in finish() (start() returns the all-reduce's).
  auto scatters = std::make_shared<std::map<int, WorkPtr>>();
  return {"reduce_scatter",
          [scatters](ProcessGroup& pg, GradBucket& b) {
            LS_CHECK(b.buffer.numel() > 0, "reduce_scatter_hook: bucket ", b.index,
                     " has no elements to reduce");
            ShardReduction r = reduce_scatter_bucket(pg, b);
            if (!r.rest) return r.scatter;
            if (r.scatter) (*scatters)[b.index] = std::move(r.scatter);
            return r.rest;
          },
          [scatters](GradBucket& b) {
            const auto it = scatters->find(b.index);
            if (it == scatters->end()) return;
            const WorkPtr scatter = std::move(it->second);
            scatters->erase(it);
            scatter->wait();
          },
          nullptr, nullptr};
}

}  // namespace lockstep::dist
