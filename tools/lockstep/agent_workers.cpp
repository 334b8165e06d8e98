// The agent's workers: starting a generation's set, relaying their output, reaping and stopping
// them, the word to ranks waiting for one that left before joining, and the failure record with
// the summary printed from it.
#include <poll.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent_impl.h"
#include "lockstep/base/worker_env.h"
#include "output.h"
#include "why_died.h"
#include "worker_process.h"

extern char** environ;

namespace lockstep::launch::agent_detail {

void Agent::start_workers(int g) {
  workers_.clear();
  if (g == 0) oom_counter_ = find_oom_counter();
  if (oom_counter_) oom_kills_at_start_ = read_oom_kills(*oom_counter_);
  // The worker environment: ours, less what the launcher sets (base/worker_env.h).
  std::vector<std::string> base;
  bool user_omp = false;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    if (name == env::kOmpNumThreads) user_omp = true;
    if (name == env::kTimeout) continue;  // --timeout's (LOCKSTEP_TIMEOUT is read as --timeout)
    if (name == env::kStoreTokenFile) continue;  // the launcher's LOCKSTEP_STORE_TOKEN replaces it
    if (std::find(env::kLauncherSet.begin(), env::kLauncherSet.end(), name) ==
        env::kLauncherSet.end()) {
      base.push_back(entry);
    }
  }
  if (!user_omp) {
    base.push_back(std::string(env::kOmpNumThreads) + "=" +
                   std::to_string(std::max(1, online_cpus() / o_.nproc_per_node)));
  }
  const std::string attempt = "attempt_" + std::to_string(g);
  for (int l = 0; l < o_.nproc_per_node; ++l) {
    auto w = std::make_unique<Worker>();
    w->local_rank = l;
    w->rank = node_rank_ * o_.nproc_per_node + l;
    const auto dir = std::filesystem::path(tmp_dir_) / attempt / std::to_string(w->rank);
    std::filesystem::create_directories(dir);
    w->error_file = (dir / "error.json").string();
    w->trace_file = (dir / "trace").string();
    const bool to_terminal = o_.output.to_terminal(l);
    WorkerSpec spec;
    spec.program = o_.program;
    spec.args = o_.args;
    spec.env = base;
    auto set = [&](const char* n, const std::string& v) { spec.env.push_back(n + ("=" + v)); };
    set(env::kRank, std::to_string(w->rank));
    set(env::kLocalRank, std::to_string(l));
    set(env::kWorldSize, std::to_string(world_size()));
    set(env::kLocalWorldSize, std::to_string(o_.nproc_per_node));
    set(env::kGroupRank, std::to_string(node_rank_));
    set(env::kMasterAddr, o_.master_addr);
    set(env::kMasterPort, std::to_string(store_port_));
    set(env::kRestartCount, std::to_string(g));
    set(env::kMaxRestarts, std::to_string(o_.max_restarts));
    set(env::kRunId, o_.run_id);
    set(env::kUseAgentStore, "1");
    set(env::kStoreToken, token_);
    set(env::kErrorFile, w->error_file);
    set(env::kTraceFile, w->trace_file);
    if (!o_.timeout.empty()) set(env::kTimeout, o_.timeout);
    // Only where the worker's stdout really ends on the terminal: with --log-dir and no --tee,
    // or filtered out, a progress bar would reach only the log file (where plain lines belong).
    if (terminal_.is_tty(1) && to_terminal) set(env::kStdoutIsTty, "1");
    const std::string logs = o_.output.log_dir.empty()
                                 ? std::string()
                                 : (std::filesystem::path(o_.output.log_dir) / o_.run_id / attempt /
                                    std::to_string(w->rank))
                                       .string();
    w->log_dir = logs;
    w->output = std::make_unique<WorkerOutput>(terminal_, w->rank, to_terminal, logs);
    w->proc = std::make_unique<WorkerProcess>(spec);
    workers_.push_back(std::move(w));
  }
}

void Agent::pump_output(std::chrono::milliseconds timeout) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, bool>> who;
  for (auto& w : workers_) {
    if (w->proc->stdout_fd() >= 0) {
      fds.push_back({w->proc->stdout_fd(), POLLIN, 0});
      who.emplace_back(w.get(), false);
    }
    if (w->proc->stderr_fd() >= 0) {
      fds.push_back({w->proc->stderr_fd(), POLLIN, 0});
      who.emplace_back(w.get(), true);
    }
  }
  fds.push_back({sigfd_.get(), POLLIN, 0});  // SIGCHLD or a stop request wakes us up
  const int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
  if (n <= 0) return;
  for (size_t i = 0; i + 1 < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    Worker& w = *who[i].first;
    w.proc->drain(fds[i].fd, who[i].second ? w.output->stderr_lines() : w.output->stdout_lines());
  }
}

void Agent::reap() {
  for (auto& w : workers_) w->proc->poll_exit();
}

bool Agent::all_exited() {
  return std::all_of(workers_.begin(), workers_.end(),
                     [](const auto& w) { return w->proc->exit_status().has_value(); });
}

