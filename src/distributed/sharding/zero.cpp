// ZeroRedundancyOptimizer: sharded optimizer state, the shard's step, the all-gather of the
// parameters, and the full state gathered for checkpoints and re-sharded on load.
#include "lockstep/distributed/zero.h"

#include "distributed/sharding/grad_norm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

#include "distributed/sharding/grad_norm.h"
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
// in both collectives (tests/distributed/shm_test.cpp checks that shm's reduce_scatter chunk is
// bit-identical to its all_reduce's; Note [Gloo rank-order reduction] and
// tests/distributed/gloo_rank_order_test.cpp, that Gloo's all_reduce is reduce_scatter +
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
// elements are reduce-scattered straight into this rank's shard of that bucket (reduced_[b].own),
// and the rest of the bucket's buffer (the tail, the unused-parameter status and the slow-rank
// slots of Note [Slow rank]) is all-reduced in place; both overlap the rest of the backward as
// DDP's all-reduces do. .grad() keeps local gradients but for the tails, so gradient clipping
// goes through clip_grad_norm() here, and a GradScaler through step_gradients() (the averaged
// shards) and agree_found_inf() (an inf one rank found is every rank's: a one-element
// all-reduce, so the scaler's step is then collective).
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

namespace {

// Exact text for a double (hexadecimal floating point).
std::string exact(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%a", v);
  return buf;
}

// "<index>.<field>" -> (index, field); false for the global entries.
bool split_key(const std::string& name, size_t& index, std::string& field) {
  const size_t dot = name.find('.');
  if (dot == std::string::npos || dot == 0) return false;
  const std::string idx = name.substr(0, dot);
  if (idx.find_first_not_of("0123456789") != std::string::npos) return false;
  index = std::stoul(idx);
  field = name.substr(dot + 1);
  return true;
}

}  // namespace

// What comm_hook() holds: the optimizer while it lives (its destructor clears it).
struct ZeroRedundancyOptimizer::HookLink {
  ZeroRedundancyOptimizer* zero = nullptr;
};

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
    text << exact(g.lr) << ' ' << exact(g.weight_decay) << ' ';
  const std::string mine = text.str();
  const Bytes agreed = pg_->broadcast_object(Bytes(mine.begin(), mine.end()), 0);
  std::istringstream in(std::string(agreed.begin(), agreed.end()));
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

std::vector<ZeroRedundancyOptimizer::Piece> ZeroRedundancyOptimizer::pieces_of(int rank) const {
  const int64_t world = pg_->size();
  std::vector<Piece> pieces;
  for (size_t si = 0; si < segments_.size(); ++si) {
    const Segment& s = segments_[si];
    // This rank's shard, then the tail, each with where it lies in shard_.
    const int64_t ranges[2][3] = {{rank * s.per_rank, (rank + 1) * s.per_rank, s.own_at},
                                  {world * s.per_rank, s.numel, s.tail_at}};
    for (int k = 0; k < 2; ++k) {
      const auto [begin, end, at] = std::tuple(ranges[k][0], ranges[k][1], ranges[k][2]);
      for (size_t j = 0; j < s.params.size(); ++j) {
        const int64_t lo = std::max(begin, s.offset[j]);
        const int64_t hi = std::min(end, s.offset[j] + params_[s.params[j]].numel());
        if (lo >= hi) continue;
        pieces.push_back(
            Piece{s.params[j], si, lo - s.offset[j], at + lo - begin, hi - lo, k == 1, Tensor()});
      }
    }
  }
  // The wrapped optimizer's order: by group, then parameter, then element.
  std::sort(pieces.begin(), pieces.end(), [&](const Piece& a, const Piece& b) {
    return std::tuple(group_of_[a.param], a.param, a.param_offset) <
           std::tuple(group_of_[b.param], b.param, b.param_offset);
  });
  return pieces;
}

