// Reducer: gradient buckets, launched as their gradients become ready during backward.
#include "distributed/data_parallel/reducer.h"

#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <unordered_set>

#include "distributed/data_parallel/join_rescale.h"
#include "lockstep/autograd/engine.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/base/log.h"

namespace lockstep::dist {

namespace {
using Clock = std::chrono::steady_clock;
}

Reducer::Reducer(std::vector<std::pair<std::string, Tensor>> params, ProcessGroupPtr pg,
                 const DDPOptions& opts)
    : params_(std::move(params)),
      pg_(std::move(pg)),
      opts_(opts),
      slow_rank_(opts_.slow_rank_ratio, opts_.slow_rank_steps) {
  if (opts_.bucket_bytes == kBucketBytesFromGroup) {
    opts_.bucket_bytes = bucket_bytes_from_group(*pg_);
  }
  LS_CHECK(opts_.first_bucket_bytes > 0 && opts_.bucket_bytes > 0,
           "DistributedDataParallel: bucket caps must be > 0 bytes (or bucket_bytes = "
           "kBucketBytesFromGroup), got first_bucket_bytes ",
           opts_.first_bucket_bytes, " and bucket_bytes ", opts_.bucket_bytes);
  LS_CHECK(opts_.comm_hook.start != nullptr, "DistributedDataParallel: the comm hook '",
           opts_.comm_hook.name, "' has no start function");
  // Note [Bucket order]: gradients become ready roughly in reverse registration order (the last
  // layer's first), so buckets start that way; after the first step they are rebuilt in the order
  // actually observed (rank 0's, so that every rank launches the same buckets in the same order).
  std::vector<size_t> order(params_.size());
  std::iota(order.rbegin(), order.rend(), size_t{0});
  build_buckets(order);
  ready_.assign(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) {
    hook_ids_.push_back(params_[i].second.register_post_accumulate_grad_hook(
        [this, i](Tensor&) { on_grad_ready(i); }));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < params_.size() && i < hook_ids_.size(); ++i) {
    params_[i].second.remove_post_accumulate_grad_hook(hook_ids_[i]);
  }
  // Collectives still in flight hold their tensors; wait so none outlives its bucket's purpose.
  for (auto& b : buckets_) {
    if (b.work) {
      try {
        b.work->wait();
      } catch (...) {
      }
    }
  }
}

void Reducer::set_comm_hook(CommHook hook) {
  LS_CHECK(stats_.synced_steps == 0 && !iteration_active_,
           "DistributedDataParallel: register_comm_hook('", hook.name,
           "') after a synchronized backward; register the hook before the first one");
  LS_CHECK(hook.start != nullptr, "DistributedDataParallel: the comm hook '", hook.name,
           "' has no start function");
  announce_buckets(hook);  // first: a hook that refuses the buckets is not set
  opts_.comm_hook = std::move(hook);
}

void Reducer::announce_buckets(const CommHook& hook) {
  if (!hook.on_buckets) return;
  std::vector<GradBucket> layout;
  for (const auto& b : buckets_) {
    GradBucket g;
    g.index = b.handle.index;
    g.numel = b.numel;
    g.parameter_names = b.handle.parameter_names;
    g.parameters = b.handle.parameters;
    layout.push_back(std::move(g));
  }
  hook.on_buckets(layout, rebuilt_);
}

void Reducer::build_buckets(const std::vector<size_t>& order) {
  autograd::NoGradGuard no_grad;
  std::vector<Bucket> buckets;
  std::vector<Slot> slots(params_.size());
  int64_t bytes = 0;
  for (size_t i : order) {
    const Tensor& p = params_[i].second;
    // The bucket being filled is the first (small cap) or a later one (large cap).
    const int64_t limit = buckets.size() == 1 ? opts_.first_bucket_bytes : opts_.bucket_bytes;
    if (buckets.empty() || buckets.back().dtype != p.dtype() ||
        !(buckets.back().device == p.device()) || (bytes > 0 && bytes + p.nbytes() > limit)) {
      buckets.emplace_back();
      buckets.back().dtype = p.dtype();
      buckets.back().device = p.device();
      bytes = 0;
    }
    Bucket& b = buckets.back();
    slots[i].bucket = buckets.size() - 1;
    slots[i].offset = b.numel;
    b.params.push_back(i);
    b.numel += p.numel();
    bytes += p.nbytes();
  }
  for (size_t bi = 0; bi < buckets.size(); ++bi) {
    Bucket& b = buckets[bi];
    // On the parameters' device, so that the gradients accumulate straight into it there.
    b.extra = bi == 0 ? 1 + pg_->size() : 1;  // Note [Slow rank]: the time slots
    AllocationScope scope("DDP's gradient buckets");
    b.flat = empty({b.numel + b.extra}, TensorOptions(b.dtype).with_device(b.device));
    b.flat.zero_();
    b.pending = static_cast<int>(b.params.size());
    b.handle.index = static_cast<int>(bi);
    b.handle.buffer = b.flat;
    b.handle.numel = b.numel;
    for (size_t i : b.params) {
      const Tensor& p = params_[i].second;
      Slot& s = slots[i];
      s.view = b.flat.narrow(0, s.offset, p.numel()).view(p.shape());
      b.handle.parameter_names.push_back(params_[i].first);
      b.handle.parameters.push_back(p);
      if (p.grad().defined()) {
        s.view.copy_(p.grad());
        p.set_grad(s.view);
      }
    }
  }
  buckets_ = std::move(buckets);
  slots_ = std::move(slots);
  stats_.bucket_bytes.clear();
  stats_.bucket_params.clear();
  for (const auto& b : buckets_) {
    stats_.bucket_bytes.push_back(b.numel * dtype_size(b.dtype));
    stats_.bucket_params.push_back(static_cast<int64_t>(b.params.size()));
  }
  announce_buckets(opts_.comm_hook);
}

// Note [First gradient copied in]
// The gradient must live in the bucket. After zero_grad() (set_to_none, the default) a
// parameter's .grad() is undefined, AccumulateGrad keeps the incoming gradient, and it is copied
// into the bucket view here: two passes over the gradient. Handing the zeroed view back before
// forward, so that AccumulateGrad adds into it, cost four (the zeroing, then an add that reads
// both); on the MLP that was 5% of a DDP step. Later micro-batches under no_sync, or a
// zero_grad(false), find the view defined and accumulate into it in place. A .grad() the user
// replaced is copied in the same way.
void Reducer::ensure_view(size_t i) {
  const Tensor& p = params_[i].second;
  Tensor view = slots_[i].view;
  Tensor g = p.grad();
  if (g.defined() && g.data_ptr() == view.data_ptr() && g.is_contiguous()) return;
  autograd::NoGradGuard no_grad;
  if (g.defined()) {
    view.copy_(g);
  } else {
    view.zero_();
  }
  p.set_grad(view);
}

void Reducer::on_grad_ready(size_t i) {
  ensure_view(i);
  if (no_sync_) return;  // accumulate locally; the next synced backward reduces it all
  if (!iteration_active_) {
    iteration_active_ = true;
    bytes_this_step_ = 0;
    autograd::queue_callback([this] { finalize(); });
  }
  if (ready_[i]) return;
  ready_[i] = true;
  ready_order_.push_back(i);
  if (--buckets_[slots_[i].bucket].pending == 0) launch_ready();
}

// Buckets go out in index order on every rank, whatever order they fill in: a later bucket that
// is ready first waits for the earlier ones (collectives must match across ranks).
//
// On a GPU the gradients are produced by kernels on the current stream, still running when the
// hook fires; the backend orders the collective after them (NCCL: its stream waits on an event
// of the current stream; a CPU backend's staging copy waits for the stream), so backward goes on
// queueing kernels while the bucket is reduced. finalize()'s wait() makes the current stream
// wait for each reduction (NCCL: on the device, not the host), so the optimizer's kernels that
// follow read the averaged gradients.
void Reducer::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_++];
    if (next_launch_ == 1) write_step_time(b);
    b.handle.contributors = contributors_ > 0 ? contributors_ : pg_->size();
    b.handle.wire_bytes = 0;
    b.work = opts_.comm_hook.start(*pg_, b.handle);
    // A compressing hook (PowerSGD) says what its collectives carry; else the gradients' bytes.
    bytes_this_step_ +=
        b.handle.wire_bytes > 0 ? b.handle.wire_bytes : b.numel * dtype_size(b.dtype);
  }
}

