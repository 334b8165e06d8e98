// ZeroRedundancyOptimizer: Note [ZeRO-1], construction, the shard's step and the all-gather of
// the parameters (waited for at once or overlapped), the averaged gradients that clipping and a
// GradScaler see, and stats. The shard layout is in zero_layout.cpp, the comm hook that
// reduce-scatters DDP's buckets into the shard in zero_comm_hook.cpp, the state gathered for
// checkpoints and re-sharded across layouts and world sizes in zero_state.cpp.
#include "lockstep/distributed/zero.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>

#include "distributed/object_text.h"
#include "distributed/sharding/grad_norm.h"
#include "distributed/sharding/zero_internal.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/reduce.h"

namespace lockstep::dist {

// Note [ZeRO-1]
// What is sharded. The parameters are cut into segments: by default one, all parameters of all
// groups flattened in group then parameter order (the optimizer's own state index order); with
// reduce_scatter_gradients, one per DDP bucket, its parameters in the bucket's order. A segment
// of n elements is cut into W shards of q = floor(n / W) elements, rank r owning [r q, (r+1) q),
// and a tail [W q, n) of fewer than W elements that every rank steps (the same floats from the
// same inputs on every rank, so nothing needs sending; padding the segment to a multiple of W
// instead would need a padded copy of every bucket for the reduce-scatter). The parts of
// parameters inside a rank's shards and the tails are its pieces: 1-D slices of one flat tensor,
// shard_ (every segment's shard then its tail), which the wrapped optimizer steps as if they were
// parameters (each piece in its parameter's group, so lr and weight decay per group hold). So the
// optimizer state on a rank is state for total / W elements plus fewer than W per segment, plus
// a scalar per piece where the optimizer keeps one (AdamW's per-parameter step count).
//
// Why bitwise equal to the plain optimizer. SGD and AdamW update each element from that
// element's parameter, gradient and state alone, with scalars (lr, bias corrections from the
// per-parameter step count) that are the same for every piece of a parameter. Stepping a piece
// therefore computes exactly the floats that stepping the whole parameter computes for those
// elements, and the all-gather only moves them. An optimizer that mixes elements (a norm per
// parameter, as LAMB) would not be equal, and is not supported.
//
// Reduce-scatter. ZeRO-1 proper reduce-scatters the gradients, so each rank receives only its
// shard's average (with the parameters' all-gather, the bytes of one all-reduce). Bitwise
// equality with DDP then needs the reduce-scatter to add the ranks' terms of every element in
// the order the all-reduce adds them. shm and Gloo do: both reduce each element in rank order
// in both collectives (tests/distributed/shm/shm_test.cpp checks that shm's reduce_scatter chunk is
// bit-identical to its all_reduce's; Note [Gloo rank-order reduction] and
// tests/distributed/gloo/gloo_rank_order_test.cpp, that Gloo's all_reduce is reduce_scatter +
// all_gather bit for bit, and shm's bits), and so does any backend at 2 ranks (a + b == b + a).
// Before Gloo reduced in rank order (2026-12-03: gloo::allreduce, whose order of addition for an
// element depended on the segment it fell in, against a ring reduce-scatter) rank r's
// reduce_scatter output differed from chunk r of the all_reduce of the same random f32 inputs in
// 1 of 300,009 elements at 3 ranks and 94,182 of 400,012 at 4.
//
// So there are two modes. By default ZeRO takes the gradients DDP already averaged (any comm
// hook, any backend, bitwise always) and saves the optimizer-state memory, ZeRO-1's point, for
// one extra all-gather of the parameters per step. With ZeroOptions::reduce_scatter_gradients,
// DDP runs comm_hook(): as each bucket's gradients are ready during backward, its first W q
// elements are reduce-scattered in place into this rank's chunk of that bucket's buffer
// (reduced_[b].own is a view of it; NCCL and MPI call this in place, llm.c does the same), and
// the rest of the bucket's buffer (the tail, the unused-parameter status and the slow-rank slots
// of Note [Slow rank]) is all-reduced in place; both overlap the rest of the backward as DDP's
// all-reduces do. The gradient thus lives in one place, the bucket (the parameters' .grad()):
// after backward it holds the average in this rank's chunk and the tail, and local values in the
// other ranks' chunks, which nothing reads. So gradient clipping goes through clip_grad_norm()
// here, and a GradScaler through step_gradients() (the averaged shards) and agree_found_inf()
// (an inf one rank found is every rank's: a one-element all-reduce, so the scaler's step is then
// collective).
//
// Buckets. DDP lays its buckets out at construction and again after the first backward (in the
// order gradients became ready, Note [Bucket order]); CommHook::on_buckets tells the hook each
// time. Until the layout is final, the hook all-reduces whole buckets (as DDP would), so step 1
// reads whole averaged gradients from .grad() and can lay the segments out by the rebuilt
// buckets before any optimizer state exists: nothing moves after it. From the second backward
// on, buckets are reduce-scattered into the segments. When the segments change while there is
// state (a checkpoint loaded before step 1, whose state sits in the one flat segment of
// construction), reshard() moves it one old segment at a time, its shards all-gathered, so the
// memory it takes for a moment is one bucket's state, not the whole state on every rank. Every
// rank sees rank 0's layout, so every rank does it at the same step.
//
// Overlap. step() launches one all-gather per segment, the one the next forward needs first
// (DDP's last bucket holds the first layers) first. Without overlap_all_gather it waits for them
// and writes the parameters at once. With it, step() returns with them running (Gloo runs them
// on its communication thread; shm has already finished them on the caller's), and the next
// forward of the DDP model waits and writes the parameters (CommHook::before_forward), so the
// all-gathers overlap whatever the loop does in between: zero_grad, loading the next batch,
// logging. step(), clip_grad_norm(), step_gradients(), load_state_dict() and Join's end wait
// too; anything else that reads or writes the parameters first must call wait_parameters() (a
// write would be overwritten when the all-gathers land).
//
// Checkpoints. state_dict() rebuilds the full state in the plain optimizer's own format: for each
// per-element field, every rank writes its pieces' state into a shard_-sized buffer (the same
// size on every rank) and one all_gather per field brings all of them; every rank's pieces follow
// from the segments, so each is copied to its parameter's place. The scalars per parameter
// (AdamW's step count) travel as text in an all_gather_object; "step" and the groups' lr are
// every rank's. load_state_dict() takes this rank's slices of a full state. So a checkpoint is
// the same file whether ZeRO wrote it or not, and loads into any world size, with ZeRO or
// without, in either mode.

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups,
                                                 ProcessGroupPtr pg, const OptimizerFactory& make,
                                                 ZeroOptions opts)
    : Optimizer(groups, 0.0, 0.0, "ZeroRedundancyOptimizer"),
      pg_(std::move(pg)),
      opts_(opts),
      make_(make),
      user_groups_(groups),
      link_(std::make_shared<HookLink>()) {
  LS_CHECK(pg_ != nullptr, "ZeroRedundancyOptimizer: expected a process group, got null");
  LS_CHECK(make_ != nullptr, "ZeroRedundancyOptimizer: expected an optimizer factory, got null");
  LS_CHECK(!opts_.overlap_all_gather || opts_.reduce_scatter_gradients,
           "ZeroRedundancyOptimizer: ZeroOptions::overlap_all_gather needs "
           "reduce_scatter_gradients (the DDP model's forward waits through comm_hook())");
  link_->zero = this;
  Segment all;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const Tensor& p : groups[g].params) {
      LS_CHECK(p.defined() && p.is_contiguous(),
               "ZeroRedundancyOptimizer: expected contiguous parameters, got one with shape ",
               p.shape().str(), " strides ", p.strides().str());
      if (!params_.empty()) {
        LS_CHECK(p.dtype() == params_[0].dtype() && p.device() == params_[0].device(),
                 "ZeroRedundancyOptimizer: expected every parameter to have one dtype and device "
                 "(",
                 dtype_name(params_[0].dtype()), "), got ", dtype_name(p.dtype()),
                 " for parameter ", params_.size());
      }
      all.params.push_back(params_.size());
      LS_CHECK(index_of_.emplace(p.impl(), params_.size()).second,
               "ZeroRedundancyOptimizer: parameter ", params_.size(),
               " is given twice (it is parameter ", index_of_[p.impl()], " already)");
      all.offset.push_back(total_);
      total_ += p.numel();
      params_.push_back(p);
      group_of_.push_back(g);
    }
  }
  LS_CHECK(total_ > 0, "ZeroRedundancyOptimizer: expected parameters, got none");
  all.numel = total_;
  // With reduce_scatter_gradients the segments become DDP's buckets at the first step
  // (follow_buckets); until then, and otherwise, one segment of everything.
  std::vector<Segment> segments;
  segments.push_back(std::move(all));
  lay_out(std::move(segments));

  // The groups' lr and weight decay as the wrapped optimizer resolved them (its defaults where
  // the user left them unset), from rank 0.
  std::ostringstream text;
  for (const auto& g : local_->param_groups())
    text << detail::exact(g.lr) << ' ' << detail::exact(g.weight_decay) << ' ';
  std::istringstream in(broadcast_text(*pg_, text.str()));
  for (auto& g : groups_) {
    std::string lr, wd;
    in >> lr >> wd;
    g.lr = std::strtod(lr.c_str(), nullptr);
    g.weight_decay = std::strtod(wd.c_str(), nullptr);
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() {
  link_->zero = nullptr;
  // Collectives in flight hold our tensors.
  for (auto& r : reduced_) {
    if (r.scatter) {
      try {
        r.scatter->wait();
      } catch (...) {
      }
    }
  }
  for (auto& s : segments_) {
    if (s.gather) {
      try {
        s.gather->wait();
      } catch (...) {
      }
    }
  }
}

double ZeroRedundancyOptimizer::clip_grad_norm(double max_norm) {
  LS_CHECK(opts_.reduce_scatter_gradients,
           "ZeroRedundancyOptimizer::clip_grad_norm is for reduce_scatter_gradients; otherwise "
           "every rank holds the averaged gradients: use optim::clip_grad_norm");
  LS_CHECK(max_norm >= 0, "clip_grad_norm: max_norm must be >= 0, got ", max_norm);
  autograd::NoGradGuard no_grad;
  wait_parameters();
  follow_buckets();
  // Every rank holds the tails: count them once (rank 0's).
  std::vector<Tensor> mine, all;
  for (const Piece& piece : pieces_) {
    Tensor g = piece_grad(piece);
    if (!g.defined()) continue;
    all.push_back(g);
    if (!piece.tail || pg_->rank() == 0) mine.push_back(g);
  }
  return optim::scale_to_max_norm(all, sharded_grad_norm(*pg_, mine), max_norm);
}

std::vector<Tensor> ZeroRedundancyOptimizer::step_gradients() {
  if (!opts_.reduce_scatter_gradients) return Optimizer::step_gradients();
  wait_parameters();
  follow_buckets();
  std::vector<Tensor> grads;
  for (const Piece& piece : pieces_) {
    Tensor g = piece_grad(piece);
    if (g.defined()) grads.push_back(std::move(g));
  }
  return grads;
}

bool ZeroRedundancyOptimizer::agree_found_inf(bool found) {
  if (!opts_.reduce_scatter_gradients) return found;
  Tensor flag = full({1}, found ? 1.0 : 0.0, kFloat32).to(params_[0].device());
  pg_->all_reduce(flag, {.op = ReduceOp::max})->wait();
  return flag.to(Device()).item() != 0.0;
}

// A piece's averaged gradient, in the bucket's buffer: through this rank's chunk of it, or (the
// tail, whole buckets, and everything without reduce_scatter_gradients) the parameter's .grad(),
// a view of the same buffer.
Tensor ZeroRedundancyOptimizer::piece_grad(const Piece& piece) const {
  const Tensor& p = params_[piece.param];
  if (opts_.reduce_scatter_gradients && !full_grads_ && !piece.tail) {
    const Segment& s = segments_[piece.segment];
    return reduced_[piece.segment].own.narrow(0, piece.shard_offset - s.own_at, piece.numel);
  }
  const Tensor g = p.grad();
  if (!g.defined()) return Tensor();
  return g.reshape({-1}).narrow(0, piece.param_offset, piece.numel);
}

void ZeroRedundancyOptimizer::step() {
  autograd::NoGradGuard no_grad;
  wait_parameters();
  if (opts_.reduce_scatter_gradients) follow_buckets();
  ++steps_;
  // The pieces start from the parameters' current values (a checkpoint or the user may have set
  // them) and see their slices of the averaged gradients.
  for (Piece& piece : pieces_) {
    const Tensor& p = params_[piece.param];
    piece.tensor.copy_(p.reshape({-1}).narrow(0, piece.param_offset, piece.numel));
    piece.tensor.set_grad(piece_grad(piece));
  }
  // set_lr and schedules write the user's groups; the wrapped optimizer follows them.
  for (size_t g = 0; g < groups_.size(); ++g) {
    local_->param_groups()[g].lr = groups_[g].lr;
    local_->param_groups()[g].weight_decay = groups_[g].weight_decay;
  }
  local_->step();
  launched_ = finished_ = 0;
  // Note [ZeRO-1], Overlap: the segment the next forward needs first (DDP's last bucket holds
  // the first layers) goes first.
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t k = segments_.size(); k-- > 0;) {
    Segment& s = segments_[k];
    if (s.per_rank > 0)
      s.gather = pg_->all_gather(s.gathered, shard_.narrow(0, s.own_at, s.per_rank));
  }
  gathering_ = true;
  gather_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!opts_.overlap_all_gather) wait_parameters();
}

