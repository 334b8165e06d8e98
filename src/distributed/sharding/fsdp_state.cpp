// FullyShardedDataParallel's state in the full format: the wrapped module's state_dict and the
// optimizer's, as a run without sharding would save them (so checkpoints move between layouts).
#include <map>
#include <unordered_map>

#include "distributed/object_text.h"
#include "distributed/sharding/fsdp_unit.h"
#include "distributed/sharding/state_key.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/fsdp.h"

namespace lockstep::dist {

nn::NamedTensors FullyShardedDataParallel::full_state_dict() {
  // Unit by unit, from the master shards (not the gathered runs, which may hold a lower compute
  // dtype: Note [FSDP mixed precision]): what is gathered at once is one unit beside the copies.
  autograd::NoGradGuard no_grad;
  std::unordered_map<const TensorImpl*, Tensor> copies;
  for (auto& unit : units_) {
    Unit& u = *unit;
    if (u.params.empty()) continue;
    Tensor whole = empty({u.padded}, TensorOptions(u.dtype).with_device(u.shard.device()));
    pg_->all_gather(whole, u.shard.detach())->synchronize();
    for (size_t i : u.params) {
      const Tensor& p = params_[i].second;
      copies[p.impl()] = whole.narrow(0, offset_of_[i], p.numel()).reshape(p.shape()).clone();
    }
  }
  nn::NamedTensors state = module_->state_dict();  // handles only: nothing is read here
  for (auto& [name, t] : state) {
    auto it = copies.find(t.impl());
    t = it != copies.end() ? it->second : t.clone();  // a buffer
  }
  return state;
}

void FullyShardedDataParallel::load_full_state_dict(const nn::NamedTensors& state) {
  autograd::NoGradGuard no_grad;
  std::unordered_map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : state) by_name[name] = &t;
  const nn::NamedTensors mine = module_->named_parameters();
  size_t used = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    auto it = by_name.find(name);
    LS_CHECK(it != by_name.end(), "FullyShardedDataParallel::load_full_state_dict: parameter '",
             name, "' is missing from the state");
    const Tensor& t = *it->second;
    LS_CHECK(t.shape() == p.shape(), "FullyShardedDataParallel::load_full_state_dict: '", name,
             "' has shape ", t.shape().str(), " in the state, expected ", p.shape().str());
    const Piece piece = piece_of(i, pg_->rank());
    Unit& u = *units_[piece.unit];
    u.shard.detach()
        .narrow(0, piece.shard_at, piece.end - piece.begin)
        .copy_(t.reshape({-1}).narrow(0, piece.begin, piece.end - piece.begin));
    ++used;
  }
  for (const auto& [name, b] : module_->named_buffers()) {
    auto it = by_name.find(name);
    if (it == by_name.end()) continue;  // non-persistent buffers are not saved
    LS_CHECK(it->second->shape() == b.shape(), "FullyShardedDataParallel::load_full_state_dict: '",
             name, "' has shape ", it->second->shape().str(), " in the state, expected ",
             b.shape().str());
    Tensor(b).copy_(*it->second);
    ++used;
  }
  LS_CHECK(used == state.size(), "FullyShardedDataParallel::load_full_state_dict: the state has ",
           state.size() - used, " entries the wrapped module does not have");
  for (auto& u : units_) reshard(*u);  // gathered copies would be stale
}

