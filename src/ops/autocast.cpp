// Autocast state (per thread), the cast policy table and the per-scope cast cache.
#include "lockstep/ops/autocast.h"

#include <atomic>
#include <unordered_map>
#include <utility>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"

namespace lockstep::amp {

namespace {

// Note [Autocast policy]
// The one table of which op runs in which precision (torch.autocast's CPU lists, cut to the ops
// lockstep has). Matrix products gain from low precision and accumulate in f32 inside the
// kernel; reductions, normalizations, softmax and losses need f32's mantissa. Everything else
// (elementwise ops, pooling, shape ops) follows its inputs: mixed dtypes promote to the widest.
struct PolicyEntry {
  std::string_view op;
  CastPolicy policy;
};
constexpr PolicyEntry kPolicyTable[] = {
    {"matmul", CastPolicy::kLowPrecision}, {"linear", CastPolicy::kLowPrecision},
    {"conv2d", CastPolicy::kLowPrecision}, {"softmax", CastPolicy::kFloat32},
    {"log_softmax", CastPolicy::kFloat32}, {"cross_entropy", CastPolicy::kFloat32},
    {"mse_loss", CastPolicy::kFloat32},    {"layer_norm", CastPolicy::kFloat32},
    {"batch_norm", CastPolicy::kFloat32},  {"sum", CastPolicy::kFloat32},
    {"mean", CastPolicy::kFloat32},        {"var", CastPolicy::kFloat32},
};

struct State {
  bool enabled = false;
  DType dtype = kBFloat16;
  int depth = 0;  // enabled scopes open; the cache lives while > 0
  // Parameter (leaf requiring grad) -> its low-precision copy, keyed by impl; the copy holds
  // the parameter alive through its graph, so the key stays valid while cached.
  std::unordered_map<const TensorImpl*, Tensor> cache;
  uint64_t cache_backward_epoch = 0;  // backward_epoch when the cache was filled
};

thread_local State tl_state;
// Bumped by every backward (any thread): a backward releases the graphs it ran through, cast
// nodes of cached copies included, so copies cached before it cannot serve a later forward.
std::atomic<uint64_t> backward_epoch{0};

}  // namespace

CastPolicy cast_policy(std::string_view op) {
  for (const auto& e : kPolicyTable) {
    if (e.op == op) return e.policy;
  }
  return CastPolicy::kPromote;
}

const char* policy_name(CastPolicy p) {
  switch (p) {
    case CastPolicy::kLowPrecision:
      return "low precision";
    case CastPolicy::kFloat32:
      return "f32";
    case CastPolicy::kPromote:
      return "promote";
  }
  return "?";
}

autocast::autocast(DType dtype, bool enabled)
    : prev_enabled_(tl_state.enabled), prev_dtype_(tl_state.dtype) {
  LS_CHECK(!enabled || dtype == kBFloat16 || dtype == kFloat16,
           "autocast: the low-precision dtype must be bf16 or f16, got ", dtype_name(dtype));
  tl_state.enabled = enabled;
  if (enabled) {
    // A nested scope with another dtype must not reuse the outer one's copies.
    if (tl_state.depth > 0 && dtype != tl_state.dtype) tl_state.cache.clear();
    tl_state.dtype = dtype;
    ++tl_state.depth;
  }
}

autocast::~autocast() {
  if (tl_state.enabled) {
    if (--tl_state.depth == 0) tl_state.cache.clear();  // the weights change at the next step
  }
  tl_state.enabled = prev_enabled_;
  if (tl_state.dtype != prev_dtype_) tl_state.cache.clear();
  tl_state.dtype = prev_dtype_;
}

bool is_autocast_enabled() { return tl_state.enabled; }
DType autocast_dtype() { return tl_state.dtype; }
int64_t autocast_cache_size() { return static_cast<int64_t>(tl_state.cache.size()); }

namespace detail {

Tensor autocast_arg(const Tensor& t, CastPolicy policy) {
  if (!tl_state.enabled || !t.defined() || !is_floating(t.dtype())) return t;
  switch (policy) {
    case CastPolicy::kPromote:
      return t;
    case CastPolicy::kFloat32:
      return is_half(t.dtype()) ? t.to(kFloat32) : t;
    case CastPolicy::kLowPrecision: {
      if (t.dtype() != kFloat32) return t;  // f64 stays f64 (as torch.autocast), halves as they are
      // Only parameters are cached, and only while recording: a copy made under NoGradGuard has
      // no graph and must not serve a later recorded forward in the same scope.
      if (!(t.is_leaf() && t.requires_grad() && autograd::grad_enabled())) {
        return t.to(tl_state.dtype);
      }
      const uint64_t epoch = backward_epoch.load(std::memory_order_relaxed);
      if (epoch != tl_state.cache_backward_epoch) {
        tl_state.cache.clear();
        tl_state.cache_backward_epoch = epoch;
      }
      auto it = tl_state.cache.find(t.impl());
      if (it != tl_state.cache.end()) return it->second;
      Tensor low = t.to(tl_state.dtype);
      tl_state.cache.emplace(t.impl(), low);
      return low;
    }
  }
  return t;
}

void note_backward() { backward_epoch.fetch_add(1, std::memory_order_relaxed); }

AutocastSuspend::AutocastSuspend() : prev_(tl_state.enabled) { tl_state.enabled = false; }
AutocastSuspend::~AutocastSuspend() { tl_state.enabled = prev_; }

}  // namespace detail

}  // namespace lockstep::amp
