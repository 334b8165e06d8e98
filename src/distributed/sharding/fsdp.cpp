// FullyShardedDataParallel: units, their flat shards, gathers around forward and backward, and
// the reduce-scatter of their gradients.
#include "lockstep/distributed/fsdp.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <unordered_map>

#include "distributed/data_parallel/join_rescale.h"
#include "distributed/data_parallel/reducer.h"
#include "distributed/sharding/fsdp_unit.h"
#include "distributed/sharding/grad_norm.h"
#include "lockstep/autograd/engine.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/join.h"
#include "lockstep/ops/reduce.h"

namespace lockstep::dist {

// Note [FSDP]
// A unit's parameters are laid out flat, in the module's order, and the flat run is padded with
// zeros to a multiple of the world size W: rank r owns elements [r S, (r + 1) S) of it, S =
// padded / W, as its master shard (the registered parameter the optimizer steps). Padding, never
// divisibility: any parameter count shards, the pad costs fewer than W elements per unit, and its
// gradient is a zero that stays zero.
//
// The parameters of the wrapped module keep their TensorImpls (so every layer's handle and every
// tensor autograd saved stays valid) but all of a unit's now view one storage: its gathered flat
// run. Between uses that storage holds no memory (StorageImpl::reset(0)); gathering takes a block
// again and all-gathers the shards into it, so views saved for the backward see the values the
// forward used. Reading a parameter while its unit is not gathered is an error naming FSDP
// (Tensor::data_ptr), never a read of freed memory.
//
// One step, unit by unit (Note [Forward hooks]: the unit's module is called, so its pre-hook and
// hook run):
// - forward pre-hook: wait for the unit's gather (started by the previous unit as a prefetch, or
//   now), start the next unit's;
// - forward hook: with reshard_after_forward free the gathered run (ZeRO-3); without, keep it
//   (ZeRO-2). The output is passed through an identity node whose backward runs before any of
//   the unit's own backward (everything the unit computed depends on its output): the pre-backward
//   hook, which gathers the unit again if needed and starts the previous unit's gather;
// - each parameter's post-accumulate-grad hook adds its gradient into the unit's flat full
//   gradient and drops .grad(); the unit's last one starts the reduce-scatter (avg) of the flat
//   gradient into the rank's gradient shard and frees the gathered run: the reduction overlaps
//   the backward of the units before it;
// - the root unit (the parameters of no unit: embeddings, a tied head, the final norm) is gathered
//   for the whole forward and backward; at the end of the backward (a queued callback) its
//   gradient is reduced, every reduction is waited for, and each shard's .grad() is set: the
//   average over ranks of the gradient of its elements.
// Every rank issues the same gathers and reductions in the same order because every rank runs the
// same graph (a unit unused on some rank but not others is not supported: its reduction would be
// issued at the end on one rank and during the backward on the other).
//
// Bitwise DDP. The forward and backward compute with the same full parameters as DDP; the
// reduce-scatter averages each element as DDP's all-reduce does on the backends that add in rank
// order (shm, Gloo; any backend at 2 ranks); an element-wise optimizer steps each element alike;
// clipping sums the norm exactly (Note [Exact norm]). So parameters and optimizer state equal
// DDP's bit for bit.
//
// Note [FSDP mixed precision]
// With param_dtype (bf16, say) a unit's run, which its parameters view, holds that dtype: the
// parameters' TensorImpls take it at construction, each gather casts the master shard (kept in the
// parameters' own dtype, f32) and all-gathers the cast (half the bytes, half the memory), and the
// layers compute in it (the forward's floating inputs are cast to it, as PyTorch's
// MixedPrecisionPolicy does). Gradients arrive in it; each unit's full gradient is summed and
// reduce-scattered in reduce_dtype (f32 by choice: a bf16 sum of N ranks loses bits that an f32
// one keeps; bf16 halves the reduction's bytes), and the shard's gradient is cast to the master's
// dtype, which the optimizer steps. full_state_dict() gathers the master shards, so checkpoints
// hold f32 values whatever the compute dtype.
//
// Note [FSDP units]
// The wrap policy is asked of submodules outermost first; an accepted module is one unit and its
// submodules are not asked, so units never nest. Units are ordered as their parameters are
// registered, which is the forward order of the models here (the prefetch guesses the next unit
// from it; a wrong guess costs a gather that waits, never a wrong value).
//
// Note [FSDP gradient accumulation]
// PyTorch's FSDP offers two: keep each rank's unsharded gradient across micro-batches and
// reduce-scatter once (no_sync: memory of the full gradient of the model, one reduction per
// step), or reduce-scatter every micro-batch and accumulate shards (1/W of the memory, W times
// the traffic). no_sync() here is the first: the full gradient of every unit is summed over the
// micro-batches exactly as DDP's no_sync sums .grad(), so the result is DDP's bitwise, and the
// communication is DDP's. A run that cannot hold one full gradient accumulates with a larger
// per-step batch instead.

namespace {

struct Impl {
  static const std::shared_ptr<TensorImpl>& of(const Tensor& t) { return t.impl_ptr(); }
};

// The most bytes the constructor's broadcast of rank 0's parameters packs at once.
constexpr int64_t kBroadcastBytes = int64_t{4} << 20;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The parameter elements a module holds (all of its parameters, recursively).
int64_t numel_of(const nn::Module& m) {
  int64_t n = 0;
  for (const Tensor& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace

namespace {

// Note [FSDP placeholder gradients]
// Once a parameter's gradient is in its unit's flat gradient, its .grad() becomes a tensor of
// its shape whose storage holds no memory. An optimizer built over the wrapped module's own
// parameters (the pitfall: it would see no gradient and silently step nothing) or
// optim::clip_grad_norm over them then fails at its first read with a message that says how to
// build the optimizer over the shards. The next forward drops the placeholders, so that the
// backward's AccumulateGrad starts from nothing.
Tensor placeholder_like(const Tensor& t) {
  auto storage = std::make_shared<StorageImpl>(nullptr, 0, t.device());
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), t.shape(),
                                             contiguous_strides(t.shape()), 0, t.dtype()));
}

}  // namespace

WrapPolicy wrap_by_type(std::vector<std::string> type_names) {
  return [names = std::move(type_names)](const std::string&, const nn::Module& m) {
    return std::find(names.begin(), names.end(), m.type_name()) != names.end();
  };
}

WrapPolicy wrap_by_size(int64_t min_params) {
  return [min_params](const std::string&, const nn::Module& m) {
    if (numel_of(m) < min_params) return false;
    for (const auto& [name, child] : m.named_children())
      if (numel_of(*child) >= min_params) return false;
    return true;
  };
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<nn::Module> module,
                                                   ProcessGroupPtr pg, FSDPOptions opts)
    : ParallelModule("FullyShardedDataParallel"),
      module_(std::move(module)),
      pg_(std::move(pg)),
      opts_(std::move(opts)) {
  LS_CHECK(module_ != nullptr, "FullyShardedDataParallel: expected a module, got null");
  LS_CHECK(pg_ != nullptr, "FullyShardedDataParallel: expected a process group, got null");
  LS_CHECK(opts_.comm_hook.start != nullptr, "FullyShardedDataParallel: FSDPOptions::comm_hook '",
           opts_.comm_hook.name,
           "' has no start(); give a sharding hook, as reduce_scatter_hook()");
  check_same_model(*pg_, *module_, "FullyShardedDataParallel");
  {
    autograd::NoGradGuard no_grad;
    // In pieces of at most kBroadcastBytes: one fused broadcast would pack a second copy of the
    // whole model, the memory FSDP is there to save.
    std::vector<Tensor> state;
    for (const auto& [name, t] : module_->named_parameters()) state.push_back(t);
    for (const auto& [name, t] : module_->named_buffers()) state.push_back(t);
    std::vector<Tensor> chunk;
    int64_t bytes = 0;
    for (size_t k = 0; k <= state.size() && pg_->size() > 1; ++k) {
      if (k == state.size() || (bytes > 0 && bytes + state[k].nbytes() > kBroadcastBytes)) {
        if (!chunk.empty()) broadcast_tensors(*pg_, chunk, 0);
        chunk.clear();
        bytes = 0;
      }
      if (k == state.size()) break;
      chunk.push_back(state[k]);
      bytes += state[k].nbytes();
    }
  }
  std::set<const TensorImpl*> seen;
  for (auto& [name, t] : module_->named_parameters()) {
    if (!seen.insert(t.impl()).second) continue;  // one tensor registered twice: shard it once
    LS_CHECK(t.is_contiguous() && t.offset() == 0 &&
                 t.storage()->nbytes() == static_cast<size_t>(t.nbytes()) && t.storage()->owned(),
             "FullyShardedDataParallel: expected parameters that own their memory, got '", name,
             "' (shape ", t.shape().str(), ") viewing a larger or borrowed storage");
    LS_CHECK(is_floating(t.dtype()),
             "FullyShardedDataParallel: expected floating parameters, got '", name, "' of ",
             dtype_name(t.dtype()));
    if (!params_.empty()) {
      const Tensor& first = params_[0].second;
      LS_CHECK(t.dtype() == first.dtype() && t.device() == first.device(),
               "FullyShardedDataParallel: expected one dtype and device for every parameter (",
               dtype_name(first.dtype()), " on ", first.device().str(), "), got '", name, "' of ",
               dtype_name(t.dtype()), " on ", t.device().str());
    }
    params_.emplace_back(name, t);
  }
  LS_CHECK(!params_.empty(), "FullyShardedDataParallel: the module has no parameters");
  build_units(opts_);
}

void FullyShardedDataParallel::build_units(const FSDPOptions& opts) {
  const WrapPolicy policy = opts.wrap ? opts.wrap : wrap_by_size(kDefaultMinUnitParams);
  std::unordered_map<const TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < params_.size(); ++i) index_of[params_[i].second.impl()] = i;
  unit_of_.assign(params_.size(), 0);
  offset_of_.assign(params_.size(), 0);