// Note [FSDP optimizer state]
// The wrapped optimizer steps one piece per parameter (shard_groups), so its state is per piece:
// "<k>.<field>" with the piece's 1-D shape, k counting the user's parameters in group order.
// state_dict() rebuilds each per-element field of each unit whole: every rank copies its pieces'
// state into a shard-sized buffer, one all_gather per (unit, field) lays the ranks' shards side by
// side as the parameters are, and each parameter's run is cut out in its shape: the plain
// optimizer's format over the wrapped module's parameters. Scalars (AdamW's per-parameter step)
// are the same on every rank, since every piece steps every step (an empty one too).
// load_state_dict() takes this rank's pieces of such a state, from any run.
class FullyShardedDataParallel::Optim final : public optim::Optimizer {
 public:
  Optim(FullyShardedDataParallel& fsdp, std::vector<optim::ParamGroup> shard_groups,
        std::unique_ptr<optim::Optimizer> inner, std::vector<size_t> param_of)
      : Optimizer(shard_groups, 0.0, 0.0, "FSDP optimizer"),
        fsdp_(fsdp),
        inner_(std::move(inner)),
        param_of_(std::move(param_of)) {
    LS_CHECK(inner_ != nullptr, "FullyShardedDataParallel::wrap_optimizer: the factory gave null");
    LS_CHECK(inner_->param_groups().size() == groups_.size(),
             "FullyShardedDataParallel::wrap_optimizer: the factory's optimizer has ",
             inner_->param_groups().size(), " groups, expected the ", groups_.size(), " given");
    for (size_t g = 0; g < groups_.size(); ++g) {
      groups_[g].lr = inner_->param_groups()[g].lr;
      groups_[g].weight_decay = inner_->param_groups()[g].weight_decay;
    }
  }

  void step() override {
    // The shards change: copies gathered from them are stale.
    for (auto& u : fsdp_.units_) fsdp_.reshard(*u);
    for (size_t g = 0; g < groups_.size(); ++g) {
      inner_->param_groups()[g].lr = groups_[g].lr;
      inner_->param_groups()[g].weight_decay = groups_[g].weight_decay;
    }
    inner_->step();
    ++steps_;
  }

  optim::NamedTensors state_dict() const override;
  void load_state_dict(const optim::NamedTensors& state) override;

  std::vector<Tensor> step_gradients() override { return inner_->step_gradients(); }
  bool agree_found_inf(bool found) override {
    Tensor flag = full({1}, found ? 1.0 : 0.0, kFloat64);
    fsdp_.pg_->all_reduce_host(flag, {.op = ReduceOp::max});
    return flag.item() > 0;
  }

 protected:
  std::vector<std::string> state_fields() const override { return {}; }

 private:
  friend class FullyShardedDataParallel;
  static bool is_scalar(const std::string& field, const Tensor& t) {
    return field == "step" || t.dim() == 0;
  }

  FullyShardedDataParallel& fsdp_;
  std::unique_ptr<optim::Optimizer> inner_;
  std::vector<size_t> param_of_;  // the wrapped module's parameter of each optimizer index
};

optim::NamedTensors FullyShardedDataParallel::Optim::state_dict() const {
  autograd::NoGradGuard no_grad;
  const optim::NamedTensors local = inner_->state_dict();
  // The per-element fields, their dtypes, and which optimizer indices have them.
  std::map<std::string, DType> fields;
  std::map<std::pair<size_t, std::string>, const Tensor*> entry;
  for (const auto& [name, t] : local) {
    size_t k = 0;
    std::string field;
    if (!detail::split_key(name, k, field) || is_scalar(field, t)) continue;
    fields.emplace(field, t.dtype());
    entry[{k, field}] = &t;
  }
  std::string signature;
  for (const auto& [field, dtype] : fields)
    signature += field + ":" + std::string(dtype_name(dtype)) + ";";
  for (const auto& [key, t] : entry) signature += std::to_string(key.first) + key.second + ",";
  const auto all = all_gather_text(*fsdp_.pg_, signature);
  for (size_t r = 1; r < all.size(); ++r)
    LS_CHECK(all[r] == all[0], "FSDP optimizer state_dict: rank ", r,
             " holds other state fields than rank 0 (did every rank step the same parameters?)");

  std::vector<size_t> index_of(fsdp_.params_.size(), SIZE_MAX);
  for (size_t k = 0; k < param_of_.size(); ++k) index_of[param_of_[k]] = k;
  std::map<std::pair<size_t, std::string>, Tensor> whole;
  const int rank = fsdp_.pg_->rank();
  for (const auto& unit : fsdp_.units_) {
    const Unit& u = *unit;
    if (u.params.empty()) continue;
    for (const auto& [field, dtype] : fields) {
      const TensorOptions opts = TensorOptions(dtype).with_device(u.shard.device());
      Tensor buf = zeros({u.shard_numel}, opts);
      bool any = false;
      for (size_t i : u.params) {
        const size_t k = index_of[i];
        auto it = entry.find({k, field});
        if (k == SIZE_MAX || it == entry.end()) continue;
        any = true;
        const Piece piece = fsdp_.piece_of(i, rank);
        buf.narrow(0, piece.shard_at, piece.end - piece.begin).copy_(it->second->reshape({-1}));
      }
      if (!any) continue;  // the same on every rank (the signature above)
      Tensor gathered = empty({u.padded}, opts);
      fsdp_.pg_->all_gather(gathered, buf)->synchronize();
      for (size_t i : u.params) {
        const size_t k = index_of[i];
        if (k == SIZE_MAX || !entry.count({k, field})) continue;
        const Tensor& p = fsdp_.params_[i].second;
        whole[{k, field}] =
            gathered.narrow(0, fsdp_.offset_of_[i], p.numel()).reshape(p.shape()).clone();
      }
    }
  }
  optim::NamedTensors out;
  for (const auto& [name, t] : local) {
    size_t k = 0;
    std::string field;
    if (detail::split_key(name, k, field) && !is_scalar(field, t)) {
      out.emplace_back(name, whole.at({k, field}));
    } else if (name == "step") {
      out.emplace_back(name, full({}, static_cast<double>(steps_), kInt64));
    } else if (name.rfind("group.", 0) == 0) {
      // The schedule writes this wrapper's groups; the inner ones follow at the next step().
      const size_t g = std::stoul(name.substr(6, name.find('.', 6) - 6));
      out.emplace_back(name, full({}, groups_.at(g).lr, kFloat64));
    } else {
      out.emplace_back(name, t);
    }
  }
  return out;
}

