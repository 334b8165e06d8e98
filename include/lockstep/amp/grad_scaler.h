// GradScaler: dynamic loss scaling for f16 training (torch.amp.GradScaler). The loss is
// multiplied by the scale before backward so that small f16 gradients do not flush to zero;
// gradients are divided by it before the step, and a step whose gradients hold an inf or NaN is
// skipped while the scale backs off.
//
//   amp::GradScaler scaler;
//   scaler.scale(loss).backward();
//   scaler.unscale_(opt);                 // optional: to clip the true gradients
//   optim::clip_grad_norm(params, 1.0);
//   scaler.step(opt);                     // skipped if any gradient is inf/NaN
//   scaler.update();
//
// Under DDP the gradients are already averaged across ranks when step() looks at them, and an
// inf or NaN on one rank is inf or NaN on all after the all-reduce, so every rank makes the same
// decision without communicating.
#pragma once

#include <map>
#include <string>

#include "lockstep/optim/optimizer.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::amp {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;  // clean steps before the scale grows
  bool enabled = true;             // disabled: scale() returns the loss, step() just steps
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions opts = {});

  // loss x scale (a new tensor in the graph).
  Tensor scale(const Tensor& loss) const;
  // Divides the optimizer's gradients by the scale in place and records whether any is inf or
  // NaN. Once per optimizer between update()s; step() calls it if the user did not.
  void unscale_(optim::Optimizer& opt);
  // opt.step() unless the gradients held an inf or NaN; returns whether it stepped.
  bool step(optim::Optimizer& opt);
  // After step(): on an inf/NaN, scale x backoff and the clean-step count restarts; after
  // growth_interval clean steps, scale x growth.
  void update();

  double get_scale() const { return scale_; }
  bool is_enabled() const { return opts_.enabled; }
  // Whether the last step() was skipped.
  bool last_step_skipped() const { return last_skipped_; }

  // "scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker" (PyTorch's
  // names), for checkpoints. Loading checks every value.
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  GradScalerOptions opts_;
  double scale_;
  int64_t growth_tracker_ = 0;
  // Per step: which optimizer was unscaled and whether it found inf/NaN.
  const optim::Optimizer* unscaled_ = nullptr;
  bool found_inf_ = false;
  bool stepped_ = false;
  bool last_skipped_ = false;
};

}  // namespace lockstep::amp
