// GradScaler: dynamic loss scaling.
#include "lockstep/amp/grad_scaler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/reduce.h"
#include "ops/kernels.h"
#include "tensor/parallel.h"

namespace lockstep::amp {

namespace {

// g *= inv in place; whether any element is inf or NaN. One pass for contiguous f32/f64 (the
// master gradients); other layouts and dtypes take the op path.
template <typename T>
bool unscale_contiguous(T* p, int64_t n, double inv) {
  std::atomic<bool> bad{false};
  const T f = static_cast<T>(inv);
  cpu::parallel_for(0, n, cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
    bool local = false;
    for (int64_t i = b; i < e; ++i) {
      const T v = p[i] * f;
      p[i] = v;
      local |= !std::isfinite(v);
    }
    if (local) bad.store(true, std::memory_order_relaxed);
  });
  return bad.load();
}

bool unscale_and_check(Tensor& g, double inv) {
  if (g.is_contiguous() && g.dtype() == kFloat32) {
    return unscale_contiguous(g.data<float>(), g.numel(), inv);
  }
  if (g.is_contiguous() && g.dtype() == kFloat64) {
    return unscale_contiguous(g.data<double>(), g.numel(), inv);
  }
  g.mul_(inv);
  // Non-finite anywhere: the sum of the absolute values is inf or NaN.
  return !std::isfinite(sum(abs(g.to(kFloat64))).item());
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions opts) : opts_(opts), scale_(opts.init_scale) {
  LS_CHECK(opts.init_scale > 0 && std::isfinite(opts.init_scale),
           "GradScaler: init_scale must be positive and finite, got ", opts.init_scale);
  LS_CHECK(opts.growth_factor > 1.0, "GradScaler: growth_factor must be > 1, got ",
           opts.growth_factor);
  LS_CHECK(opts.backoff_factor > 0.0 && opts.backoff_factor < 1.0,
           "GradScaler: backoff_factor must be in (0, 1), got ", opts.backoff_factor);
  LS_CHECK(opts.growth_interval >= 1, "GradScaler: growth_interval must be >= 1, got ",
           opts.growth_interval);
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!opts_.enabled) return loss;
  // In f32 whatever the loss's dtype: 65536 x an f16 loss would overflow f16 itself.
  const Tensor l = is_half(loss.dtype()) ? loss.to(kFloat32) : loss;
  return mul(l, scale_);
}

void GradScaler::unscale_(optim::Optimizer& opt) {
  if (!opts_.enabled) return;
  LS_CHECK(unscaled_ == nullptr,
           "GradScaler: unscale_() was already called for this step; call update() after "
           "step() before unscaling again");
  autograd::NoGradGuard no_grad;
  const double inv = 1.0 / scale_;
  bool found = false;
  // Device gradients: one multi-tensor kernel per device does the unscale and the inf check of
  // all of them, and the flag is read once (Note [Multi-tensor kernels]).
  std::vector<std::pair<Device, std::vector<Tensor>>> on_devices;
  for (Tensor g : opt.step_gradients()) {
    if (detail::has_kernel(&detail::Kernels::unscale_check, g.device()) && g.is_contiguous()) {
      auto it = std::find_if(on_devices.begin(), on_devices.end(),
                             [&](const auto& e) { return e.first == g.device(); });
      if (it == on_devices.end()) it = on_devices.insert(on_devices.end(), {g.device(), {}});
      it->second.push_back(g);
      continue;
    }
    found = unscale_and_check(g, inv) || found;
  }
  for (auto& [device, grads] : on_devices) {
    const Tensor found_inf = zeros({1}, TensorOptions(kFloat32).with_device(device));
    detail::kernel(&detail::Kernels::unscale_check, device, "GradScaler")(grads, inv, found_inf);
    found = found_inf.item() != 0 || found;
  }
  unscaled_ = &opt;
  found_inf_ = opt.agree_found_inf(found);
}

bool GradScaler::step(optim::Optimizer& opt) {
  if (!opts_.enabled) {
    opt.step();
    return true;
  }
  LS_CHECK(!stepped_, "GradScaler: step() was already called; call update() first");
  if (unscaled_ == nullptr) unscale_(opt);
  LS_CHECK(unscaled_ == &opt, "GradScaler: unscale_() was called for another optimizer");
  stepped_ = true;
  last_skipped_ = found_inf_;
  if (found_inf_) return false;
  opt.step();
  return true;
}

void GradScaler::update() {
  if (!opts_.enabled) return;
  LS_CHECK(stepped_ || unscaled_ != nullptr,
           "GradScaler: update() without step() or unscale_() since the last update");
  if (found_inf_) {
    scale_ *= opts_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ >= opts_.growth_interval) {
    const double grown = scale_ * opts_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  unscaled_ = nullptr;
  found_inf_ = false;
  stepped_ = false;
}

std::map<std::string, double> GradScaler::state_dict() const {
  return {{"scale", scale_},
          {"growth_factor", opts_.growth_factor},
          {"backoff_factor", opts_.backoff_factor},
          {"growth_interval", static_cast<double>(opts_.growth_interval)},
          {"_growth_tracker", static_cast<double>(growth_tracker_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  auto get = [&](const char* k) {
    auto it = state.find(k);
    LS_CHECK(it != state.end(), "GradScaler::load_state_dict: missing '", k, "'");
    return it->second;
  };
  const double s = get("scale");
  LS_CHECK(s > 0 && std::isfinite(s),
           "GradScaler::load_state_dict: scale must be positive and "
           "finite, got ",
           s);
  const double growth = get("growth_factor"), backoff = get("backoff_factor");
  const double interval = get("growth_interval"), tracker = get("_growth_tracker");
  LS_CHECK(growth > 1.0, "GradScaler::load_state_dict: growth_factor must be > 1, got ", growth);
  LS_CHECK(backoff > 0.0 && backoff < 1.0,
           "GradScaler::load_state_dict: backoff_factor must be in (0, 1), got ", backoff);
  LS_CHECK(interval >= 1 && interval == std::floor(interval),
           "GradScaler::load_state_dict: growth_interval must be a positive integer, got ",
           interval);
  LS_CHECK(tracker >= 0 && tracker == std::floor(tracker),
           "GradScaler::load_state_dict: _growth_tracker must be a non-negative integer, got ",
           tracker);
  scale_ = s;
  opts_.growth_factor = growth;
  opts_.backoff_factor = backoff;
  opts_.growth_interval = static_cast<int64_t>(interval);
  growth_tracker_ = static_cast<int64_t>(tracker);
}

}  // namespace lockstep::amp
