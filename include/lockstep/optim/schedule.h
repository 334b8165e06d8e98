// Learning-rate schedules: functions of the step that multiply a base rate, composable.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace lockstep::optim {

class Optimizer;

// factor(step) multiplies the base learning rate; step counts optimizer steps from 0.
using Schedule = std::function<double(int64_t step)>;

Schedule constant_schedule();
// 0 -> 1 linearly over `warmup_steps` (factor (step + 1) / warmup_steps, as common practice).
Schedule linear_warmup(int64_t warmup_steps);
// Cosine from 1 down to min_factor over total_steps, then min_factor.
Schedule cosine_decay(int64_t total_steps, double min_factor = 0.0);
// gamma^(step / step_size).
Schedule step_decay(int64_t step_size, double gamma);
// `first` for steps [0, switch_step), then `then` with its step counted from switch_step.
Schedule sequential(Schedule first, int64_t switch_step, Schedule then);
// Linear warmup for warmup_steps, then cosine decay over the remaining steps.
Schedule warmup_cosine(int64_t warmup_steps, int64_t total_steps, double min_factor = 0.0);

// Applies a schedule to an optimizer: step() advances and sets each group's lr to
// base_lr * factor.
class LRScheduler {
 public:
  LRScheduler(Optimizer& opt, Schedule schedule);
  void step();  // after optimizer.step()
  int64_t last_step() const { return step_; }
  double last_lr() const;
  void set_step(int64_t step);  // for resuming

 private:
  void apply();
  Optimizer& opt_;
  Schedule schedule_;
  std::vector<double> base_lrs_;
  int64_t step_ = 0;
};

}  // namespace lockstep::optim