  units_.push_back(std::make_unique<Unit>());  // the root
  std::vector<bool> taken(params_.size(), false);
  std::function<void(const nn::Module&, const std::string&)> visit = [&](const nn::Module& m,
                                                                         const std::string& path) {
    for (const auto& [name, child] : m.named_children()) {
      const std::string child_path = path.empty() ? name : path + "." + name;
      if (!policy(child_path, *child)) {
        visit(*child, child_path);
        continue;
      }
      auto u = std::make_unique<Unit>();
      u->name = child_path;
      u->module = child.get();
      for (const Tensor& p : child->parameters()) {
        auto it = index_of.find(p.impl());
        if (it == index_of.end() || taken[it->second]) continue;
        taken[it->second] = true;
        u->params.push_back(it->second);
      }
      if (!u->params.empty()) units_.push_back(std::move(u));
    }
  };
  visit(*module_, "");
  for (size_t i = 0; i < params_.size(); ++i)
    if (!taken[i]) units_[0]->params.push_back(i);

  const int world = pg_->size(), rank = pg_->rank();
  pieces_.resize(params_.size());
  autograd::NoGradGuard no_grad;
  for (size_t k = 0; k < units_.size(); ++k) {
    Unit& u = *units_[k];
    u.index = static_cast<int>(k);
    if (u.params.empty()) continue;  // a root with nothing: no layout, no collectives
    const Tensor& first = params_[u.params[0]].second;
    u.dtype = first.dtype();
    u.compute = opts.param_dtype.value_or(u.dtype);
    u.reduce = opts.reduce_dtype.value_or(u.compute);
    for (size_t i : u.params) {
      unit_of_[i] = k;
      offset_of_[i] = u.numel;
      u.numel += params_[i].second.numel();
      if (params_[i].second.requires_grad()) ++u.grad_params;
    }
    u.padded = (u.numel + world - 1) / world * world;
    u.shard_numel = u.padded / world;
    Tensor flat = zeros({u.padded}, TensorOptions(u.dtype).with_device(first.device()));
    for (size_t i : u.params) {
      Tensor& p = params_[i].second;
      flat.narrow(0, offset_of_[i], p.numel()).copy_(p.reshape({-1}));
    }
    u.shard = flat.narrow(0, static_cast<int64_t>(rank) * u.shard_numel, u.shard_numel).clone();
    // The run the parameters view from now on, in the compute dtype (Note [FSDP mixed
    // precision]): each parameter's TensorImpl is re-pointed at it (Note [FSDP]) and its old
    // memory goes.
    Tensor run = u.compute == u.dtype
                     ? flat
                     : empty({u.padded}, TensorOptions(u.compute).with_device(first.device()));
    for (size_t i : u.params) {
      TensorImpl* impl = params_[i].second.impl();
      impl->storage_ = run.storage();
      impl->offset_ = offset_of_[i];
      impl->dtype_ = u.compute;
    }
    u.full = run.storage();
    u.full->reset(0);
    u.shard.requires_grad_(true);
    std::string pname = u.name.empty() ? "root" : u.name;
    std::replace(pname.begin(), pname.end(), '.', '_');
    register_parameter(pname + "_flat", u.shard);
    stats_.total_elements += u.numel;
    stats_.padded_elements += u.padded;
    stats_.shard_elements += u.shard_numel;
    stats_.shard_bytes += u.shard_numel * dtype_size(u.dtype);
    ++stats_.units;
    for (size_t i : u.params) {
      const Piece piece = piece_of(i, rank);
      pieces_[i] = u.shard.detach().narrow(0, piece.shard_at, piece.end - piece.begin);
      pieces_[i].requires_grad_(true);
    }
    if (u.module != nullptr) {
      Unit* up = &u;
      u.hook_ids.push_back(u.module->register_forward_pre_hook(
          [this, up](nn::Module&) { before_unit_forward(*up); }));
      u.hook_ids.push_back(u.module->register_forward_hook(
          [this, up](nn::Module&, const Tensor& out) { return after_unit_forward(*up, out); }));
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].second.requires_grad()) {
      grad_hooks_.push_back(-1);
      continue;
    }
    grad_hooks_.push_back(params_[i].second.register_post_accumulate_grad_hook(
        [this, i](Tensor& leaf) { on_param_grad(i, leaf); }));
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (auto& u : units_) {
    if (u->module != nullptr)
      for (int id : u->hook_ids) u->module->remove_forward_hook(id);
    try {
      if (u->gather) u->gather->wait();
      if (u->scatter) u->scatter->wait();
    } catch (const std::exception&) {
      // A failed collective was already reported where it was waited for; nothing to free here.
    }
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (grad_hooks_[i] >= 0) params_[i].second.remove_post_accumulate_grad_hook(grad_hooks_[i]);
}

FullyShardedDataParallel::Piece FullyShardedDataParallel::piece_of(size_t param, int rank) const {
  const Unit& u = *units_[unit_of_[param]];
  const int64_t lo = static_cast<int64_t>(rank) * u.shard_numel, hi = lo + u.shard_numel;
  const int64_t at = offset_of_[param], n = params_[param].second.numel();
  const int64_t b = std::clamp(lo - at, int64_t{0}, n), e = std::clamp(hi - at, int64_t{0}, n);
  Piece piece;
  piece.unit = unit_of_[param];
  piece.begin = b;
  piece.end = std::max(b, e);
  piece.shard_at = std::clamp(at + b - lo, int64_t{0}, u.shard_numel);
  return piece;
}

std::vector<std::string> FullyShardedDataParallel::unit_names() const {
  std::vector<std::string> names;
  for (const auto& u : units_)
    if (!u->params.empty()) names.push_back(u->name);
  return names;
}

// ---- gathering ----

void FullyShardedDataParallel::start_gather(Unit& u) {
  if (u.gathered || u.gather || u.params.empty()) return;
  AllocationScope scope("FSDP: a unit's gathered parameters");
  u.full->reset(static_cast<size_t>(u.bytes()));
  u.gather_input = u.compute == u.dtype ? u.shard.detach() : u.shard.detach().to(u.compute);
  u.gather = pg_->all_gather(u.full_flat(), u.gather_input);
  ++stats_.all_gathers;
  note_memory();
}

void FullyShardedDataParallel::wait_gather(Unit& u) {
  if (u.gathered || u.params.empty()) return;
  if (!u.gather) start_gather(u);
  const auto t0 = std::chrono::steady_clock::now();
  WorkPtr work = std::move(u.gather);
  u.gather = nullptr;
  work->wait();
  stats_.exposed_gather_seconds += seconds_since(t0);
  u.gather_input = Tensor();
  u.gathered = true;
}

void FullyShardedDataParallel::reshard(Unit& u) {
  if (u.params.empty() || summoned_) return;
  if (u.gather) {
    WorkPtr work = std::move(u.gather);
    u.gather = nullptr;
    work->wait();  // its output is the memory about to go
    u.gather_input = Tensor();
  }
  u.full->reset(0);
  u.gathered = false;
}

void FullyShardedDataParallel::note_memory() {
  int64_t gathered = 0, grads = 0;
  for (const auto& u : units_) {
    gathered += static_cast<int64_t>(u->full ? u->full->nbytes() : 0);
    if (u->grad_full.defined()) grads += u->grad_full.nbytes();
  }
  stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, gathered);
  stats_.peak_full_grad_bytes = std::max(stats_.peak_full_grad_bytes, grads);
}

