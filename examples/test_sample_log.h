// Testing only: the sample log both examples write under --test-sample-log (Note [Sample log]),
// and the restart count of `lockstep run` it records.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/base/error.h"
#include "lockstep/base/env_var.h"
#include "lockstep/base/syscall.h"

namespace lockstep::examples {

// LOCKSTEP_RESTART_COUNT as `lockstep run` sets it: 0 on the first attempt of a run, or unset.
inline std::string restart_count() {
  return std::to_string(env_int(env::kRestartCount, 0, 1 << 30).value_or(0));
}

// The first attempt of a run (not a restart by `lockstep run --max-restarts`).
inline bool first_attempt() { return restart_count() == "0"; }

// Note [Sample log]
// --test-sample-log PATH is for the tests alone (Fashion-MNIST's rescale test and the launcher's
// elastic tests; train_gpt's sharded-checkpoint test): it shows which samples the model was
// trained on, so that a test can check that a run resumed at another world size skipped none of
// the epoch and repeated none. After each optimizer step every rank appends one line:
//
//   restart=R step=S epoch=E rank=K world_size=W samples=I,J,...
//
// R is LOCKSTEP_RESTART_COUNT (0 when unset), S the optimizer step just taken (1 for the first,
// as in --metrics and the checkpoint names), E its epoch, K this rank, W the world size, and
// the samples are the dataset indices (images; train_gpt's token windows) of this rank's
// micro-batches of the step, in order. Each line is one write(2) to a file opened with O_APPEND,
// so ranks and restarts share the file with whole lines. A rank writes its line before the
// step's checkpoint, which is collective: every step a checkpoint holds has the lines of all its
// ranks.
//
// A run (one restart count; with separate `lockstep run` invocations, which all count from 0,
// one file each) trains on from the step its checkpoint holds. What the final model trained on
// is therefore, run by run in order: the run's records, less those of steps after the step the
// next run resumed from (the next run's first step minus 1), which the crash lost. The
// remaining records have each step once, with one line per rank of the world that trained it
// (tests/examples/sample_log.py reads them so).
class TestSampleLog {
 public:
  // path empty: logs nothing.
  TestSampleLog(const std::string& path, int rank, int world)
      : prefix_("restart=" + restart_count()), rank_(rank), world_(world) {
    if (path.empty()) return;
    fd_ = Fd(LS_SYSCHECK_MSG(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644),
                             "--test-sample-log: cannot open ", path));
    path_ = path;
  }

  // One micro-batch of the coming optimizer step: its dataset indices.
  void add(const std::vector<int64_t>& indices) {
    if (fd_.valid()) samples_.insert(samples_.end(), indices.begin(), indices.end());
  }

  // The step's line: Note [Sample log].
  void after_step(int64_t step, int64_t epoch) {
    if (!fd_.valid()) return;
    std::string line = prefix_ + " step=" + std::to_string(step) +
                       " epoch=" + std::to_string(epoch) + " rank=" + std::to_string(rank_) +
                       " world_size=" + std::to_string(world_) + " samples=";
    for (size_t k = 0; k < samples_.size(); ++k)
      line += (k ? "," : "") + std::to_string(samples_[k]);
    line += '\n';
    samples_.clear();
    // One write in practice (a short write to a regular file means a full disk): an error then.
    const ssize_t n = LS_SYSCHECK_MSG(
        retry_on_eintr([&] { return ::write(fd_.get(), line.data(), line.size()); }),
        "--test-sample-log: cannot write to ", path_);
    LS_CHECK(static_cast<size_t>(n) == line.size(), "--test-sample-log: wrote ", n, " of the ",
             line.size(), " bytes of a line to ", path_, " (is the disk full?)");
  }

 private:
  std::string prefix_;
  int rank_, world_;
  std::string path_;
  Fd fd_;
  std::vector<int64_t> samples_;  // the current step's, so far
};

}  // namespace lockstep::examples
