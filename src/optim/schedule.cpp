// Learning-rate schedules and the scheduler that applies them.
#include "lockstep/optim/schedule.h"

#include <cmath>

#include "lockstep/base/error.h"
#include "lockstep/optim/optimizer.h"

namespace lockstep::optim {

Schedule constant_schedule() {
  return [](int64_t) { return 1.0; };
}

Schedule linear_warmup(int64_t warmup_steps) {
  LS_CHECK(warmup_steps > 0, "linear_warmup: warmup_steps must be positive, got ", warmup_steps);
  return [warmup_steps](int64_t step) {
    return step >= warmup_steps ? 1.0 : static_cast<double>(step + 1) / warmup_steps;
  };
}

Schedule cosine_decay(int64_t total_steps, double min_factor) {
  LS_CHECK(total_steps > 0, "cosine_decay: total_steps must be positive, got ", total_steps);
  return [total_steps, min_factor](int64_t step) {
    if (step >= total_steps) return min_factor;
    const double progress = static_cast<double>(step) / total_steps;
    return min_factor + (1 - min_factor) * 0.5 * (1 + std::cos(M_PI * progress));
  };
}

Schedule step_decay(int64_t step_size, double gamma) {
  LS_CHECK(step_size > 0, "step_decay: step_size must be positive, got ", step_size);
  return [step_size, gamma](int64_t step) {
    return std::pow(gamma, static_cast<double>(step / step_size));
  };
}

Schedule sequential(Schedule first, int64_t switch_step, Schedule then) {
  return [first, switch_step, then](int64_t step) {
    return step < switch_step ? first(step) : then(step - switch_step);
  };
}

Schedule warmup_cosine(int64_t warmup_steps, int64_t total_steps, double min_factor) {
  LS_CHECK(total_steps > warmup_steps, "warmup_cosine: total_steps (", total_steps,
           ") must exceed warmup_steps (", warmup_steps, ")");
  return sequential(linear_warmup(warmup_steps), warmup_steps,
                    cosine_decay(total_steps - warmup_steps, min_factor));
}

LRScheduler::LRScheduler(Optimizer& opt, Schedule schedule)
    : opt_(opt), schedule_(std::move(schedule)) {
  for (const auto& g : opt.param_groups()) base_lrs_.push_back(g.lr);
  apply();
}

void LRScheduler::apply() {
  const double f = schedule_(step_);
  auto& groups = opt_.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) groups[i].lr = base_lrs_[i] * f;
}

void LRScheduler::step() {
  ++step_;
  apply();
}

void LRScheduler::set_step(int64_t step) {
  step_ = step;
  apply();
}

double LRScheduler::last_lr() const { return opt_.param_groups().front().lr; }

}  // namespace lockstep::optim