// ---- forward ----

Tensor FullyShardedDataParallel::forward(const Tensor& x) {
  if (join_ != nullptr && autograd::grad_enabled() && module_->is_training()) {
    // Note [Join and FSDP]: tell ranks that ran out of data what this step does.
    contributors_ = join_->exchange(true, !no_sync_).active;
    join_input_ = x;
  }
  return run_forward(x);
}

Tensor FullyShardedDataParallel::run_forward(const Tensor& x) {
  // A forward whose graph got no backward leaves units gathered; the shards may have been
  // stepped since, so start from the shards again.
  if (!summoned_)
    for (auto& u : units_) reshard(*u);
  // Note [FSDP placeholder gradients]: this backward's AccumulateGrad starts from nothing.
  for (auto& [name, p] : params_)
    if (p.grad().defined() && p.grad().storage()->data() == nullptr) p.set_grad(Tensor());
  Unit& root = *units_[0];
  start_gather(root);
  if (opts_.prefetch && units_.size() > 1) start_gather(*units_[1]);
  wait_gather(root);
  // Note [FSDP mixed precision]: the layers see their parameters' dtype.
  const bool cast = opts_.param_dtype && is_floating(x.dtype()) && x.dtype() != *opts_.param_dtype;
  Tensor out = (*module_)(cast ? x.to(*opts_.param_dtype) : x);
  if (!autograd::grad_enabled() || !out.requires_grad())
    for (auto& u : units_) reshard(*u);  // no backward follows
  return out;
}