void ZeroRedundancyOptimizer::lay_out(std::vector<Segment> segments) {
  autograd::NoGradGuard no_grad;
  const int64_t world = pg_->size();
  const auto options = TensorOptions(params_[0].dtype()).with_device(params_[0].device());
  int64_t at = 0;
  for (Segment& s : segments) {
    s.per_rank = s.numel / world;
    s.own_at = at;
    s.tail_at = at + s.per_rank;
    at = s.tail_at + (s.numel - world * s.per_rank);
    s.gathered = empty({world * s.per_rank}, options);
    s.gather.reset();
  }
  segments_ = std::move(segments);
  shard_size_ = at;
  shard_ = zeros({shard_size_}, options);
  pieces_ = pieces_of(pg_->rank());
  std::vector<optim::ParamGroup> local(user_groups_.size());
  for (size_t g = 0; g < user_groups_.size(); ++g) {
    local[g].lr = user_groups_[g].lr;
    local[g].weight_decay = user_groups_[g].weight_decay;
  }
  for (Piece& piece : pieces_) {
    piece.tensor = shard_.narrow(0, piece.shard_offset, piece.numel);
    local[group_of_[piece.param]].params.push_back(piece.tensor);
  }
  local_ = make_(std::move(local));
  LS_CHECK(local_ != nullptr, "ZeroRedundancyOptimizer: the optimizer factory returned null");
}

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
// world) are reduce-scattered into this rank's shard of the bucket; the rest of the buffer, the
// tail of fewer than world gradients and the reducer's own elements, is all-reduced in place.
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
  const int64_t q = b.numel / world;
  if (!r.own.defined() || r.own.numel() != q)
    r.own = empty({q}, TensorOptions(b.buffer.dtype()).with_device(b.buffer.device()));
  if (q > 0) {
    r.scatter = pg.reduce_scatter(r.own, b.buffer.narrow(0, 0, world * q), {.op = ReduceOp::avg});
  }
  Tensor rest = b.buffer.narrow(0, world * q, b.buffer.numel() - world * q);
  return pg.all_reduce(rest, {.op = ReduceOp::avg});
}

void ZeroRedundancyOptimizer::finish_bucket(GradBucket& b) {
  Reduced& r = reduced_.at(static_cast<size_t>(b.index));
  ++finished_;
  if (r.whole) return;  // the reducer rescales the buffer itself
  if (r.scatter) r.scatter->wait();
  // Note [Join]: the reducer rescales the buffer (the tail) after finish(); the shard here.
  const int world = pg_->size();
  if (b.contributors > 0 && b.contributors != world) {
    autograd::NoGradGuard no_grad;
    r.own.mul_(static_cast<double>(world) / b.contributors);
  }
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
      }};
}

void ZeroRedundancyOptimizer::follow_buckets() {
  LS_CHECK(launched_ > 0 && finished_ == launched_,
           "ZeroRedundancyOptimizer: step() with reduce_scatter_gradients needs a synchronized "
           "backward of the DDP model since the last step, with comm_hook() registered "
           "(DistributedDataParallel::register_comm_hook); ",
           launched_ == 0 ? "no bucket was reduced by it" : "some buckets were not");
  // A reduce-scattering backward fixes the layout (its shards); whole buckets fit any, so then
  // the segments become DDP's buckets as they are now (rebuilt after the first backward).
  const std::vector<Reduced>& buckets = full_grads_ && !announced_.empty() ? announced_ : reduced_;
  bool same = buckets.size() == segments_.size();
  for (size_t b = 0; same && b < buckets.size(); ++b)
    same = buckets[b].params == segments_[b].params && buckets[b].numel == segments_[b].numel;
  if (same) return;
  std::vector<Segment> segments(buckets.size());
  std::vector<bool> seen(params_.size(), false);
  for (size_t b = 0; b < buckets.size(); ++b) {
    Segment& s = segments[b];
    s.params = buckets[b].params;
    for (size_t i : s.params) {
      LS_CHECK(!seen[i], "ZeroRedundancyOptimizer: parameter ", i, " is in two DDP buckets");
      seen[i] = true;
      s.offset.push_back(s.numel);
      s.numel += params_[i].numel();
    }
    LS_CHECK(s.numel == buckets[b].numel, "ZeroRedundancyOptimizer: DDP's bucket ", b, " holds ",
             buckets[b].numel, " gradient elements, its parameters ", s.numel);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    LS_CHECK(seen[i], "ZeroRedundancyOptimizer: parameter ", i, " (shape ",
             params_[i].shape().str(),
             ") is in no DDP bucket; with reduce_scatter_gradients every parameter it steps must "
             "be one of the DDP model's that require grad");
  }
  reshard(std::move(segments));
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
  return clip_shards(all, sharded_grad_norm(*pg_, mine), max_norm);
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

// Where a piece's averaged gradient is: this rank's reduce-scattered shard of the bucket, or
// (the tail, and everything without reduce_scatter_gradients) the parameter's .grad().
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
    if (split_key(name, index, field)) s.state_bytes += t.nbytes();
  }
  return s;
}

