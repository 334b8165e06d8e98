// ZeroRedundancyOptimizer: sharded optimizer state, the shard's step, the all-gather of the
// parameters, and the full state gathered for checkpoints and re-sharded on load.
#include "lockstep/distributed/zero.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"

namespace lockstep::dist {

// Note [ZeRO-1]
// What is sharded. The parameters of all groups are flattened in group then parameter order (the
// optimizer's own state index order), padded with zeros to a multiple of the world size W, and
// cut into W equal contiguous shards: rank r owns elements [r c, (r + 1) c), c = ceil(total / W).
// The parts of parameters that fall inside a rank's shard are its pieces: 1-D slices of one
// flat tensor, shard_, which the wrapped optimizer steps as if they were parameters (each piece
// in its parameter's group, so lr and weight decay per group hold). So the optimizer state on a
// rank is state for c elements: total / W plus at most W - 1 elements of padding, plus a scalar
// per piece where the optimizer keeps one (AdamW's per-parameter step count).
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
// DDP runs zero_hook(), which averages only the reducer's own elements of each bucket (the
// unused-parameter status and the slow-rank slots of Note [Slow rank] keep working, in one small
// all-reduce per bucket), and step() reduce-scatters the flat, padded local gradients in one call:
// bitwise DDP over shm and Gloo at any number of ranks. Its costs: the reduce-scatter runs in step(), not
// overlapped with backward as DDP's buckets are (per-bucket shards would overlap it, with DDP's
// bucket layout, rebuilt after the first step, deciding the shards), and .grad() holds local
// gradients until step(), so gradient clipping and a GradScaler's inf check would see them
// (they are not supported in that mode). In both modes the all-gather is waited for in step(),
// not overlapped with the next forward.
//
// Checkpoints. state_dict() rebuilds the full state in the plain optimizer's own format: for each
// per-element field, every rank writes its pieces' state into a shard-sized buffer and one
// all_gather per field reassembles the flat state; the scalars per parameter (AdamW's step
// count) travel as text in an all_gather_object; "step" and the groups' lr are every rank's.
// load_state_dict() takes this rank's slices of a full state. So a checkpoint is the same file
// whether ZeRO wrote it or not, and loads into any world size, with ZeRO or without.

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

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups,
                                                 ProcessGroupPtr pg, const OptimizerFactory& make,
                                                 ZeroOptions opts)
    : Optimizer(groups, 0.0, 0.0, "ZeroRedundancyOptimizer"), pg_(std::move(pg)), opts_(opts) {
  LS_CHECK(pg_ != nullptr, "ZeroRedundancyOptimizer: expected a process group, got null");
  LS_CHECK(make != nullptr, "ZeroRedundancyOptimizer: expected an optimizer factory, got null");
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
      offset_.push_back(total_);
      total_ += p.numel();
      params_.push_back(p);
      group_of_.push_back(g);
    }
  }
  LS_CHECK(total_ > 0, "ZeroRedundancyOptimizer: expected parameters, got none");
  const int64_t world = pg_->size(), rank = pg_->rank();
  chunk_ = (total_ + world - 1) / world;
  const auto options = TensorOptions(params_[0].dtype()).with_device(params_[0].device());
  shard_ = zeros({chunk_}, options);
  flat_ = empty({chunk_ * world}, options);
  if (opts_.reduce_scatter_gradients) {
    grad_flat_ = zeros({chunk_ * world}, options);  // the padding stays 0
    grad_shard_ = empty({chunk_}, options);
  }

  autograd::NoGradGuard no_grad;
  const int64_t begin = rank * chunk_, end = std::min(total_, begin + chunk_);
  std::vector<optim::ParamGroup> local(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    local[g].lr = groups[g].lr;
    local[g].weight_decay = groups[g].weight_decay;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t lo = std::max(begin, offset_[i]);
    const int64_t hi = std::min(end, offset_[i] + params_[i].numel());
    if (lo >= hi) continue;
    Piece piece{i, lo - offset_[i], lo - begin, hi - lo, Tensor()};
    piece.tensor = shard_.narrow(0, piece.shard_offset, piece.numel);
    local[group_of_[i]].params.push_back(piece.tensor);
    pieces_.push_back(std::move(piece));
  }
  if (!pieces_.empty()) local_ = make(std::move(local));
  LS_CHECK(pieces_.empty() || local_ != nullptr,
           "ZeroRedundancyOptimizer: the optimizer factory returned null");
  // The groups' lr and weight decay as the wrapped optimizer resolved them (its defaults where
  // the user left them unset), from rank 0, which always has pieces (its shard starts at 0).
  std::ostringstream text;
  if (local_) {
    for (const auto& g : local_->param_groups())
      text << exact(g.lr) << ' ' << exact(g.weight_decay) << ' ';
  }
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

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::step() {
  autograd::NoGradGuard no_grad;
  ++steps_;
  if (opts_.reduce_scatter_gradients) reduce_scatter_gradients();
  // The pieces start from the parameters' current values (a checkpoint or the user may have set
  // them) and see their slices of the averaged gradients.
  for (Piece& piece : pieces_) {
    const Tensor& p = params_[piece.param];
    piece.tensor.copy_(p.reshape({-1}).narrow(0, piece.param_offset, piece.numel));
    const Tensor g = p.grad();
    if (!g.defined()) {
      piece.tensor.set_grad(Tensor());
    } else if (opts_.reduce_scatter_gradients) {
      piece.tensor.set_grad(grad_shard_.narrow(0, piece.shard_offset, piece.numel));
    } else {
      piece.tensor.set_grad(g.reshape({-1}).narrow(0, piece.param_offset, piece.numel));
    }
  }
  if (local_) {
    // set_lr and schedules write the user's groups; the wrapped optimizer follows them.
    for (size_t g = 0; g < groups_.size(); ++g) {
      local_->param_groups()[g].lr = groups_[g].lr;
      local_->param_groups()[g].weight_decay = groups_[g].weight_decay;
    }
    local_->step();
  }
  pg_->all_gather(flat_, shard_)->wait();
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].reshape({-1}).copy_(flat_.narrow(0, offset_[i], params_[i].numel()));
  }
}