void FullyShardedDataParallel::before_unit_forward(Unit& u) {
  if (summoned_) return;
  wait_gather(u);
  const size_t next = static_cast<size_t>(u.index) + 1;
  if (opts_.prefetch && next < units_.size()) start_gather(*units_[next]);
}

Tensor FullyShardedDataParallel::after_unit_forward(Unit& u, const Tensor& out) {
  const bool backward_follows = autograd::grad_enabled() && out.requires_grad();
  if (!backward_follows || opts_.reshard_after_forward) reshard(u);
  if (!backward_follows) return out;
  Tensor y = out.detach();
  Unit* up = &u;
  autograd::record("FSDPPreBackward", {out}, y, [this, up](const autograd::TensorList& grads) {
    before_unit_backward(*up);
    return autograd::TensorList{grads[0]};
  });
  return y;
}

// ---- backward ----

void FullyShardedDataParallel::before_unit_backward(Unit& u) {
  if (!backward_queued_) {
    backward_queued_ = true;
    autograd::queue_callback([this] { finish_backward(); });
  }
  wait_gather(u);
  if (opts_.prefetch && u.index > 1) start_gather(*units_[static_cast<size_t>(u.index) - 1]);
}

void FullyShardedDataParallel::on_param_grad(size_t param, Tensor& leaf) {
  if (!backward_queued_) {
    backward_queued_ = true;
    autograd::queue_callback([this] { finish_backward(); });
  }
  Unit& u = *units_[unit_of_[param]];
  autograd::NoGradGuard no_grad;
  if (!u.grad_full.defined()) {
    AllocationScope scope("FSDP: a unit's full gradient");
    u.grad_full = zeros({u.padded}, TensorOptions(u.reduce).with_device(leaf.device()));
    note_memory();
  }
  if (u.pending < 0) u.pending = u.grad_params;
  const Tensor g = leaf.grad();
  // Summed as DDP's AccumulateGrad sums into its bucket views (Note [FSDP gradient accumulation]);
  // a shadow step's counts for nothing (Note [Join and FSDP]).
  if (!shadowing_) {
    u.grad_full.narrow(0, offset_of_[param], g.numel())
        .add_(g.dtype() == u.reduce ? g.reshape({-1}) : g.reshape({-1}).to(u.reduce));
  }
  // Note [FSDP placeholder gradients]: no memory, and loud when read.
  leaf.set_grad(placeholder_like(leaf));
  if (--u.pending > 0) return;
  u.pending = -1;
  if (!no_sync_) reduce_unit(u);
  if (u.module != nullptr) reshard(u);
}

