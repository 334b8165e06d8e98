// Stopping a job cleanly when its cluster takes the machines back: every rank finishes the step
// it is in, the job checkpoints, and the requeued job resumes from there (Note [Preemption]).
//
//   dist::StopOnSignal stop;                            // catches SIGTERM from here on
//   for (...) {
//     train_step();
//     if (const int sig = stop.agreed(pg)) {            // collective, once per optimizer step
//       save_checkpoint(...);
//       return dist::StopOnSignal::exit_code(sig);      // 143 for SIGTERM
//     }
//   }
#pragma once

#include <signal.h>

#include <string>
#include <vector>

namespace lockstep::dist {

class ProcessGroup;

// Note [Preemption]
// ~~~~~~~~~~~~~~~~~
// A cluster ends a job by signalling it: SLURM sends SIGTERM to every process of a job it
// preempts, cancels, requeues (`scontrol requeue`) or times out, and SIGKILL KillWait seconds
// later (30 by default); `sbatch --signal=USR1@60` sends a signal of the user's choice a minute
// ahead; Kubernetes sends SIGTERM and SIGKILL after the pod's grace period. In those seconds a
// data-parallel job can keep its work, but only if every rank stops after the same step: a
// checkpoint of ranks at different steps is no checkpoint, and a rank that stops alone leaves
// the others waiting in a collective until they time out. The signal may reach every rank (SLURM
// signals each process of the job) or one (a launcher that a pod's runtime signalled, a user's
// `kill`).
//
// So the signal only raises a flag (an async-signal-safe store), and after each optimizer step
// every rank calls agreed(): one all_reduce(max) of a single number, the signal a rank caught or
// 0. Every rank gets the same answer after the same step, whichever ranks the signal reached,
// and the training loop saves and exits. Exiting with 128 + the signal (143 for SIGTERM) is what
// a shell reports for a process the signal ended; `lockstep run` passes it on, SLURM's
// RequeueExit can name it, and `--resume auto` picks the checkpoint up when the job is started
// again. A repeated signal changes nothing: SLURM and a launcher that forwards both signal the
// same rank.
//
// The cost is the one small all_reduce per step (a few microseconds on one machine). A loop whose
// ranks take different numbers of steps (uneven inputs under a Join) cannot agree this way and
// should not catch the signals.
class StopOnSignal {
 public:
  // Catches `signals` in this process from now until destruction, when the previous
  // dispositions come back. One StopOnSignal at a time per process.
  explicit StopOnSignal(std::vector<int> signals = {SIGTERM});
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  // Collective over every rank of `pg`: the signal some rank caught (the highest number when
  // ranks caught different ones), or 0 when none did. Every rank returns the same.
  int agreed(ProcessGroup& pg);

  // The first of the signals that reached this process, or 0.
  int caught() const;

  // The status a process ended by `sig` reports: 128 + sig.
  static int exit_code(int sig) { return 128 + sig; }

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;  // signals_[i]'s disposition before
  sigset_t previous_mask_;                  // the calling thread's, before
};

// "TERM", "SIGTERM", "term" or "15" as the signal's number; "none" as none. A list is
// comma-separated ("TERM,USR1"). Only signals sent to ask a process to end are taken (TERM, INT,
// HUP, QUIT, USR1, USR2, ALRM, XCPU): anything else is an error naming the text and those.
std::vector<int> parse_signals(const std::string& text);

// "SIGTERM" for SIGTERM; "signal N" for a number without a name.
std::string signal_name(int sig);

}  // namespace lockstep::dist