// Note [ZeRO-1], Reduce-scatter: every rank's local gradients, flat in the order of the shards,
// reduced so that rank r receives the average of shard r only. A parameter without a gradient
// contributes zeros (DDP gives every parameter one on every rank, or none on all).
void ZeroRedundancyOptimizer::reduce_scatter_gradients() {
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor region = grad_flat_.narrow(0, offset_[i], params_[i].numel());
    const Tensor g = params_[i].grad();
    if (g.defined()) {
      region.copy_(g.reshape({-1}));
    } else {
      region.zero_();
    }
  }
  pg_->reduce_scatter(grad_shard_, grad_flat_, {.op = ReduceOp::avg})->wait();
}

CommHook zero_hook() {
  return {"zero",
          [](ProcessGroup& pg, GradBucket& b) {
            // The reducer's elements follow the gradients: one status element, and in bucket 0
            // one time slot per rank (GradBucket, Note [Slow rank]).
            const int64_t extra = b.index == 0 ? 1 + pg.size() : 1;
            Tensor own = b.buffer.narrow(0, b.buffer.numel() - extra, extra);
            return pg.all_reduce(own, {.op = ReduceOp::avg});
          },
          nullptr};
}

ZeroStats ZeroRedundancyOptimizer::stats() const {
  ZeroStats s;
  s.total_elements = total_;
  s.shard_elements = chunk_;
  s.padding = chunk_ * pg_->size() - total_;
  if (local_) {
    size_t index = 0;
    std::string field;
    for (const auto& [name, t] : local_->state_dict()) {
      if (split_key(name, index, field)) s.state_bytes += t.nbytes();
    }
  }
  return s;
}