void FullyShardedDataParallel::reduce_unit(Unit& u) {
  if (u.params.empty()) return;
  // One reduction in flight: the previous unit's completes (it overlapped this unit's backward)
  // and its full gradient goes before this one's shard is allocated, so the full gradients of
  // at most two units are alive at once.
  for (auto& other : units_)
    if (other->scatter) complete_scatter(*other);
  if (!u.grad_full.defined()) {  // no parameter of the unit got a gradient here: zeros
    u.grad_full = zeros({u.padded}, TensorOptions(u.reduce).with_device(u.shard.device()));
    note_memory();
  }
  // The last step's gradient shard, unless the optimizer still holds it, goes now.
  u.shard.set_grad(Tensor());
  for (size_t i : u.params) pieces_[i].set_grad(Tensor());
  AllocationScope scope("FSDP: a unit's gradient shard");
  // The unit is the comm hook's bucket (comm_hook.h): its full gradient in, this rank's shard of
  // the average out (made by the hook, under this allocation scope).
  u.bucket.index = u.index;
  if (u.bucket.parameters.empty()) {
    for (size_t i : u.params) {
      u.bucket.parameter_names.push_back(params_[i].first);
      u.bucket.parameters.push_back(params_[i].second);
    }
  }
  u.bucket.buffer = u.grad_full;
  u.bucket.numel = u.padded;
  u.bucket.contributors = contributors_ > 0 ? contributors_ : pg_->size();
  u.bucket.shard = Tensor();  // the hook's to make: one that does not shard leaves none
  u.scatter = opts_.comm_hook.start(*pg_, u.bucket);
  LS_CHECK(u.scatter != nullptr, "FullyShardedDataParallel: the comm hook '", opts_.comm_hook.name,
           "' returned no Work for unit ", u.index);
  u.reduced = true;
  ++stats_.reduce_scatters;
  // A backend that reduced on this thread (shm) is done already: the full gradient goes now.
  if (u.scatter->is_completed()) complete_scatter(u);
}

