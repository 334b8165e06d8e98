// The per-thread grad-mode flag.
#include "lockstep/autograd/grad_mode.h"

namespace lockstep::autograd {

namespace {
thread_local bool tl_grad_enabled = true;
}

bool grad_enabled() { return tl_grad_enabled; }
void set_grad_enabled(bool enabled) { tl_grad_enabled = enabled; }

}  // namespace lockstep::autograd