void FullyShardedDataParallel::Optim::load_state_dict(const optim::NamedTensors& state) {
  autograd::NoGradGuard no_grad;
  optim::NamedTensors mine;
  for (const auto& [name, t] : state) {
    size_t k = 0;
    std::string field;
    if (!detail::split_key(name, k, field) || is_scalar(field, t)) {
      if (name == "step") steps_ = static_cast<int64_t>(t.item());
      mine.emplace_back(name, t);
      continue;
    }
    LS_CHECK(k < param_of_.size(), "FSDP optimizer load_state_dict: state for parameter ", k,
             " but the optimizer has ", param_of_.size(), " parameters");
    const size_t i = param_of_[k];
    const Tensor& p = fsdp_.params_[i].second;
    LS_CHECK(t.shape() == p.shape(), "FSDP optimizer load_state_dict: '", name, "' has shape ",
             t.shape().str(), ", expected the parameter's ", p.shape().str(), " ('",
             fsdp_.params_[i].first, "')");
    const Piece piece = fsdp_.piece_of(i, fsdp_.pg_->rank());
    mine.emplace_back(
        name,
        t.reshape({-1}).narrow(0, piece.begin, piece.end - piece.begin).to(p.device()).clone());
  }
  inner_->load_state_dict(mine);
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].lr = inner_->param_groups()[g].lr;
}

