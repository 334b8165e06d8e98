// DistributedDataParallel: model check and broadcast at construction, buffers before forward.
// The communication hooks it calls are in comm_hook.cpp.
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/sync_check.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "distributed/data_parallel/reducer.h"
#include "distributed/object_text.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/cost_model.h"
#include "lockstep/distributed/gloo/process_group_gloo.h"
#include "lockstep/distributed/join.h"
#include "lockstep/optim/optimizer.h"

namespace lockstep::dist {

int64_t bucket_bytes_from_group(const ProcessGroup& pg) {
  const auto* gloo = dynamic_cast<const ProcessGroupGloo*>(&pg);
  if (gloo == nullptr) return kDefaultBucketBytes;
  return std::clamp(bucket_bytes_for(gloo->link(), gloo->size()), kDefaultFirstBucketBytes,
                    kDefaultBucketBytes);
}

std::string DDPStats::str() const {
  std::ostringstream os;
  int64_t total = 0;
  for (int64_t b : bucket_bytes) total += b;
  os << bucket_bytes.size() << " buckets (" << total / 1024 << " KiB:";
  for (size_t i = 0; i < bucket_bytes.size(); ++i) {
    os << " " << bucket_bytes[i] / 1024 << " KiB/" << bucket_params[i] << "p";
  }
  os << ")" << (buckets_rebuilt ? ", rebuilt in ready order" : "") << "; " << synced_steps
     << " synced steps, " << bytes_reduced_last_step / 1024 << " KiB reduced per step; exposed "
     << "communication " << exposed_comm_seconds_last * 1e3 << " ms last step, "
     << (synced_steps > 0 ? exposed_comm_seconds_total * 1e3 / synced_steps : 0.0)
     << " ms on average";
  if (slowest_rank >= 0) {
    // Note [Slow rank]
    os << "; slowest rank " << slowest_rank << ": " << std::fixed << std::setprecision(1)
       << slowest_rank_ms << " ms of compute last step, median " << median_rank_ms << " ms";
  }
  return os.str();
}

// ---- the model check ----

namespace {

// One line per parameter and buffer: "param<TAB>name<TAB>dtype<TAB>shape".
std::vector<std::string> signature(const nn::Module& m) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : m.named_parameters()) {
    lines.push_back(lockstep::detail::str_cat("parameter '", name, "' ", t.shape().str(), " ",
                                              dtype_name(t.dtype()),
                                              t.requires_grad() ? "" : " (no grad)"));
  }
  for (const auto& [name, t] : m.named_buffers()) {
    lines.push_back(lockstep::detail::str_cat("buffer '", name, "' ", t.shape().str(), " ",
                                              dtype_name(t.dtype())));
  }
  return lines;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : text) {
    if (c == '\n') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

}  // namespace

// Every rank gets every rank's signature, so every rank reaches the same verdict and the same
// message (no rank is left waiting in a later collective).
void check_same_model(ProcessGroup& pg, const nn::Module& m, std::string_view wrapper) {
  const auto all = all_gather_text(pg, join_lines(signature(m)));
  const auto ref = split_lines(all[0]);
  for (size_t r = 1; r < all.size(); ++r) {
    const auto other = split_lines(all[r]);
    const size_t n = std::max(ref.size(), other.size());
    for (size_t k = 0; k < n; ++k) {
      const std::string a = k < ref.size() ? ref[k] : "nothing";
      const std::string b = k < other.size() ? other[k] : "nothing";
      if (a != b) {
        LS_THROW(wrapper, ": ranks built different models: entry ", k, " is ", a,
                 " on rank 0 but ", b, " on rank ", r, " (rank 0 has ", ref.size(),
                 " parameters and buffers, rank ", r, " has ", other.size(),
                 "); every rank must construct the same model");
      }
    }
  }
}