// Every parameter counts as ready with a zero gradient, so the buckets go out in the order the
// contributing ranks launch them, and finalize() takes the same path (unused-parameter status,
// the first step's bucket rebuild) as on those ranks.
void Reducer::shadow_backward(bool expose_grads) {
  LS_CHECK(!iteration_active_,
           "DistributedDataParallel: a joined rank shadowed a backward while its own was running");
  {
    autograd::NoGradGuard no_grad;
    for (auto& b : buckets_) {
      b.flat.zero_();
      b.pending = 0;
    }
    // For a shadow step (Note [Join and ZeRO]): .grad() are the bucket views, as after a
    // backward of its own, and hold the others' average once reduced.
    if (expose_grads) {
      for (size_t i = 0; i < params_.size(); ++i) params_[i].second.set_grad(slots_[i].view);
    }
  }
  std::fill(ready_.begin(), ready_.end(), true);
  ready_order_.clear();
  step_clock_running_ = false;  // no time from a joined rank (Note [Slow rank])
  iteration_active_ = true;
  bytes_this_step_ = 0;
  launch_ready();
  finalize();
}

void Reducer::reset_iteration() {
  iteration_active_ = false;
  step_clock_running_ = false;
  std::fill(ready_.begin(), ready_.end(), false);
  ready_order_.clear();
  next_launch_ = 0;
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.work.reset();
  }
}

