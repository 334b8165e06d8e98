// lockstep: the command-line tool. `lockstep run` is the launcher (torchrun's counterpart):
//
//   lockstep run [options] PROGRAM [ARGS...]      (or: lockstep run [options] -- PROGRAM ...)
//   lockstep plot METRICS.jsonl [...] -o curves.png|curves.svg   (training curves; plot.h)
//
// Options keep torchrun's names and defaults; each can also come from LOCKSTEP_<NAME> in the
// environment (LOCKSTEP_NPROC_PER_NODE, LOCKSTEP_MASTER_PORT, ...). Exit codes: 0 success, 1 the
// job failed, 2 bad input (nothing was started), 128 + signal when stopped by SIGINT/SIGTERM.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "agent.h"
#include "lockstep/base/error.h"
#include "lockstep/io/metrics.h"
#include "plot.h"

using namespace lockstep::launch;

namespace {

struct Usage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::optional<long long> parse_int(const std::string& s) {
  long long v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

int count_gpus() {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev", ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
        name.find_first_not_of("0123456789", 6) == std::string::npos) {
      ++n;
    }
  }
  return n;
}

// PROGRAM as execve needs it: a path with a '/' as given, else the first executable on PATH.
std::string resolve_program(const std::string& program) {
  namespace fs = std::filesystem;
  auto executable = [](const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    if (!executable(program)) {
      std::error_code ec;
      throw Usage("the program '" + program + "' " +
                  (fs::exists(program, ec) ? "is not an executable file" : "does not exist"));
    }
    return fs::absolute(program).string();
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string d; std::getline(dirs, d, ':');) {
    const fs::path p = fs::path(d.empty() ? "." : d) / program;
    if (executable(p)) return fs::absolute(p).string();
  }
  throw Usage("the program '" + program + "' was not found on PATH");
}

struct Raw {
  std::string nproc = "1";
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval = 0.1;
  std::string log_dir;
  bool tee = false;
  std::string local_ranks_filter;
  std::string run_id;
  double rdzv_timeout = 900;
};