void ZeroRedundancyOptimizer::wait_parameters() {
  if (!gathering_) return;
  gathering_ = false;
  autograd::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t world = pg_->size();
  for (size_t k = segments_.size(); k-- > 0;) {
    Segment& s = segments_[k];
    if (s.gather) {
      const WorkPtr work = std::move(s.gather);
      work->wait();
    }
    const int64_t shards = world * s.per_rank;
    for (size_t j = 0; j < s.params.size(); ++j) {
      Tensor p = params_[s.params[j]].reshape({-1});
      const int64_t begin = s.offset[j], end = begin + p.numel();
      if (begin < shards) {
        const int64_t n = std::min(end, shards) - begin;
        p.narrow(0, 0, n).copy_(s.gathered.narrow(0, begin, n));
      }
      if (end > shards) {
        const int64_t lo = std::max(begin, shards);
        p.narrow(0, lo - begin, end - lo)
            .copy_(shard_.narrow(0, s.tail_at + lo - shards, end - lo));
      }
    }
  }
  gather_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

ZeroStats ZeroRedundancyOptimizer::stats() const {
  ZeroStats s;
  s.total_elements = total_;
  s.shard_elements = shard_size_;
  for (const Segment& seg : segments_)
    s.replicated_elements += seg.numel - pg_->size() * seg.per_rank;
  s.segments = static_cast<int64_t>(segments_.size());
  s.gather_seconds = gather_seconds_;
  size_t index = 0;
  std::string field;
  for (const auto& [name, t] : local_->state_dict()) {
    if (detail::split_key(name, index, field)) s.state_bytes += t.nbytes();
  }
  return s;
}

}  // namespace lockstep::dist