void Reducer::finalize() {
  const auto t0 = Clock::now();
  std::vector<size_t> unused;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) unused.push_back(i);
  }
  if (!unused.empty()) {
    // Zero contribution from this rank, so that every rank's collectives still match. Without
    // find_unused_parameters the count rides in the status element of the first bucket still
    // to go, and every rank learns of it from the reduced value.
    autograd::NoGradGuard no_grad;
    for (size_t i : unused) {
      slots_[i].view.zero_();
      params_[i].second.set_grad(slots_[i].view);
      --buckets_[slots_[i].bucket].pending;
    }
    if (!opts_.find_unused_parameters) {
      Bucket& b = buckets_[next_launch_];
      b.flat.narrow(0, b.numel, 1).fill_(static_cast<double>(unused.size()));
    }
    launch_ready();
  }
  try {
    for (auto& b : buckets_) {
      b.work->wait();
      if (opts_.comm_hook.finish) opts_.comm_hook.finish(b.handle);
    }
  } catch (...) {
    reset_iteration();
    throw;
  }
  // Note [Join]: the hooks averaged over the world size; fewer ranks may have contributed.
  for (auto& b : buckets_) {
    detail::rescale_to_contributors(b.flat.narrow(0, 0, b.numel), contributors_, pg_->size());
  }
  contributors_ = 0;
  const double exposed = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::vector<double> step_ms = read_step_times();
  bool someone_unused = false;
  if (!opts_.find_unused_parameters) {
    for (auto& b : buckets_) {
      Tensor status = b.flat.narrow(0, b.numel, 1);
      if (status.item() != 0.0) someone_unused = true;
      status.zero_();
    }
  }
  const std::vector<size_t> order = ready_order_;
  reset_iteration();
  if (someone_unused) throw_unused(unused);

  stats_.bytes_reduced_last_step = bytes_this_step_;
  stats_.synced_steps += 1;
  stats_.exposed_comm_seconds_last = exposed;
  stats_.exposed_comm_seconds_total += exposed;
  const std::optional<std::string> warning = slow_rank_.observe(step_ms, stats_);
  if (warning && pg_->rank() == 0) log_warning(*warning);  // every rank knows; one says it
  if (!rebuilt_) {
    ready_order_ = order;
    rebuild_in_ready_order();
    ready_order_.clear();
  }
}