void Agent::drain_after_exit() {
  const auto deadline = Clock::now() + kDrainTimeout;
  while (Clock::now() < deadline &&
         std::any_of(workers_.begin(), workers_.end(),
                     [](const auto& w) { return w->proc->streams_open(); })) {
    pump_output(std::chrono::milliseconds(20));
  }
}

void Agent::drain_worker(Worker& w) {
  const auto deadline = Clock::now() + kDrainTimeout;
  while (w.proc->streams_open() && Clock::now() < deadline) {
    std::vector<pollfd> fds;
    if (w.proc->stdout_fd() >= 0) fds.push_back({w.proc->stdout_fd(), POLLIN, 0});
    if (w.proc->stderr_fd() >= 0) fds.push_back({w.proc->stderr_fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
    for (const auto& p : fds) {
      if (p.revents == 0) continue;
      w.proc->drain(
          p.fd, p.fd == w.proc->stdout_fd() ? w.output->stdout_lines() : w.output->stderr_lines());
    }
  }
}

void Agent::stop_workers(int sig, std::chrono::milliseconds grace) {
  for (auto& w : workers_) {
    if (!w->proc->exit_status()) w->proc->signal_group(sig);
  }
  const auto deadline = Clock::now() + grace;
  reap();
  while (!all_exited() && Clock::now() < deadline && !second_interrupt_) {
    pump_output(std::chrono::milliseconds(20));
    take_signal();  // remembered: a Ctrl-C now still ends the job once this group is stopped
    reap();
  }
  if (second_interrupt_ && !all_exited()) say("SIGINT again: killing the workers now");
  for (auto& w : workers_) {
    if (!w->proc->exit_status()) w->proc->signal_group(SIGKILL);
  }
  const auto kill_deadline = Clock::now() + kKillWait;
  while (!all_exited()) {
    if (Clock::now() >= kill_deadline) {
      for (auto& w : workers_) {
        if (!w->proc->exit_status()) {
          say("rank " + std::to_string(w->rank) + " (pid " + std::to_string(w->proc->pid()) +
              ") did not exit " + std::to_string(kKillWait.count()) +
              " s after SIGKILL (stuck in the kernel?); giving up on it");
        }
      }
      break;
    }
    pump_output(std::chrono::milliseconds(20));
    take_signal();
    reap();
  }
  drain_after_exit();
}

// Note [A rank that leaves before joining]
// A worker that exits 0 without calling init_process_group is no failure to the launcher, but
// the other ranks wait for it in the join (Note [Join check] in src/distributed/init.cpp) until
// the rendezvous timeout, 300 s by default. The launcher knows at once, and the workers join
// through its store under lockstep/<run-id>/gen<g>/: a rank that has not claimed rank/<r> by
// the time it exited never will, so the agent writes the join's `error` key (compare_set: a
// rank's own error stays first), and every rank waiting in the join fails at once with that
// message, which the failure summary then quotes. A rank that joined (and finished its work)
// and exits 0 has its claim in the store and changes nothing.
void Agent::tell_ranks_waiting_to_join(int g) {
  if (world_size() == 1) return;  // a world of one joins through no store
  const std::string world = "lockstep/" + o_.run_id + "/gen" + std::to_string(g) + "/";
  for (auto& w : workers_) {
    const auto& st = w->proc->exit_status();
    if (!st || !st->ok() || w->join_checked) continue;
    w->join_checked = true;
    if (store_->check({world + "rank/" + std::to_string(w->rank)})) continue;  // it joined
    store_->compare_set(
        world + "error", "",
        "rank " + std::to_string(w->rank) + " (node " + std::to_string(node_rank_) + ", host " +
            hostname() + ") exited with " + st->str() +
            " without joining the process group, so the world of " +
            std::to_string(world_size()) +
            " ranks cannot form: every rank must call init_process_group (the launcher saw it "
            "exit)");
  }
}

json Agent::describe_failure(const Worker& w) const {
  const ExitStatus& s = *w.proc->exit_status();
  json f = {{"rank", w.rank},          {"local_rank", w.local_rank}, {"node", node_rank_},
            {"host", hostname()},      {"status", s.str()},          {"time", utc_now()},
            {"tail", w.output->tail()}};
  if (s.max_rss_kib >= 0) f["peak_rss_kib"] = s.max_rss_kib;
  if (s.signaled) {
    // Note [Out-of-memory evidence]: only SIGKILL can be the OOM killer's.
    std::string oom;
    if (s.signal == SIGKILL && oom_counter_ && oom_kills_at_start_) {
      const auto now = read_oom_kills(*oom_counter_);
      if (now && *now > *oom_kills_at_start_) {
        oom = "the oom_kill count of " + oom_counter_->file + " rose from " +
              std::to_string(*oom_kills_at_start_) + " to " + std::to_string(*now) +
              " while the job ran";
      }
    }
    if (s.signal == SIGKILL) {
      const std::string line = kernel_log_oom_line(w.proc->pid());
      if (!line.empty()) oom += (oom.empty() ? "" : "; ") + ("the kernel log says: " + line);
    }
    if (!oom.empty()) f["oom"] = oom;
    if (const auto avail = mem_available_kib()) f["mem_available_kib"] = *avail;
  }
  // Where the summary says its full output is.
  if (!w.log_dir.empty()) f["log_dir"] = w.log_dir;
  f["to_terminal"] = o_.output.to_terminal(w.local_rank);
  std::ifstream in(w.error_file);
  if (in) {
    try {
      const json e = json::parse(in);
      if (e.contains("message")) f["error"] = cut_text(e["message"].get<std::string>(), kMaxError);
    } catch (const std::exception&) {
      f["error"] = "(the worker's error file " + w.error_file + " is not valid JSON)";
    }
  }
  return f;
}

int Agent::stop_signal_of(const Worker& w) const {
  const ExitStatus& s = *w.proc->exit_status();
  if (s.signaled || s.code <= 128) return 0;
  std::ifstream in(w.error_file);
  try {
    const json e = json::parse(in);
    const int sig = e.value("stop_signal", 0);
    return sig != 0 && s.code == 128 + sig ? sig : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

void Agent::print_summary(const json& f, int generation) const {
  if (f.value("interrupted", false)) {
    say("the job was stopped: the launcher on node " + std::to_string(f.value("node", 0)) +
        " received " + f.value("signal", std::string("a signal")) + " at " +
        f.value("time", std::string("?")));
    return;
  }
  for (const auto& line : verdict_lines_) say(line);
  if (f.value("left", false) || f.value("membership", false)) {  // elastic: the last change
    say("the job failed after this change: " + event_text(f));
    return;
  }
  if (f.value("lost", false)) {
    say("the job failed: node " + std::to_string(f.value("node", -1)) + " (host " +
        f.value("host", std::string("?")) + ") is " + f.value("status", std::string("?")) +
        "; seen by node " + std::to_string(f.value("seen_by", -1)) + " at " +
        f.value("time", std::string("?")));
    return;
  }
  if (f.value("rank", -1) < 0) {
    say("the job failed: node " + std::to_string(f.value("node", -1)) + " (host " +
        f.value("host", std::string("?")) + ") could not start its workers: " +
        f.value("status", std::string("?")) + " at " + f.value("time", std::string("?")));
    return;
  }
  std::ostringstream s;
  s << "the job failed: rank " << f.value("rank", -1) << " (local rank "
    << f.value("local_rank", -1) << " on node " << f.value("node", -1) << ", host "
    << f.value("host", std::string("?")) << ") ended with " << f.value("status", std::string("?"))
    << " at " << f.value("time", std::string("?")) << "; restarts used: " << generation << " of "
    << o_.max_restarts;
  say(s.str());
  const std::string rank_n = "rank " + std::to_string(f.value("rank", -1));
  if (f.contains("oom")) {
    say(rank_n + " was killed by the out-of-memory killer (" + f["oom"].get<std::string>() + ")");
  }
  if (f.contains("peak_rss_kib") || f.contains("mem_available_kib")) {
    std::string mem;
    if (f.contains("peak_rss_kib")) {
      mem = rank_n + "'s peak resident memory: " + format_kib(f["peak_rss_kib"].get<int64_t>());
    }
    if (f.contains("mem_available_kib")) {
      mem += (mem.empty() ? "" : "; ") +
             ("memory available on host " + f.value("host", std::string("?")) +
              " when it died: " + format_kib(f["mem_available_kib"].get<int64_t>()));
    }
    say(mem);
  }
  if (f.contains("error")) say("its error: " + f["error"].get<std::string>());
  const auto tail = f.value("tail", std::vector<std::string>{});
  if (tail.empty()) {
    say("rank " + std::to_string(f.value("rank", -1)) + " printed nothing");
  } else {
    std::string lines;
    for (const auto& l : tail) lines += "  | " + l + "\n";
    say("last lines of rank " + std::to_string(f.value("rank", -1)) + ":\n" +
        lines.substr(0, lines.size() - 1));
  }
  const std::string rank = "rank " + std::to_string(f.value("rank", -1));
  const std::string where =
      "node " + std::to_string(f.value("node", -1)) + ", host " + f.value("host", std::string("?"));
  if (f.contains("log_dir")) {
    const std::string dir = f["log_dir"].get<std::string>();
    say("the full output of " + rank + ": " + dir + "/stdout.log and " + dir + "/stderr.log (on " +
        where + ")");
  } else if (f.value("to_terminal", false)) {
    say("the full output of " + rank + " went to the terminal of the launcher on " + where);
  } else if (f.contains("to_terminal")) {
    say("the output of " + rank + " was not kept: --local-ranks-filter left it off the terminal " +
        "and there is no --log-dir");
  }
}

void Agent::print_peak_memory() const {
  std::string line;
  for (const auto& w : workers_) {
    const auto& st = w->proc->exit_status();
    if (!st || st->max_rss_kib < 0) continue;
    line += (line.empty() ? "" : ", ") +
            ("rank " + std::to_string(w->rank) + " " + format_kib(st->max_rss_kib));
  }
  if (!line.empty()) {
    say("peak resident memory of the workers on node " + std::to_string(node_rank_) + ": " +
        line);
  }
}

}  // namespace lockstep::launch::agent_detail
