// The cost model's settings, cleared before and after a test that reads them, so that the
// caller's environment (LOCKSTEP_NET_ALPHA_US=... in a shell) cannot change what the test sees.
#pragma once

#include <cstdlib>

#include "lockstep/base/worker_env.h"

namespace lockstep::testing {

inline void clear_cost_model_settings() {
  for (const char* name :
       {env::kNetAlphaUs, env::kNetGbps, env::kAllReduceAlgo, env::kNetCalibrate}) {
    ::unsetenv(name);
  }
}

}  // namespace lockstep::testing