// Note [ZeRO-1], Checkpoints. The text each rank sends: "field <name> <dtype>" per per-element
// field, "has <param> <field>" per parameter that
// has it, "scalar <param> <field> <dtype> <value>" per piece scalar.
// Collective: what every rank's wrapped optimizer holds, by parameter.
ZeroRedundancyOptimizer::StateIndex ZeroRedundancyOptimizer::index_state() const {
  StateIndex index;
  std::ostringstream text;
  std::map<std::string, DType> fields;  // per-element fields here
  for (const auto& [name, t] : local_->state_dict()) {
    size_t k = 0;
    std::string field;
    if (!split_key(name, k, field)) {  // the wrapped optimizer's "step", "group.<g>.lr"
      index.globals.emplace_back(name, t);
      continue;
    }
    LS_CHECK(k < pieces_.size(), "ZeroRedundancyOptimizer: the wrapped optimizer has state '", name,
             "' for piece ", k, " of ", pieces_.size());
    const Piece& piece = pieces_[k];
    if (t.dim() == 1 && t.numel() == piece.numel) {
      fields.emplace(field, t.dtype());
      text << "has " << piece.param << ' ' << field << '\n';
      index.local[name] = t;
    } else {
      LS_CHECK(t.numel() == 1, "ZeroRedundancyOptimizer: expected state '", name,
               "' to be shaped like its piece (", piece.numel, ") or a scalar, got shape ",
               t.shape().str());
      text << "scalar " << piece.param << ' ' << field << ' ' << static_cast<int>(t.dtype()) << ' '
           << exact(t.item()) << '\n';
    }
  }
  for (const auto& [field, dtype] : fields) {
    text << "field " << field << ' ' << static_cast<int>(dtype) << '\n';
  }
  const std::string mine = text.str();
  const auto all = pg_->all_gather_object(Bytes(mine.begin(), mine.end()));
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream in(std::string(all[r].begin(), all[r].end()));
    std::string kind;
    while (in >> kind) {
      std::string name, value;
      int dtype = 0;
      size_t param = 0;
      if (kind == "field") {
        in >> name >> dtype;
        index.fields.emplace(name, static_cast<DType>(dtype));
      } else if (kind == "has") {
        in >> param >> name;
        index.has.emplace(param, name);
      } else {
        LS_CHECK(kind == "scalar", "ZeroRedundancyOptimizer: bad state line '", kind, "'");
        in >> param >> name >> dtype >> value;
        index.scalars.emplace(
            std::make_pair(param, name),
            full({}, std::strtod(value.c_str(), nullptr), static_cast<DType>(dtype)));
      }
    }
  }
  return index;
}

