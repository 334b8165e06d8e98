// lockstep: the command-line tool. `lockstep run` is the launcher (torchrun's counterpart):
//
//   lockstep run [options] PROGRAM [ARGS...]      (or: lockstep run [options] -- PROGRAM ...)
//   lockstep plot METRICS.jsonl [...] -o curves.png|curves.svg   (training curves; plot.h)
//   lockstep checkpoint consolidate DIR -o FILE   (a sharded checkpoint as one file)
//
// Options keep torchrun's names and defaults; each can also come from LOCKSTEP_<NAME> in the
// environment (LOCKSTEP_NPROC_PER_NODE, LOCKSTEP_MASTER_PORT, ...). Exit codes: 0 success, 1 the
// job failed, 2 bad input (nothing was started), 128 + signal when stopped by SIGINT/SIGTERM.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "agent.h"
#include "checkpoint_cmd.h"
#include "lockstep/base/error.h"
#include "lockstep/io/metrics.h"
#include "plot.h"
#include "run_options.h"
#include "worker_process.h"

using namespace lockstep::launch;

namespace {

struct PlotArgs {
  std::vector<std::string> files;
  lockstep::plot::PlotOptions opts;
};

int run_plot(const PlotArgs& args) {
  try {
    std::vector<lockstep::io::MetricsFile> runs;
    lockstep::plot::format_for(args.opts.output);  // a bad extension before reading anything
    for (const std::string& f : args.files) {
      runs.push_back(lockstep::io::read_metrics(f));
      for (const std::string& w : runs.back().warnings) {
        std::fprintf(stderr, "lockstep plot: %s\n", w.c_str());
      }
    }
    const auto summary = lockstep::plot::plot(runs, args.opts);
    std::fprintf(stderr, "lockstep plot: wrote %s (%dx%d, %zu panels)\n", args.opts.output.c_str(),
                 summary.width, summary.height, summary.panels.size());
    return kExitOk;
  } catch (const lockstep::io::MetricsFileError& e) {  // "FILE:LINE: what is wrong"
    std::fprintf(stderr, "lockstep plot: %s\n", e.what());
    return kExitUsage;
  } catch (const lockstep::plot::InputError& e) {
    std::fprintf(stderr, "lockstep plot: %s\n", e.what());
    return kExitUsage;
  } catch (const lockstep::Error& e) {
    std::fprintf(stderr, "lockstep plot: %s\n", e.message().c_str());
    return kExitJobFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep plot: %s\n", e.what());
    return kExitJobFailed;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("lockstep: data-parallel training in C++", "lockstep");
  app.set_version_flag("--version", std::string("lockstep ") + LOCKSTEP_VERSION);
  app.require_subcommand(1);
  CLI::App* run = app.add_subcommand(
      "run",
      "Start PROGRAM as the workers of a distributed job on this machine (torchrun's options "
      "and worker environment)");
  run->footer(
      "\nUsage: lockstep run [OPTIONS] PROGRAM [ARGS...]   (or: lockstep run [OPTIONS] -- PROGRAM "
      "[ARGS...])\nExit codes: 0 success, 1 the job failed, 2 bad input (nothing started), "
      "128+N stopped by signal N.\nEvery option can also be set as LOCKSTEP_<NAME> in the "
      "environment; torchrun's PET_<NAME> variables (PET_NNODES, PET_NPROC_PER_NODE, "
      "PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, ...) are read too. docs/LAUNCHER.md has "
      "the details.");
  run->prefix_command();  // everything from PROGRAM on belongs to the program
  run->allow_extras();    // ... also after "--"
  RawRunOptions raw;
  // Every option also from LOCKSTEP_<NAME>; numbers stay text here, checked by run_options.cpp.
  auto option = [&](const std::string& flag, std::string& into, const std::string& help) {
    return run->add_option(flag, into, help)->envname(env_name_of(flag));
  };
  auto flag = [&](const std::string& name, bool& into, const std::string& help) {
    return run->add_flag(name, into, help)->envname(env_name_of(name));
  };
  option("--nproc-per-node", raw.nproc,
         "workers on this machine: 1 to " + std::to_string(kMaxNprocPerNode) +
             ", gpu (one per GPU), cpu (one per CPU) or auto (one per GPU, else one per CPU)")
      ->capture_default_str();
  option("--nnodes", raw.nnodes,
         "machines in the job: N, or MIN:MAX (elastic: the job runs on whichever machines have "
         "joined, from MIN to MAX, and restarts with a new world when one leaves or joins)")
      ->capture_default_str();
  option("--node-rank", raw.node_rank,
         "this machine's rank in [0, nnodes) (elastic: its name, distinct per machine; 0 hosts the "
         "store, the others get their place in each new world by this order)")
      ->capture_default_str();
  option("--master-addr", raw.master_addr, "address of node 0 (hosts the store)")
      ->capture_default_str();
  option("--master-port", raw.master_port,
         "port of node 0's store (0: any free port, on one machine)")
      ->capture_default_str();
  flag("--standalone", raw.standalone,
       "one machine: the store takes a free port on loopback (no clash possible)");
  option("--max-restarts", raw.max_restarts,
         "restart the whole group this many times after a failure")
      ->capture_default_str();
  option("--restart-backoff", raw.restart_backoff,
         "seconds before the first restart, doubling while generations fail within " +
             std::to_string(static_cast<int>(kRestartBackoffReset)) + " s, up to " +
             std::to_string(static_cast<int>(kMaxRestartBackoffS)) + " s (0: at once)")
      ->capture_default_str();
  option("--monitor-interval", raw.monitor_interval,
         "seconds between checks of the other machines' state (at least 0.01)")
      ->capture_default_str();
  option("--log-dir", raw.log_dir,
         "write each rank's output to DIR/<run-id>/attempt_<n>/<rank>/{stdout,stderr}.log");
  flag("--tee", raw.tee, "with --log-dir: to the terminal as well");
  option("--local-ranks-filter", raw.local_ranks_filter,
         "comma-separated local ranks whose output reaches the terminal (default all)");
  option("--run-id", raw.run_id, "the job's id (the same on every machine)");
  option("--rdzv-timeout", raw.rdzv_timeout,
         "seconds to wait for every machine to join (and to restart)")
      ->capture_default_str();
  option("--rdzv-last-call", raw.rdzv_last_call,
         "elastic: seconds a rendezvous waits for more machines once MIN have joined (up to MAX)")
      ->capture_default_str();
  option("--timeout", raw.timeout,
         "seconds a collective waits for the other ranks before it fails (the workers' "
         "LOCKSTEP_TIMEOUT; default: the program's choice, else 1800)");
  option("--stall-timeout", raw.stall_timeout,
         "seconds ranks may wait in a collective that another rank has not issued before the "
         "launcher warns, naming that rank (0: never; the job fails only at --timeout)")
      ->capture_default_str();
  option("--node-timeout", raw.node_timeout,
         "seconds without a word from another machine's launcher before its node counts as lost "
         "and the job fails")
      ->capture_default_str();
  option("--stop-grace", raw.stop_grace,
         "seconds the workers have, after the signal that stops the job (SIGTERM, SIGINT, "
         "SIGHUP, to this launcher or another node's), to finish their step and save before "
         "SIGKILL, 0 to 3600")
      ->capture_default_str();
  option("--token-file", raw.token_file,
         "the store's secret, shared by the machines of a job: a file only you can read");
  flag("--insecure", raw.insecure,
       "several machines without a secret (on a trusted network only; see docs/LAUNCHER.md)");

  CLI::App* plot = app.add_subcommand(
      "plot", "Draw training curves from metrics files (JSON Lines) to a PNG or SVG image");
  plot->footer(
      "\nUsage: lockstep plot METRICS.jsonl [MORE.jsonl ...] -o curves.png|curves.svg\nExit "
      "codes: 0 written, 1 could not write, 2 bad input. docs/PLOT.md has the details.");
  PlotArgs plot_args;
  plot->add_option("files", plot_args.files, "metrics files, one colour each")->required();
  plot->add_option("-o,--output", plot_args.opts.output, "the image: .png or .svg")->required();
  plot->add_option("--width", plot_args.opts.width, "pixels")->capture_default_str();
  plot->add_option("--height", plot_args.opts.height, "pixels (default: from the panels)");
  plot->add_flag("--log-y", plot_args.opts.log_y, "the loss on a logarithmic axis");
  plot->add_option("--smooth", plot_args.opts.smoothing,
                   "the loss's moving-average weight in [0, 1); 0: raw only")
      ->capture_default_str();
  plot->add_option("--title", plot_args.opts.title, "default: the file name");

  CheckpointArgs checkpoint_args;
  CLI::App* consolidate = add_checkpoint_command(app, checkpoint_args);

  // `lockstep run [options] -- PROGRAM ARGS`: what follows the first "--" is the command, as is.
  // A "--" after PROGRAM is the program's: look for one before the first word that is neither
  // an option nor an option's value.
  std::vector<std::string> args(argv + 1, argv + argc), after_dashes;
  auto dashes = args.end();
  for (auto it = args.begin(); it != args.end(); ++it) {
    if (*it == "--") {
      dashes = it;
      break;
    }
    if (*it == "run") continue;
    if (it->rfind("--", 0) == 0) {
      raw.on_command_line.insert(it->substr(0, it->find('=')));
      const bool is_flag = *it == "--standalone" || *it == "--tee" || *it == "--insecure" ||
                           *it == "--help" || *it == "--version" ||
                           it->find('=') != std::string::npos;
      if (!is_flag && std::next(it) != args.end()) ++it;  // its value
      continue;
    }
    if (*it == "-h") continue;
    break;  // PROGRAM
  }
  const bool has_dashes = dashes != args.end();
  if (has_dashes) {
    after_dashes.assign(dashes + 1, args.end());
    args.erase(dashes, args.end());
  }
  const bool is_run = !args.empty() && args.front() == "run";
  if (is_run) {
    // The agent reads its signals from a signalfd, once it exists. Until then they are held
    // pending rather than taking their default action: an early SIGUSR1 (a report) is answered
    // late instead of killing the launcher, and an early SIGINT or SIGTERM stops it as one at any
    // other stage does (it exits 128 + the signal, saying so) instead of killing it silently.
    sigset_t early;
    sigemptyset(&early);
    for (int s : {SIGUSR1, SIGINT, SIGTERM, SIGHUP}) sigaddset(&early, s);
    ::sigprocmask(SIG_BLOCK, &early, nullptr);
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes them in reverse order
  try {
    if (is_run) {
      // CLI11 would report a bad LOCKSTEP_STANDALONE as if it were --standalone.
      for (const char* f : {"--standalone", "--tee", "--insecure"}) {
        check_flag_env(f, raw.on_command_line);
      }
      adopt_torchrun_env(raw);
    }
    app.parse(args);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "lockstep run: %s\n", e.what());
    return kExitUsage;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    const std::string sub = consolidate->parsed()                 ? " checkpoint consolidate"
                            : consolidate->get_parent()->parsed() ? " checkpoint"
                            : plot->parsed()                      ? " plot"
                            : run->parsed()                       ? " run"
                                                                  : "";
    std::fprintf(stderr, "lockstep%s: %s\nRun 'lockstep%s --help' for the options.\n", sub.c_str(),
                 e.what(), sub.c_str());
    return kExitUsage;
  }
  if (plot->parsed()) return run_plot(plot_args);
  if (consolidate->parsed()) return run_checkpoint(checkpoint_args);
  // Before any worker exists: outside connections to the store must not leave the launcher
  // without descriptors for its workers' pipes (docs/LAUNCHER.md, "Threat model").
  raise_descriptor_limit();
  try {
    std::vector<std::string> command = run->remaining();
    if (!command.empty() && command.front().size() > 1 && command.front()[0] == '-') {
      throw UsageError("unknown option " + command.front() + " (see lockstep run --help)");
    }
    if (has_dashes) {
      if (!command.empty()) {
        throw UsageError("'" + command.front() +
                         "' before '--': give PROGRAM either before or after it");
      }
      command = after_dashes;
    }
    const RunOptions opts = check_run_options(raw, command);
    return run_agent(opts);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "lockstep run: %s\n", e.what());
    return kExitUsage;
  } catch (const lockstep::Error& e) {
    std::fprintf(stderr, "lockstep run: %s\n", e.message().c_str());
    return kExitJobFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep run: %s\n", e.what());
    return kExitJobFailed;
  }
}
