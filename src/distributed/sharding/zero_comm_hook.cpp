// ZeroRedundancyOptimizer's communication hook (Note [ZeRO-1] in zero.cpp, Reduce-scatter and
// Buckets): DDP's bucket layouts as announced, each bucket reduce-scattered into this rank's shard
// of it with the rest all-reduced, and the CommHook that DDP calls.
#include <vector>

#include "distributed/sharding/zero_internal.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/zero.h"

namespace lockstep::dist {

// The indices of a bucket's parameters.
std::vector<size_t> ZeroRedundancyOptimizer::params_of(const GradBucket& b) const {
  std::vector<size_t> out;
  for (size_t k = 0; k < b.parameters.size(); ++k) {
    const auto it = index_of_.find(b.parameters[k].impl());
    LS_CHECK(it != index_of_.end(), "ZeroRedundancyOptimizer::comm_hook(): DDP's bucket ", b.index,
             " holds parameter '", k < b.parameter_names.size() ? b.parameter_names[k] : "?",
             "', which this optimizer does not step; give it all of the DDP model's parameters "
             "that require grad");
    out.push_back(it->second);
  }
  return out;
}

void ZeroRedundancyOptimizer::take_buckets(const std::vector<GradBucket>& buckets, bool final) {
  std::vector<Reduced> layout(buckets.size());
  for (size_t k = 0; k < buckets.size(); ++k) {
    layout[k].params = params_of(buckets[k]);
    layout[k].numel = buckets[k].numel;
  }
  announced_ = std::move(layout);
  announced_final_ = final;
  // The next backward reduces these buckets only (a rebuild may make fewer).
  reduced_.resize(announced_.size());
}

// Note [ZeRO-1], Reduce-scatter: the bucket's first world * q gradient elements (q = numel /
// world) are reduce-scattered in place, into this rank's chunk of the bucket's own buffer; the
// rest of the buffer, the tail of fewer than world gradients and the reducer's own elements, is
// all-reduced in place.
WorkPtr ZeroRedundancyOptimizer::reduce_bucket(ProcessGroup& pg, GradBucket& b) {
  autograd::NoGradGuard no_grad;
  const int64_t world = pg_->size();
  LS_CHECK(pg.size() == world && pg.rank() == pg_->rank(),
           "ZeroRedundancyOptimizer::comm_hook(): the DDP model's process group (rank ", pg.rank(),
           " of ", pg.size(), ") is not this optimizer's (rank ", pg_->rank(), " of ", world, ")");
  LS_CHECK(b.buffer.dtype() == params_[0].dtype(), "ZeroRedundancyOptimizer::comm_hook(): bucket ",
           b.index, " holds ", dtype_name(b.buffer.dtype()), " gradients, the parameters are ",
           dtype_name(params_[0].dtype()));
  const size_t index = static_cast<size_t>(b.index);
  if (reduced_.size() <= index) reduced_.resize(index + 1);
  Reduced& r = reduced_[index];
  r.params = params_of(b);
  r.numel = b.numel;
  ++launched_;
  r.scatter.reset();
  // Note [ZeRO-1], Buckets: before DDP's layout is final, whole buckets, as DDP would.
  full_grads_ = !announced_final_;
  r.whole = full_grads_;
  if (r.whole) return pg.all_reduce(b.buffer, {.op = ReduceOp::avg});
  // The reduce-scatter of every sharding hook (comm_hook.h), in place as llm.c's: the shard is
  // this rank's chunk of the buffer, so the average lands in the parameters' .grad() and the
  // gradient has one home (r.own is a view of it, not a copy).
  const int64_t q = b.numel / world;
  b.shard = b.buffer.narrow(0, pg_->rank() * q, q);
  ShardReduction sr = reduce_scatter_bucket(pg, b);
  r.own = b.shard;
  r.scatter = std::move(sr.scatter);
  LS_CHECK(sr.rest != nullptr, "ZeroRedundancyOptimizer::comm_hook(): bucket ", b.index,
           " has no reducer elements after its gradients");
  return sr.rest;
}

void ZeroRedundancyOptimizer::finish_bucket(GradBucket& b) {
  Reduced& r = reduced_.at(static_cast<size_t>(b.index));
  ++finished_;
  if (r.scatter) r.scatter->wait();
  // Note [Join]: the reducer rescales the buffer's gradients after finish(), the shard among
  // them (it lies in the buffer).
}

CommHook ZeroRedundancyOptimizer::comm_hook() {
  LS_CHECK(opts_.reduce_scatter_gradients,
           "ZeroRedundancyOptimizer::comm_hook() is for ZeroOptions::reduce_scatter_gradients; "
           "without it DDP's own all-reduce averages the gradients");
  auto link = link_;
  auto zero = [link](const char* what) {
    LS_CHECK(link->zero != nullptr, "ZeroRedundancyOptimizer::comm_hook(): ", what,
             " after the optimizer was destroyed");
    return link->zero;
  };
  return {
      "zero_reduce_scatter",
      [zero](ProcessGroup& pg, GradBucket& b) { return zero("a backward")->reduce_bucket(pg, b); },
      [zero](GradBucket& b) { zero("a backward")->finish_bucket(b); },
      [link] {
        if (link->zero != nullptr) link->zero->wait_parameters();
      },
      [zero](const std::vector<GradBucket>& buckets, bool final) {
        zero("DDP laid its buckets out")->take_buckets(buckets, final);
      },
      [zero](double max_norm) { return zero("clip_grad_norm")->clip_grad_norm(max_norm); }};
}

}  // namespace lockstep::dist