// Note [ZeRO-1], Checkpoints. The text each rank sends: "field <name> <dtype>" per per-element
// field, "has <param> <field>" per parameter that
// has it, "scalar <param> <field> <dtype> <value>" per piece scalar.
optim::NamedTensors ZeroRedundancyOptimizer::state_dict() const {
  autograd::NoGradGuard no_grad;
  std::ostringstream text;
  std::map<std::string, DType> fields;  // per-element fields here
  std::map<std::string, Tensor> local;
  if (local_) {
    for (const auto& [name, t] : local_->state_dict()) {
      size_t k = 0;
      std::string field;
      if (!split_key(name, k, field)) continue;  // "step", "group.<g>.lr": ours below
      LS_CHECK(k < pieces_.size(), "ZeroRedundancyOptimizer: the wrapped optimizer has state '",
               name, "' for piece ", k, " of ", pieces_.size());
      const Piece& piece = pieces_[k];
      if (t.dim() == 1 && t.numel() == piece.numel) {
        fields.emplace(field, t.dtype());
        text << "has " << piece.param << ' ' << field << '\n';
        local[name] = t;
      } else {
        LS_CHECK(t.numel() == 1, "ZeroRedundancyOptimizer: expected state '", name,
                 "' to be shaped like its piece (", piece.numel, ") or a scalar, got shape ",
                 t.shape().str());
        text << "scalar " << piece.param << ' ' << field << ' ' << static_cast<int>(t.dtype())
             << ' ' << exact(t.item()) << '\n';
      }
    }
  }
  for (const auto& [field, dtype] : fields) {
    text << "field " << field << ' ' << static_cast<int>(dtype) << '\n';
  }
  const std::string mine = text.str();
  const auto all = pg_->all_gather_object(Bytes(mine.begin(), mine.end()));

  // The step count and the groups' lr are the same on every rank: this rank's.
  optim::NamedTensors out;
  out.emplace_back("step", full({}, static_cast<double>(steps_), kInt64));
  for (size_t g = 0; g < groups_.size(); ++g)
    out.emplace_back("group." + std::to_string(g) + ".lr", full({}, groups_[g].lr, kFloat64));
  std::map<std::string, DType> all_fields;
  std::set<std::pair<size_t, std::string>> has;
  std::map<std::pair<size_t, std::string>, Tensor> scalars;
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream in(std::string(all[r].begin(), all[r].end()));
    std::string kind;
    while (in >> kind) {
      std::string name, value;
      int dtype = 0;
      size_t param = 0;
      if (kind == "field") {
        in >> name >> dtype;
        all_fields.emplace(name, static_cast<DType>(dtype));
      } else if (kind == "has") {
        in >> param >> name;
        has.emplace(param, name);
      } else {
        LS_CHECK(kind == "scalar", "ZeroRedundancyOptimizer: bad state line '", kind, "'");
        in >> param >> name >> dtype >> value;
        scalars.emplace(std::make_pair(param, name),
                        full({}, std::strtod(value.c_str(), nullptr), static_cast<DType>(dtype)));
      }
    }
  }
  std::map<std::pair<size_t, std::string>, Tensor> per_element;
  const auto device = params_[0].device();
  for (const auto& [field, dtype] : all_fields) {
    Tensor shard = zeros({chunk_}, TensorOptions(dtype).with_device(device));
    for (size_t k = 0; k < pieces_.size(); ++k) {
      auto it = local.find(std::to_string(k) + "." + field);
      if (it != local.end())
        shard.narrow(0, pieces_[k].shard_offset, pieces_[k].numel).copy_(it->second);
    }
    Tensor gathered = empty({chunk_ * pg_->size()}, TensorOptions(dtype).with_device(device));
    pg_->all_gather(gathered, shard)->wait();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!has.count({i, field})) continue;
      per_element[{i, field}] =
          gathered.narrow(0, offset_[i], params_[i].numel()).clone().view(params_[i].shape());
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