// Note [FSDP sharded checkpoint]
// A piece of a parameter is a run of its flattened elements, which is what a slice of a sharded
// checkpoint is: each rank writes the pieces it holds of the parameters and of the optimizer's
// per-element fields (AdamW's moments), rank 0 the rest whole (buffers, per-parameter step counts,
// which every rank holds alike, the global step and the groups' learning rates). On load each
// rank asks for its own pieces at its own layout, whatever layout wrote them; names are those of
// an ordinary checkpoint ("model.<name>", "optim.<name>.<field>"), so `lockstep checkpoint
// consolidate` writes one that any run loads.
std::vector<io::TensorSlice> FullyShardedDataParallel::state_slices(
    const optim::Optimizer* opt) const {
  autograd::NoGradGuard no_grad;
  const int rank = pg_->rank();
  std::vector<io::TensorSlice> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    const Piece piece = piece_of(i, rank);
    if (piece.end == piece.begin) continue;
    out.push_back(
        {"model." + name, p.shape(), piece.begin,
         units_[piece.unit]->shard.detach().narrow(0, piece.shard_at, piece.end - piece.begin)});
  }
  if (rank == 0) {
    for (const auto& [name, b] : module_->state_dict()) {
      bool is_param = false;
      for (const auto& [pname, p] : params_) is_param = is_param || pname == name;
      if (!is_param) out.push_back({"model." + name, b.shape(), 0, b});
    }
  }
  if (opt == nullptr) return out;
  const auto* wrapped = dynamic_cast<const Optim*>(opt);
  LS_CHECK(wrapped != nullptr,
           "FullyShardedDataParallel::state_slices: expected the optimizer wrap_optimizer() "
           "built, got another");
  for (const auto& [key, t] : wrapped->inner_->state_dict()) {
    size_t k = 0;
    std::string field;
    if (!detail::split_key(key, k, field)) {
      if (key == "step") {
        if (rank == 0)
          out.push_back(
              {"optim.step", {}, 0, full({}, static_cast<double>(wrapped->steps_), kInt64)});
      } else if (key.rfind("group.", 0) == 0) {
        const size_t g = std::stoul(key.substr(6, key.find('.', 6) - 6));
        if (rank == 0)
          out.push_back({"optim." + key, {}, 0, full({}, wrapped->groups_.at(g).lr, kFloat64)});
      }
      continue;
    }
    const size_t i = wrapped->param_of_.at(k);
    const std::string name = "optim." + params_[i].first + "." + field;
    if (Optim::is_scalar(field, t)) {
      if (rank == 0) out.push_back({name, t.shape(), 0, t});
      continue;
    }
    const Piece piece = piece_of(i, rank);
    if (piece.end > piece.begin)
      out.push_back({name, params_[i].second.shape(), piece.begin, t.reshape({-1})});
  }
  return out;
}

std::vector<io::SliceRequest> FullyShardedDataParallel::state_requests(
    const std::vector<std::string>& available, const optim::Optimizer* opt) const {
  const int rank = pg_->rank();
  std::unordered_map<std::string, size_t> param_named;
  for (size_t i = 0; i < params_.size(); ++i) param_named["model." + params_[i].first] = i;
  std::vector<io::SliceRequest> out;
  for (const std::string& name : available) {
    if (name.rfind("model.", 0) == 0) {
      auto it = param_named.find(name);
      if (it == param_named.end()) {
        out.push_back({name, 0, -1});  // a buffer (or unknown: load_state_slices names it)
        continue;
      }
      const Piece piece = piece_of(it->second, rank);
      if (piece.end > piece.begin) out.push_back({name, piece.begin, piece.end - piece.begin});
      continue;
    }
    if (opt == nullptr || name.rfind("optim.", 0) != 0) continue;
    // "optim.<param>.<field>": the longest parameter name that prefixes it.
    size_t best = SIZE_MAX, best_len = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const std::string prefix = "optim." + params_[i].first + ".";
      if (name.rfind(prefix, 0) == 0 && prefix.size() > best_len) {
        best = i;
        best_len = prefix.size();
      }
    }
    const std::string field = best == SIZE_MAX ? "" : name.substr(best_len);
    if (best == SIZE_MAX || field == "step") {
      out.push_back({name, 0, -1});  // "optim.step", a group's lr, a step count
      continue;
    }
    const Piece piece = piece_of(best, rank);
    if (piece.end > piece.begin) out.push_back({name, piece.begin, piece.end - piece.begin});
  }
  return out;
}

