// LOCKSTEP_ERROR_FILE: how a worker tells its launcher why it died. `lockstep run` gives each
// worker its own path and prints the message in its failure summary (torchrun's
// TORCHELASTIC_ERROR_FILE plays the same part).
#pragma once

#include <string>

#include "lockstep/base/worker_env.h"

namespace lockstep::dist {

inline constexpr const char* kErrorFileEnv = env::kErrorFile;

// Writes {"message": ..., "time": <unix seconds>, "pid": ...} to $LOCKSTEP_ERROR_FILE, replacing
// what was there. Does nothing when the variable is unset; never throws (a worker that is dying
// must not fail again here).
void record_error(const std::string& message);

// Writes {"message": ..., "stop_signal": sig, ...}: this worker stops on `sig` by its own choice
// and will exit with 128 + sig after saving (Note [Preemption] in preemption.h), which
// `lockstep run` takes as a stop of the job, not a failure to restart from. Never throws.
void record_stop(int sig, const std::string& message);

// Installs a std::terminate handler that records the uncaught exception's what() (or "terminate
// called without an active exception") and then lets the previous handler run, which aborts.
// Idempotent. init_process_group() calls it, so a worker that uses the runtime reports uncaught
// exceptions to the launcher without doing anything.
void install_error_handler();

}  // namespace lockstep::dist
