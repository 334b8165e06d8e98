// Join: the per-step header, the shadow loop of a rank out of data, and the state sync at the end.
#include "lockstep/distributed/join.h"

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "distributed/data_parallel/reducer.h"
#include "lockstep/amp/grad_scaler.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/fsdp.h"
#include "lockstep/distributed/zero.h"
#include "lockstep/optim/optimizer.h"

namespace lockstep::dist {

namespace {

// A tiny serializer for broadcast_object: the optimizer's state (named tensors, which a rank that
// never stepped may not have yet) and the scaler's (named doubles).
void put_bytes(Bytes& out, const void* p, size_t n) {
  if (n == 0) return;
  const size_t at = out.size();
  out.resize(at + n);
  std::memcpy(out.data() + at, p, n);
}
template <typename T>
void put(Bytes& out, T v) {
  put_bytes(out, &v, sizeof v);
}
void put_string(Bytes& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  put_bytes(out, s.data(), s.size());
}

struct Reader {
  const Bytes& in;
  size_t at = 0;
  void get_bytes(void* p, size_t n) {
    LS_CHECK(at + n <= in.size(), "Join: truncated state from the source rank (", in.size(),
             " bytes, reading ", n, " at ", at, ")");
    std::memcpy(p, in.data() + at, n);
    at += n;
  }
  template <typename T>
  T get() {
    T v;
    get_bytes(&v, sizeof v);
    return v;
  }
  std::string get_string() {
    std::string s(get<uint64_t>(), '\0');
    get_bytes(s.data(), s.size());
    return s;
  }
};

Bytes pack(const optim::NamedTensors& tensors) {
  Bytes out;
  put<uint64_t>(out, tensors.size());
  for (const auto& [name, t] : tensors) {
    const Tensor c = t.to(Device()).contiguous();
    put_string(out, name);
    put<int32_t>(out, static_cast<int32_t>(c.dtype()));
    put<uint64_t>(out, static_cast<uint64_t>(c.shape().size()));
    for (int64_t d : c.shape()) put<int64_t>(out, d);
    put_bytes(out, c.data_ptr(), static_cast<size_t>(c.nbytes()));
  }
  return out;
}

optim::NamedTensors unpack(const Bytes& in) {
  Reader r{in};
  optim::NamedTensors out(r.get<uint64_t>());
  for (auto& [name, t] : out) {
    name = r.get_string();
    const auto dtype = static_cast<DType>(r.get<int32_t>());
    Dims shape;
    for (uint64_t n = r.get<uint64_t>(); n > 0; --n) shape.push_back(r.get<int64_t>());
    t = empty(shape, TensorOptions(dtype));
    r.get_bytes(t.data_ptr(), static_cast<size_t>(t.nbytes()));
  }
  return out;
}

Bytes pack(const std::map<std::string, double>& values) {
  Bytes out;
  put<uint64_t>(out, values.size());
  for (const auto& [name, v] : values) {
    put_string(out, name);
    put<double>(out, v);
  }
  return out;
}

std::map<std::string, double> unpack_doubles(const Bytes& in) {
  Reader r{in};
  std::map<std::string, double> out;
  for (uint64_t n = r.get<uint64_t>(); n > 0; --n) {
    std::string name = r.get_string();
    out[name] = r.get<double>();
  }
  return out;
}

// The path of the first module of type `type` in the tree ("" when none; "(root)" for m itself).
std::string find_module(const nn::Module& m, const std::string& type, const std::string& path) {
  if (m.type_name() == type) return path.empty() ? "(root)" : path;
  for (const auto& [name, child] : m.named_children()) {
    const std::string found = find_module(*child, type, path.empty() ? name : path + "." + name);
    if (!found.empty()) return found;
  }
  return "";
}

}  // namespace

namespace {

// Note [SyncBatchNorm]: its forward gathers every rank's statistics, which a rank out of data
// has none of; refused here rather than found as a hang in the last steps.
void refuse_sync_batchnorm(const nn::Module& model) {
  const std::string sync_bn = find_module(model, "SyncBatchNorm", "");
  LS_CHECK(sync_bn.empty(), "Join: the model has a SyncBatchNorm (", sync_bn,
           "), whose forward all-gathers the batch statistics of every rank; a rank out of data "
           "cannot take part, so uneven inputs need BatchNorm (per-rank statistics) instead");
}

}  // namespace

Join::Join(ParallelModule& model, JoinOptions opts) : opts_(std::move(opts)) {
  if (auto* ddp = dynamic_cast<DistributedDataParallel*>(&model)) {
    attach(*ddp);
  } else if (auto* fsdp = dynamic_cast<FullyShardedDataParallel*>(&model)) {
    attach(*fsdp);
  } else {
    LS_THROW("Join: expected a DistributedDataParallel or FullyShardedDataParallel model, got ",
             "another ParallelModule, whose collectives a joined rank cannot shadow");
  }
}

void Join::attach(DistributedDataParallel& ddp) {
  ddp_ = &ddp;
  LS_CHECK(ddp_->join_ == nullptr,
           "Join: this DistributedDataParallel is already inside a Join; finish() that one (or "
           "let it go out of scope) before starting another");
  refuse_sync_batchnorm(*ddp_->module_);
  zero_ = dynamic_cast<ZeroRedundancyOptimizer*>(opts_.optimizer);
  sharded_ = zero_;
  ddp_->join_ = this;
}

void Join::attach(FullyShardedDataParallel& fsdp) {
  fsdp_ = &fsdp;
  LS_CHECK(fsdp_->join_ == nullptr,
           "Join: this FullyShardedDataParallel is already inside a Join; finish() that one (or "
           "let it go out of scope) before starting another");
  refuse_sync_batchnorm(*fsdp_->module_);
  LS_CHECK(opts_.optimizer != nullptr &&
               FullyShardedDataParallel::local_optimizer(*opts_.optimizer) != nullptr,
           "Join: under FullyShardedDataParallel, JoinOptions::optimizer must be the optimizer "
           "wrap_optimizer() built: every rank steps its own shards, a rank out of data too "
           "(Note [Join and FSDP])");
  sharded_ = opts_.optimizer;
  fsdp_->join_ = this;
}

Join::~Join() {
  if (ddp_ != nullptr && ddp_->join_ == this) ddp_->join_ = nullptr;
  if (fsdp_ != nullptr && fsdp_->join_ == this) fsdp_->join_ = nullptr;
}

ProcessGroup& Join::pg() const { return ddp_ != nullptr ? *ddp_->pg_ : *fsdp_->pg_; }

nn::Module& Join::module() const { return ddp_ != nullptr ? *ddp_->module_ : *fsdp_->module_; }

Join::Header Join::exchange(bool active, bool synced) {
  ProcessGroup& pg = this->pg();
  const int world = pg.size();
  // On the model's device, so that a device backend can reduce it.
  const auto params = module().parameters();
  const Device device = params.empty() ? Device() : params[0].device();
  Tensor h = zeros({world + 1}, TensorOptions(kFloat32).with_device(device));
  {
    autograd::NoGradGuard no_grad;
    if (active) h.narrow(0, pg.rank(), 1).fill_(1.0);
    if (active && synced) h.narrow(0, world, 1).fill_(1.0);
  }
  pg.all_reduce(h)->wait();
  const std::vector<float> v = h.to(Device()).to_vector<float>();
  Header out;
  out.first_active = -1;
  for (int r = 0; r < world; ++r) {
    if (v[r] == 0.0f) continue;
    ++out.active;
    if (out.first_active < 0) out.first_active = r;
  }
  out.synced = static_cast<int>(v[world]);
  LS_CHECK(out.synced == 0 || out.synced == out.active, "Join: in one step ", out.synced,
           " of the ", out.active,
           " ranks with data synchronize gradients and the others are inside no_sync(); every "
           "rank must enter no_sync() for the same steps, around the forward as well as the "
           "backward");
  if (out.active > 0) last_first_active_ = out.first_active;
  if (active) ++taken_;
  return out;
}

void Join::finish() {
  LS_CHECK(!finished_,
           "Join: finish() was called twice; call it once, after this rank's last batch");
  finished_ = true;
  for (;;) {
    const Header h = exchange(false, false);
    if (h.active == 0) break;
    ++shadowed_;
    if (fsdp_ != nullptr) {
      // Note [Join and FSDP]: the model's own collectives, by running it.
      fsdp_->shadow(opts_.shadow_input, h.synced > 0, h.active);
      if (h.synced > 0) shadow_step();
      continue;
    }
    // The same collectives, in the same order, as DistributedDataParallel::forward and the
    // backward of the ranks with data (Note [Join]).
    ddp_->broadcast_buffers(h.first_active);
    if (h.synced > 0) {
      ddp_->reducer_->set_contributors(h.active);
      ddp_->reducer_->shadow_backward(/*expose_grads=*/zero_ != nullptr);
      if (zero_ != nullptr) shadow_step();
    }
  }
  if (ddp_ != nullptr) ddp_->join_ = nullptr;
  if (fsdp_ != nullptr) fsdp_->join_ = nullptr;
  sync_state(last_first_active_);
}

void Join::shadow_step() {
  if (opts_.step) {
    opts_.step();
  } else if (opts_.scaler != nullptr && opts_.scaler->is_enabled()) {
    opts_.scaler->step(*sharded_);
    opts_.scaler->update();
  } else {
    sharded_->step();
  }
  // This rank has no backward of its own to come in this Join: nothing may accumulate onto them.
  sharded_->zero_grad();
}

bool Join::next(bool have_batch) {
  if (have_batch) return true;
  finish();
  return false;
}

void Join::sync_state(int source) {
  ProcessGroup& pg = this->pg();
  if (pg.size() == 1) return;
  // Note [ZeRO-1], Overlap: the parameters the last step's all-gathers bring, before they are
  // read here.
  if (zero_ != nullptr) zero_->wait_parameters();
  std::vector<Tensor> state;
  // Under FSDP the parameters are each rank's shards, every one stepped where it lives.
  if (fsdp_ == nullptr)
    for (const auto& [name, t] : module().named_parameters()) state.push_back(t);
  for (const auto& [name, t] : module().named_buffers()) state.push_back(t);
  {
    autograd::NoGradGuard no_grad;
    if (!state.empty()) broadcast_tensors(pg, state, source);
  }
  const bool mine = pg.rank() == source;
  // Note [Join and ZeRO], Note [Join and FSDP]: every rank stepped its shard, and its state is
  // where it belongs; the groups' learning rates and weight decays are the source's, in case the
  // shadow step did not move a schedule as the ranks with data did.
  if (sharded_ != nullptr) {
    auto& groups = sharded_->param_groups();
    Tensor hyper = empty({static_cast<int64_t>(2 * groups.size())}, kFloat64);
    if (mine) {
      for (size_t i = 0; i < groups.size(); ++i) {
        hyper.narrow(0, static_cast<int64_t>(2 * i), 1).fill_(groups[i].lr);
        hyper.narrow(0, static_cast<int64_t>(2 * i + 1), 1).fill_(groups[i].weight_decay);
      }
    }
    // On the parameters' device, which a device backend can broadcast.
    const Device device =
        groups.empty() || groups[0].params.empty() ? Device() : groups[0].params[0].device();
    Tensor moved = hyper.to(device);
    if (!groups.empty()) pg.broadcast(moved, {.root = source})->wait();
    const std::vector<double> v = moved.to(Device()).to_vector<double>();
    for (size_t i = 0; i < groups.size(); ++i) {
      groups[i].lr = v[2 * i];
      groups[i].weight_decay = v[2 * i + 1];
    }
  }
  if (opts_.optimizer != nullptr && sharded_ == nullptr) {
    const Bytes b =
        pg.broadcast_object(mine ? pack(opts_.optimizer->state_dict()) : Bytes{}, source);
    if (!mine) opts_.optimizer->load_state_dict(unpack(b));
  }
  if (opts_.scaler != nullptr) {
    const Bytes b = pg.broadcast_object(mine ? pack(opts_.scaler->state_dict()) : Bytes{}, source);
    if (!mine) opts_.scaler->load_state_dict(unpack_doubles(b));
  }
}

}  // namespace lockstep::dist