void FullyShardedDataParallel::load_state_slices(const std::vector<io::TensorSlice>& slices,
                                                 optim::Optimizer* opt) {
  autograd::NoGradGuard no_grad;
  const int rank = pg_->rank();
  std::unordered_map<std::string, const io::TensorSlice*> by_name;
  for (const auto& s : slices) by_name[s.name] = &s;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    const Piece piece = piece_of(i, rank);
    if (piece.end == piece.begin) continue;  // none of it is this rank's
    auto it = by_name.find("model." + name);
    LS_CHECK(it != by_name.end(),
             "FullyShardedDataParallel::load_state_slices: the checkpoint "
             "has no parameter 'model.",
             name, "'");
    const io::TensorSlice& s = *it->second;
    LS_CHECK(
        s.shape == p.shape() && s.start == piece.begin && s.data.numel() == piece.end - piece.begin,
        "FullyShardedDataParallel::load_state_slices: 'model.", name, "' is ", s.shape.str(),
        " from element ", s.start, " (", s.data.numel(), " elements) in the checkpoint, expected ",
        p.shape().str(), " from ", piece.begin, " (", piece.end - piece.begin, ")");
    units_[piece.unit]
        ->shard.detach()
        .narrow(0, piece.shard_at, piece.end - piece.begin)
        .copy_(s.data.reshape({-1}));
  }
  for (const auto& [name, b] : module_->named_buffers()) {
    auto it = by_name.find("model." + name);
    if (it == by_name.end()) continue;  // non-persistent
    LS_CHECK(it->second->shape == b.shape(), "FullyShardedDataParallel::load_state_slices: '",
             "model.", name, "' has shape ", it->second->shape.str(), ", expected ",
             b.shape().str());
    Tensor(b).copy_(it->second->data.reshape(b.shape()));
  }
  for (auto& u : units_) reshard(*u);
  if (opt == nullptr) return;
  auto* wrapped = dynamic_cast<Optim*>(opt);
  LS_CHECK(wrapped != nullptr,
           "FullyShardedDataParallel::load_state_slices: expected the optimizer wrap_optimizer() "
           "built, got another");
  // The inner optimizer's own format: "<k>.<field>" over the pieces.
  std::vector<size_t> index_of(params_.size(), SIZE_MAX);
  for (size_t k = 0; k < wrapped->param_of_.size(); ++k) index_of[wrapped->param_of_[k]] = k;
  optim::NamedTensors inner;
  for (const auto& s : slices) {
    if (s.name.rfind("optim.", 0) != 0) continue;
    const std::string rest = s.name.substr(6);
    if (rest == "step" || rest.rfind("group.", 0) == 0) {
      inner.emplace_back(rest, s.data.reshape(s.shape));
      continue;
    }
    size_t best = SIZE_MAX, best_len = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const std::string prefix = params_[i].first + ".";
      if (rest.rfind(prefix, 0) == 0 && prefix.size() > best_len) {
        best = i;
        best_len = prefix.size();
      }
    }
    LS_CHECK(best != SIZE_MAX && index_of[best] != SIZE_MAX,
             "FullyShardedDataParallel::load_state_slices: '", s.name,
             "' names no parameter of the optimizer");
    const std::string field = rest.substr(best_len);
    const Tensor value = field == "step" ? s.data.reshape(s.shape) : s.data.reshape({-1});
    inner.emplace_back(std::to_string(index_of[best]) + "." + field, value);
  }
  wrapped->inner_->load_state_dict(inner);
  for (size_t g = 0; g < wrapped->groups_.size(); ++g)
    wrapped->groups_[g].lr = wrapped->inner_->param_groups()[g].lr;
  for (const auto& [name, t] : inner)
    if (name == "step") wrapped->steps_ = static_cast<int64_t>(t.item());
}

const optim::Optimizer* FullyShardedDataParallel::local_optimizer(const optim::Optimizer& opt) {
  const auto* wrapped = dynamic_cast<const Optim*>(&opt);
  return wrapped ? wrapped->inner_.get() : nullptr;
}

std::unique_ptr<optim::Optimizer> FullyShardedDataParallel::wrap_optimizer(
    const std::vector<optim::ParamGroup>& groups,
    const std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>& make) {
  LS_CHECK(make != nullptr, "FullyShardedDataParallel::wrap_optimizer: expected a factory");
  std::unordered_map<const TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < params_.size(); ++i) index_of[params_[i].second.impl()] = i;
  std::vector<size_t> param_of;
  for (const auto& g : groups)
    for (const Tensor& p : g.params) {
      auto it = index_of.find(p.impl());
      param_of.push_back(it == index_of.end() ? SIZE_MAX : it->second);
    }
  std::vector<optim::ParamGroup> sharded = shard_groups(groups);  // checks every parameter
  auto inner = make(sharded);
  return std::make_unique<Optim>(*this, std::move(sharded), std::move(inner), std::move(param_of));
}

}  // namespace lockstep::dist
