// ZeroRedundancyOptimizer's shard layout (Note [ZeRO-1] in zero.cpp, What is sharded and
// Buckets): the segments, each rank's pieces of them in shard_, and the segments that follow
// DDP's buckets once their layout is final.
#include <algorithm>
#include <tuple>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/zero.h"

namespace lockstep::dist {

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

}  // namespace lockstep::dist