// This rank's state of one per-element field, laid out as shard_ (zeros where it has none).
Tensor ZeroRedundancyOptimizer::field_shard(const StateIndex& index, const std::string& field,
                                            DType dtype) const {
  Tensor shard = zeros({shard_size_}, TensorOptions(dtype).with_device(params_[0].device()));
  for (size_t k = 0; k < pieces_.size(); ++k) {
    auto it = index.local.find(std::to_string(k) + "." + field);
    if (it != index.local.end())
      shard.narrow(0, pieces_[k].shard_offset, pieces_[k].numel).copy_(it->second);
  }
  return shard;
}

// Note [ZeRO-1], Buckets: the state moves to the new segments one old segment at a time: its
// shards all-gathered (a bucket's worth of memory, not the whole state), its tail this rank's
// own, and each new piece copies its elements out. Scalars per parameter travel as text.
void ZeroRedundancyOptimizer::reshard(std::vector<Segment> next) {
  autograd::NoGradGuard no_grad;
  const StateIndex index = index_state();
  const int64_t world = pg_->size();
  std::vector<Tensor> old_shards;
  for (const auto& [field, dtype] : index.fields)
    old_shards.push_back(field_shard(index, field, dtype));
  const std::vector<Segment> old = std::move(segments_);
  lay_out(std::move(next));
  // Each parameter's old segment and first element in it.
  std::vector<std::pair<size_t, int64_t>> where(params_.size());
  for (size_t k = 0; k < old.size(); ++k) {
    for (size_t j = 0; j < old[k].params.size(); ++j)
      where[old[k].params[j]] = {k, old[k].offset[j]};
  }
  optim::NamedTensors state = index.globals;
  size_t f = 0;
  for (const auto& [field, dtype] : index.fields) {
    const Tensor& before = old_shards[f++];
    Tensor after = zeros({shard_size_}, TensorOptions(dtype).with_device(params_[0].device()));
    for (size_t k = 0; k < old.size(); ++k) {
      const Segment& s = old[k];
      const int64_t shards = world * s.per_rank;
      Tensor gathered = empty({shards}, TensorOptions(dtype).with_device(params_[0].device()));
      if (s.per_rank > 0) pg_->all_gather(gathered, before.narrow(0, s.own_at, s.per_rank))->wait();
      for (const Piece& piece : pieces_) {
        if (where[piece.param].first != k) continue;
        const int64_t o = where[piece.param].second + piece.param_offset, n = piece.numel;
        if (o < shards) {
          const int64_t m = std::min(o + n, shards) - o;
          after.narrow(0, piece.shard_offset, m).copy_(gathered.narrow(0, o, m));
        }
        if (o + n > shards) {
          const int64_t lo = std::max(o, shards);
          after.narrow(0, piece.shard_offset + lo - o, o + n - lo)
              .copy_(before.narrow(0, s.tail_at + lo - shards, o + n - lo));
        }
      }
    }
    for (size_t k = 0; k < pieces_.size(); ++k) {
      if (index.has.count({pieces_[k].param, field}))
        state.emplace_back(std::to_string(k) + "." + field,
                           after.narrow(0, pieces_[k].shard_offset, pieces_[k].numel).clone());
    }
  }
  for (size_t k = 0; k < pieces_.size(); ++k) {
    for (const auto& [key, t] : index.scalars)
      if (key.first == pieces_[k].param)
        state.emplace_back(std::to_string(k) + "." + key.second, t);
  }
  local_->load_state_dict(state);
}

