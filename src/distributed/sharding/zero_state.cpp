// ZeroRedundancyOptimizer's state (Note [ZeRO-1] in zero.cpp, Checkpoints and Buckets): what
// every rank's wrapped optimizer holds, the state moved into new segments (reshard), the full
// state in the plain optimizer's format (state_dict) and this rank's slices of one
// (load_state_dict), so a checkpoint loads into any world size.
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>

#include "distributed/object_text.h"
#include "distributed/sharding/zero_internal.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/zero.h"

namespace lockstep::dist {

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
    if (!detail::split_key(name, k, field)) {  // the wrapped optimizer's "step", "group.<g>.lr"
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
           << detail::exact(t.item()) << '\n';
    }
  }
  for (const auto& [field, dtype] : fields) {
    text << "field " << field << ' ' << static_cast<int>(dtype) << '\n';
  }
  const std::vector<std::string> all = all_gather_text(*pg_, text.str());
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream in(all[r]);
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
    if (!detail::split_key(name, i, field)) {
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
