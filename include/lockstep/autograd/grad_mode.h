// Grad mode: a per-thread switch for recording the autograd graph, and NoGradGuard.
#pragma once

namespace lockstep::autograd {

bool grad_enabled();
void set_grad_enabled(bool enabled);

// Turns recording off for the current thread until the guard leaves scope.
class NoGradGuard {
 public:
  NoGradGuard() : prev_(grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

class EnableGradGuard {
 public:
  EnableGradGuard() : prev_(grad_enabled()) { set_grad_enabled(true); }
  ~EnableGradGuard() { set_grad_enabled(prev_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace lockstep::autograd

namespace lockstep {
using autograd::NoGradGuard;
}