// Broadcasts rank `root`'s values of `tensors`, one fused call per dtype.
void broadcast_tensors(ProcessGroup& pg, const std::vector<Tensor>& tensors, int root) {
  std::vector<std::vector<Tensor>> by_dtype;
  for (const Tensor& t : tensors) {
    auto it = std::find_if(by_dtype.begin(), by_dtype.end(),
                           [&](const auto& g) { return g[0].dtype() == t.dtype(); });
    if (it == by_dtype.end()) {
      by_dtype.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  for (auto& group : by_dtype) pg.broadcast(group, {.root = root})->wait();
}

// ---- DistributedDataParallel ----

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 ProcessGroupPtr pg, DDPOptions opts)
    : ParallelModule("DistributedDataParallel"),
      module_(std::move(module)),
      pg_(std::move(pg)),
      opts_(std::move(opts)) {
  LS_CHECK(module_ != nullptr, "DistributedDataParallel: no module given");
  LS_CHECK(opts_.check_sync_every >= 0,
           "DistributedDataParallel: DDPOptions::check_sync_every must be >= 0 (0: never), got ",
           opts_.check_sync_every);
  LS_CHECK(pg_ != nullptr,
           "DistributedDataParallel: no process group given (call "
           "init_process_group() and pass default_group())");
  register_module("module", module_);
  check_same_model(*pg_, *module_, "DistributedDataParallel");

  std::vector<Tensor> state;
  for (const auto& [name, t] : module_->named_parameters()) state.push_back(t);
  for (const auto& [name, t] : module_->named_buffers()) state.push_back(t);
  if (pg_->size() > 1 && !state.empty()) broadcast_tensors(*pg_, state, 0);

  std::vector<std::pair<std::string, Tensor>> params;
  for (const auto& [name, t] : module_->named_parameters()) {
    if (t.requires_grad()) params.emplace_back(name, t);
  }
  reducer_ = std::make_unique<Reducer>(std::move(params), pg_, opts_);
}

DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::broadcast_buffers(int root) {
  if (opts_.broadcast_buffers && pg_->size() > 1 && module_->is_training()) {
    const std::vector<Tensor> buffers = module_->buffers();
    if (!buffers.empty()) broadcast_tensors(*pg_, buffers, root);
  }
}

Tensor DistributedDataParallel::forward(const Tensor& x) {
  if (opts_.comm_hook.before_forward) opts_.comm_hook.before_forward();
  int buffer_root = 0;
  if (join_ != nullptr && autograd::grad_enabled() && module_->is_training()) {
    // Note [Join]: tell ranks that ran out of data what this step does.
    const Join::Header h = join_->exchange(true, !reducer_->no_sync());
    reducer_->set_contributors(h.active);
    buffer_root = h.first_active;
  }
  broadcast_buffers(buffer_root);
  if (opts_.check_sync_every > 0 && join_ == nullptr && autograd::grad_enabled() &&
      module_->is_training() && training_forwards_++ % opts_.check_sync_every == 0) {
    // After the buffers' broadcast: what it overwrote cannot be the divergence.
    check_in_sync(*module_, *pg_);
  }
  // Note [Slow rank]: after the collectives above, in which this rank may wait for a slow one.
  if (autograd::grad_enabled() && module_->is_training()) reducer_->start_step_clock();
  return (*module_)(x);  // with the model's forward hooks, as PyTorch's DDP calls it
}

bool DistributedDataParallel::set_no_sync(bool no_sync) {
  const bool previous = reducer_->no_sync();
  reducer_->set_no_sync(no_sync);
  return previous;
}

double DistributedDataParallel::clip_grad_norm(double max_norm) {
  if (opts_.comm_hook.clip_grad_norm) return opts_.comm_hook.clip_grad_norm(max_norm);
  return optim::clip_grad_norm(module_->parameters(), max_norm);
}

void DistributedDataParallel::gather_full_params() {
  if (opts_.comm_hook.before_forward) opts_.comm_hook.before_forward();
}

nn::NamedTensors DistributedDataParallel::full_state_dict() {
  gather_full_params();
  return module_->state_dict();
}

// After the hook's gathers landed, which would otherwise overwrite what is loaded.
void DistributedDataParallel::load_full_state_dict(const nn::NamedTensors& state) {
  gather_full_params();
  module_->load_state_dict(state);
}

DDPStats DistributedDataParallel::stats() const { return reducer_->stats(); }

void DistributedDataParallel::register_comm_hook(CommHook hook) {
  reducer_->set_comm_hook(hook);
  opts_.comm_hook = std::move(hook);
}

}  // namespace lockstep::dist