void FullyShardedDataParallel::complete_scatter(Unit& u) {
  WorkPtr work = std::move(u.scatter);
  u.scatter = nullptr;
  work->wait();
  if (opts_.comm_hook.finish) opts_.comm_hook.finish(u.bucket);
  u.grad_full = u.bucket.buffer = Tensor();  // the local sum has been reduced
  u.grad_shard = std::move(u.bucket.shard);
  u.bucket.shard = Tensor();
  LS_CHECK(u.grad_shard.defined() && u.grad_shard.numel() == u.shard_numel &&
               u.grad_shard.dtype() == u.reduce,
           "FullyShardedDataParallel: the comm hook '", opts_.comm_hook.name, "' left ",
           u.grad_shard.defined() ? std::to_string(u.grad_shard.numel()) + " elements of " +
                                        std::string(dtype_name(u.grad_shard.dtype()))
                                  : std::string("no tensor"),
           " in GradBucket::shard for unit ", u.index, ", expected this rank's ", u.shard_numel,
           " of ", dtype_name(u.reduce), ": FSDP needs a sharding hook, as reduce_scatter_hook()");
  // Note [Join and FSDP]: the average was over the world size; fewer ranks may have contributed.
  detail::rescale_to_contributors(u.grad_shard, contributors_, pg_->size());
  if (u.grad_shard.dtype() != u.dtype) u.grad_shard = u.grad_shard.to(u.dtype);  // the master's
  u.shard.set_grad(u.grad_shard);
  for (size_t i : u.params) {
    const Piece piece = piece_of(i, pg_->rank());
    pieces_[i].set_grad(u.grad_shard.narrow(0, piece.shard_at, piece.end - piece.begin));
  }
}