optim::NamedTensors ZeroRedundancyOptimizer::state_dict() const {
  autograd::NoGradGuard no_grad;
  const StateIndex index = index_state();
  // The step count and the groups' lr are the same on every rank: this rank's.
  optim::NamedTensors out;
  out.emplace_back("step", full({}, static_cast<double>(steps_), kInt64));
  for (size_t g = 0; g < groups_.size(); ++g)
    out.emplace_back("group." + std::to_string(g) + ".lr", full({}, groups_[g].lr, kFloat64));
  const auto& all_fields = index.fields;
  const auto& has = index.has;
  const auto& scalars = index.scalars;
  // Each rank's shards and tails, gathered; every rank's pieces follow from the segments.
  std::map<std::pair<size_t, std::string>, Tensor> per_element;
  const auto device = params_[0].device();
  const int world = pg_->size();
  std::vector<std::vector<Piece>> pieces_by_rank;
  for (int r = 0; r < world; ++r) pieces_by_rank.push_back(pieces_of(r));
  for (const auto& [field, dtype] : all_fields) {
    const Tensor shard = field_shard(index, field, dtype);
    Tensor gathered = empty({shard_size_ * world}, TensorOptions(dtype).with_device(device));
    pg_->all_gather(gathered, shard)->wait();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (has.count({i, field}))
        per_element[{i, field}] =
            zeros({params_[i].numel()}, TensorOptions(dtype).with_device(device));
    }
    for (int r = 0; r < world; ++r) {
      for (const Piece& piece : pieces_by_rank[r]) {
        auto it = per_element.find({piece.param, field});
        if (it == per_element.end()) continue;
        it->second.narrow(0, piece.param_offset, piece.numel)
            .copy_(gathered.narrow(0, r * shard_size_ + piece.shard_offset, piece.numel));
      }
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      auto it = per_element.find({i, field});
      if (it != per_element.end()) it->second = it->second.view(params_[i].shape());
    }
  }
  // The plain optimizer's order: step, groups, then by parameter, fields sorted.
  for (size_t i = 0; i < params_.size(); ++i) {
    std::map<std::string, Tensor> entries;
    for (const auto& [key, t] : per_element)
      if (key.first == i) entries[key.second] = t;
    for (const auto& [key, t] : scalars)
      if (key.first == i) entries[key.second] = t;
    for (const auto& [field, t] : entries) out.emplace_back(std::to_string(i) + "." + field, t);
  }
  return out;
}

void ZeroRedundancyOptimizer::load_state_dict(const optim::NamedTensors& state) {
  autograd::NoGradGuard no_grad;
  // Note [ZeRO-1], Overlap: all-gathers still running would overwrite parameters loaded next.
  wait_parameters();
  optim::NamedTensors local;
  std::map<size_t, std::vector<size_t>> pieces_of;  // parameter -> its pieces here
  for (size_t k = 0; k < pieces_.size(); ++k) pieces_of[pieces_[k].param].push_back(k);
  for (const auto& [name, t] : state) {
    size_t i = 0;
    std::string field;
    if (!split_key(name, i, field)) {
      if (name == "step") steps_ = static_cast<int64_t>(t.item());
      const size_t dot = name.rfind('.');
      if (name.rfind("group.", 0) == 0 && dot > 6 && name.substr(dot) == ".lr") {
        const size_t g = std::stoul(name.substr(6, dot - 6));
        LS_CHECK(g < groups_.size(), "ZeroRedundancyOptimizer: state has group ", g,
                 " but the optimizer has ", groups_.size(), " groups");
        groups_[g].lr = t.item();
      }
      local.emplace_back(name, t);
      continue;
    }
    LS_CHECK(i < params_.size(), "ZeroRedundancyOptimizer: state for parameter ", i,
             " but the optimizer has ", params_.size(), " parameters");
    auto it = pieces_of.find(i);
    if (it == pieces_of.end()) continue;  // another rank's
    const bool per_element = t.shape() == params_[i].shape();
    for (size_t k : it->second) {
      const Piece& piece = pieces_[k];
      local.emplace_back(
          std::to_string(k) + "." + field,
          per_element ? t.reshape({-1}).narrow(0, piece.param_offset, piece.numel).contiguous()
                      : t);
    }
  }
  if (local_) local_->load_state_dict(local);
}

}  // namespace lockstep::dist