void Reducer::start_step_clock() {
  if (step_clock_running_) return;
  step_clock_running_ = true;
  step_start_ = Clock::now();
}

// Note [Slow rank]: into bucket 0, just before its launch (the first of the step), this rank's
// compute time in its slot and zeros in the others' (which hold the last step's sums); only
// zeros when no training forward started the clock, or on a joined rank.
void Reducer::write_step_time(Bucket& b) {
  autograd::NoGradGuard no_grad;
  const int world = pg_->size();
  b.flat.narrow(0, b.numel + 1, world).zero_();
  if (!step_clock_running_) return;
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - step_start_).count();
  b.flat.narrow(0, b.numel + 1 + pg_->rank(), 1).fill_(carried_ms(ms));
}

// Every rank's time from the reduced slots of bucket 0. The hook averaged over the world size
// (its contract), and each slot's sum has only its rank's term: times the world size is that
// term.
std::vector<double> Reducer::read_step_times() const {
  if (buckets_.empty()) return {};
  const Bucket& b = buckets_[0];
  const int world = pg_->size();
  std::vector<double> ms = b.flat.narrow(0, b.numel + 1, world).to(Device()).to_vector<double>();
  for (double& v : ms) v *= world;
  return ms;
}

// Note [Bucket order] (see the constructor): rank 0's observed order, for every rank.
void Reducer::rebuild_in_ready_order() {
  std::vector<int32_t> order;
  std::vector<bool> seen(params_.size(), false);
  for (size_t i : ready_order_) {
    order.push_back(static_cast<int32_t>(i));
    seen[i] = true;
  }
  for (size_t i = params_.size(); i-- > 0;) {
    if (!seen[i]) order.push_back(static_cast<int32_t>(i));
  }
  Bytes mine(order.size() * sizeof(int32_t));
  std::memcpy(mine.data(), order.data(), mine.size());
  const Bytes agreed = pg_->broadcast_object(mine, 0);
  LS_CHECK(agreed.size() == mine.size(), "DistributedDataParallel: rank 0 has ",
           agreed.size() / sizeof(int32_t), " parameters to bucket, this rank ", order.size());
  std::memcpy(order.data(), agreed.data(), agreed.size());
  std::vector<size_t> new_order;
  std::vector<bool> placed(params_.size(), false);
  for (int32_t i : order) {
    LS_CHECK(i >= 0 && static_cast<size_t>(i) < params_.size() && !placed[i],
             "DistributedDataParallel: rank 0's bucket order is not a permutation");
    placed[i] = true;
    new_order.push_back(static_cast<size_t>(i));
  }
  rebuilt_ = true;
  build_buckets(new_order);
  stats_.buckets_rebuilt = true;
}

void Reducer::throw_unused(const std::vector<size_t>& unused_here) {
  std::string mine;
  for (size_t i : unused_here) mine += (mine.empty() ? "" : ", ") + params_[i].first;
  const auto all = pg_->all_gather_object(to_bytes(mine));
  std::string listing;
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string names = to_string(all[r]);
    if (!names.empty()) listing += lockstep::detail::str_cat("\n  rank ", r, ": ", names);
  }
  LS_THROW(
      "DistributedDataParallel: parameters that require grad received no gradient in this "
      "backward pass:",
      listing,
      "\nEvery such parameter must contribute to the loss on every rank; if some do not by "
      "design, construct DistributedDataParallel with find_unused_parameters = true (they are "
      "then reduced with zero contribution), or set requires_grad_(false) on them.");
}

}  // namespace lockstep::dist