void FullyShardedDataParallel::finish_backward() {
  backward_queued_ = false;
  // Units whose gradients did not all arrive (a parameter unused in this graph, or the root):
  // in a fixed order, so every rank issues the same reductions.
  for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
    Unit& u = **it;
    if (!no_sync_ && u.grad_params > 0 && !u.reduced) reduce_unit(u);
    u.pending = -1;
  }
  stats_.grad_shard_bytes = 0;
  for (auto& u : units_) {
    if (u->scatter) complete_scatter(*u);
    if (u->grad_shard.defined()) stats_.grad_shard_bytes += u->grad_shard.nbytes();
    u->reduced = false;
    reshard(*u);
  }
  if (!no_sync_) contributors_ = 0;
}

void FullyShardedDataParallel::shadow(const Tensor& input, bool synced, int active) {
  const Tensor& x = input.defined() ? input : join_input_;
  LS_CHECK(x.defined(), "Join: rank ", pg_->rank(),
           " ran out of data before its first batch; under FullyShardedDataParallel it runs the "
           "model to take part in the other ranks' gathers and reductions (Note [Join and FSDP]): "
           "give JoinOptions::shadow_input, an input of the model's shape");
  std::optional<NoSync> accumulating;
  if (!synced) accumulating.emplace(*this);
  contributors_ = synced ? active : 0;
  autograd::EnableGradGuard grad;
  shadowing_ = true;
  try {
    sum(run_forward(x)).backward();
  } catch (...) {
    shadowing_ = false;
    throw;
  }
  shadowing_ = false;
}

bool FullyShardedDataParallel::set_no_sync(bool no_sync) {
  const bool previous = no_sync_;
  no_sync_ = no_sync;
  return previous;
}

// ---- the optimizer's view ----

std::vector<optim::ParamGroup> FullyShardedDataParallel::shard_groups(
    const std::vector<optim::ParamGroup>& groups) const {
  std::unordered_map<const TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < params_.size(); ++i) index_of[params_[i].second.impl()] = i;
  std::vector<optim::ParamGroup> out;
  std::vector<bool> used(params_.size(), false);
  for (const auto& g : groups) {
    optim::ParamGroup sharded{{}, g.lr, g.weight_decay};
    for (const Tensor& p : g.params) {
      auto it = index_of.find(p.impl());
      LS_CHECK(it != index_of.end(),
               "FullyShardedDataParallel::shard_groups: expected parameters of the wrapped module, "
               "got a tensor of shape ",
               p.shape().str(), " that is not one");
      LS_CHECK(!used[it->second], "FullyShardedDataParallel::shard_groups: parameter '",
               params_[it->second].first, "' is in more than one group");
      used[it->second] = true;
      sharded.params.push_back(pieces_[it->second]);
    }
    out.push_back(std::move(sharded));
  }
  return out;
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm) {
  LS_CHECK(max_norm >= 0, "clip_grad_norm: max_norm must be >= 0, got ", max_norm);
  std::vector<Tensor> shards;
  for (const auto& u : units_)
    if (u->grad_shard.defined()) shards.push_back(u->grad_shard);
  return optim::scale_to_max_norm(shards, sharded_grad_norm(*pg_, shards), max_norm);
}

// ---- full parameters ----

void FullyShardedDataParallel::gather_full_params() {
  LS_CHECK(!summoned_, "summon_full_params: already inside a summon_full_params scope");
  for (auto& u : units_) start_gather(*u);
  for (auto& u : units_) wait_gather(*u);
  summoned_ = true;
}

void FullyShardedDataParallel::release_full_params() noexcept {
  summoned_ = false;
  try {
    for (auto& u : units_) reshard(*u);
  } catch (const std::exception&) {
    // reshard waits only for gathers that gather_full_params() already waited for.
  }
}

FSDPStats FullyShardedDataParallel::stats() const { return stats_; }

}  // namespace lockstep::dist