RunOptions validate(const Raw& raw, std::vector<std::string> command) {
  RunOptions o;
  if (raw.nproc == "auto") {
    const int gpus = count_gpus();
    o.nproc_per_node = gpus > 0 ? gpus : 1;
    std::fprintf(stderr, "lockstep run: --nproc-per-node auto = %d (%s)\n", o.nproc_per_node,
                 gpus > 0 ? "one per GPU" : "no GPU found");
  } else {
    const auto n = parse_int(raw.nproc);
    if (!n || *n < 1 || *n > 4096) {
      throw Usage("--nproc-per-node expects a positive integer or 'auto', got '" + raw.nproc + "'");
    }
    o.nproc_per_node = static_cast<int>(*n);
  }
  if (raw.nnodes < 1) throw Usage("--nnodes must be at least 1, got " + std::to_string(raw.nnodes));
  if (raw.node_rank < 0 || raw.node_rank >= raw.nnodes) {
    throw Usage("--node-rank must be in [0, --nnodes " + std::to_string(raw.nnodes) + "), got " +
                std::to_string(raw.node_rank));
  }
  if (raw.standalone && raw.nnodes != 1) {
    throw Usage("--standalone runs on one machine; it cannot be combined with --nnodes " +
                std::to_string(raw.nnodes));
  }
  if (raw.master_port < 1 || raw.master_port > 65535) {
    throw Usage("--master-port must be in [1, 65535], got " + std::to_string(raw.master_port));
  }
  if (raw.max_restarts < 0) throw Usage("--max-restarts must be >= 0");
  if (!(raw.monitor_interval > 0)) throw Usage("--monitor-interval must be > 0 seconds");
  if (!(raw.rdzv_timeout > 0)) throw Usage("--rdzv-timeout must be > 0 seconds");
  if (raw.tee && raw.log_dir.empty()) throw Usage("--tee needs --log-dir");
  o.nnodes = raw.nnodes;
  o.node_rank = raw.node_rank;
  o.master_addr = raw.standalone ? "127.0.0.1" : raw.master_addr;
  o.master_port = raw.master_port;
  o.standalone = raw.standalone;
  o.max_restarts = raw.max_restarts;
  o.monitor_interval_s = raw.monitor_interval;
  o.output.log_dir = raw.log_dir;
  o.output.tee = raw.tee;
  o.rdzv_timeout_s = raw.rdzv_timeout;
  if (!raw.local_ranks_filter.empty()) {
    std::stringstream ss(raw.local_ranks_filter);
    for (std::string item; std::getline(ss, item, ',');) {
      const auto r = parse_int(item);
      if (!r || *r < 0 || *r >= o.nproc_per_node) {
        throw Usage("--local-ranks-filter expects local ranks in [0, " +
                    std::to_string(o.nproc_per_node) + ") separated by commas, got '" +
                    raw.local_ranks_filter + "'");
      }
      o.output.local_ranks_filter.push_back(static_cast<int>(*r));
    }
  }
  // torchrun: "none" unless given; --standalone gets a fresh id of its own.
  o.run_id = !raw.run_id.empty() ? raw.run_id
             : raw.standalone    ? "standalone-" + std::to_string(::getpid())
                                 : "none";
  if (o.run_id.find('/') != std::string::npos) throw Usage("--run-id must not contain '/'");
  if (command.empty()) throw Usage("no program given: lockstep run [options] PROGRAM [ARGS...]");
  o.program = resolve_program(command.front());
  o.args.assign(command.begin() + 1, command.end());
  return o;
}

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
      "environment. docs/LAUNCHER.md has the details.");
  run->prefix_command();  // everything from PROGRAM on belongs to the program
  run->allow_extras();    // ... also after "--"
  Raw raw;
  auto env = [](const std::string& name) { return "LOCKSTEP_" + name; };
  run->add_option("--nproc-per-node", raw.nproc,
                  "workers on this machine: an integer, or auto (one per GPU, else 1)")
      ->envname(env("NPROC_PER_NODE"))
      ->capture_default_str();
  run->add_option("--nnodes", raw.nnodes, "machines in the job")
      ->envname(env("NNODES"))
      ->capture_default_str();
  run->add_option("--node-rank", raw.node_rank, "this machine's rank in [0, nnodes)")
      ->envname(env("NODE_RANK"))
      ->capture_default_str();
  run->add_option("--master-addr", raw.master_addr, "address of node 0 (hosts the store)")
      ->envname(env("MASTER_ADDR"))
      ->capture_default_str();
  run->add_option("--master-port", raw.master_port, "port of node 0's store")
      ->envname(env("MASTER_PORT"))
      ->capture_default_str();
  run->add_flag("--standalone", raw.standalone,
                "one machine: the store takes a free port (no clash possible)")
      ->envname(env("STANDALONE"));
  run->add_option("--max-restarts", raw.max_restarts,
                  "restart the whole group this many times after a failure")
      ->envname(env("MAX_RESTARTS"))
      ->capture_default_str();
  run->add_option("--monitor-interval", raw.monitor_interval,
                  "seconds between checks of the other machines' state")
      ->envname(env("MONITOR_INTERVAL"))
      ->capture_default_str();
  run->add_option("--log-dir", raw.log_dir,
                  "write each rank's output to DIR/<run-id>/attempt_<n>/<rank>/{stdout,stderr}.log")
      ->envname(env("LOG_DIR"));
  run->add_flag("--tee", raw.tee, "with --log-dir: to the terminal as well")->envname(env("TEE"));
  run->add_option("--local-ranks-filter", raw.local_ranks_filter,
                  "comma-separated local ranks whose output reaches the terminal (default all)")
      ->envname(env("LOCAL_RANKS_FILTER"));
  run->add_option("--run-id", raw.run_id, "the job's id (the same on every machine)")
      ->envname(env("RUN_ID"));
  run->add_option("--rdzv-timeout", raw.rdzv_timeout,
                  "seconds to wait for every machine to join (and to restart)")
      ->envname(env("RDZV_TIMEOUT"))
      ->capture_default_str();

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
      const bool is_flag = *it == "--standalone" || *it == "--tee" || *it == "--help" ||
                           *it == "--version" || it->find('=') != std::string::npos;
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
  std::reverse(args.begin(), args.end());  // CLI11 takes them in reverse order
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    const std::string sub = plot->parsed() ? " plot" : run->parsed() ? " run" : "";
    std::fprintf(stderr, "lockstep%s: %s\nRun 'lockstep%s --help' for the options.\n", sub.c_str(),
                 e.what(), sub.c_str());
    return kExitUsage;
  }
  if (plot->parsed()) return run_plot(plot_args);
  try {
    std::vector<std::string> command = run->remaining();
    if (!command.empty() && command.front().size() > 1 && command.front()[0] == '-') {
      throw Usage("unknown option " + command.front() + " (see lockstep run --help)");
    }
    if (has_dashes) {
      if (!command.empty()) {
        throw Usage("'" + command.front() +
                    "' before '--': give PROGRAM either before or after it");
      }
      command = after_dashes;
    }
    const RunOptions opts = validate(raw, command);
    return run_agent(opts);
  } catch (const Usage& e) {
    std::fprintf(stderr, "lockstep run: %s\n", e.what());
    return kExitUsage;
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
