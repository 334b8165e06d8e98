// Checking `lockstep run`'s options: numbers in range, the program on PATH, the store token and
// address, the log directory.
//
// Note [Store token]
// Node 0's store admits whoever presents its token, and a client it admits can read every key and
// write the failure record that stops the job (docs/LAUNCHER.md, "Threat model"). So the token is
// a secret:
//   - on one machine (--nnodes 1, --standalone) a random one, which only the workers learn (from
//     their environment);
//   - on several machines every agent must know it before it can talk to the others, so it comes
//     from the user: LOCKSTEP_STORE_TOKEN, or --token-file (a file only its owner can read), or
//     it is derived from a --run-id the user set (then it is only as secret as the run id).
//     With none of them the launcher refuses to start; --insecure derives it from the run id
//     ("none" unless set) on a network the user trusts, with a warning.
// LOCKSTEP_STORE_TOKEN is taken on one machine too (a program's own store clients may use it);
// it and --token-file together are an error rather than a silent choice.
#include "run_options.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

#include "lockstep/base/syscall.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "lockstep/tensor/cuda.h"

namespace lockstep::launch {

namespace {

namespace fs = std::filesystem;

// The option's name for a message: the flag, or its variable when the environment gave it.
std::string source_of(const RawRunOptions& raw, const std::string& flag) {
  if (raw.on_command_line.count(flag) == 0) {
    if (auto pet = raw.from_torchrun.find(flag); pet != raw.from_torchrun.end())
      return pet->second + " (torchrun's variable for " + flag + ")";
    const std::string env = env_name_of(flag);
    const char* v = std::getenv(env.c_str());
    if (v != nullptr && *v != '\0') return env + " (the variable for " + flag + ")";
  }
  return flag;
}

// Whether the option was given (on the command line or as its variable), not its default.
bool is_given(const RawRunOptions& raw, const std::string& flag) {
  if (raw.on_command_line.count(flag) != 0) return true;
  const char* v = std::getenv(env_name_of(flag).c_str());
  return v != nullptr && *v != '\0';
}

std::string number_text(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// An integer in [lo, hi] from `text`; `extra` follows the range in the message.
long long parse_int(const std::string& text, const std::string& source, long long lo, long long hi,
                    const std::string& extra = "") {
  long long v = 0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end || v < lo || v > hi) {
    throw UsageError(source + " must be an integer from " + std::to_string(lo) + " to " +
                     std::to_string(hi) + extra + ", got '" + text + "'");
  }
  return v;
}

double parse_seconds(const std::string& text, const std::string& source, double lo, double hi) {
  double v = 0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end || !std::isfinite(v) || v < lo || v > hi) {
    throw UsageError(source + " must be a number of seconds from " + number_text(lo) + " to " +
                     number_text(hi) + ", got '" + text + "'");
  }
  return v;
}

// Note [nproc-per-node words]
// torchrun's words for --nproc-per-node: `gpu` = one worker per visible GPU (an error without
// one), `cpu` = one per CPU, `auto` = one per GPU when there is one, else one per CPU. GPUs are
// counted by the CUDA runtime (0 in a build without CUDA, and with CUDA_VISIBLE_DEVICES empty);
// CPUs are those this process may run on (its affinity mask, which a container or taskset
// narrows; torchrun counts os.cpu_count(), every CPU of the machine).
int count_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

int nproc_from_word(const std::string& word, const std::string& source) {
  auto report = [&](int n, const std::string& why) {
    std::fprintf(stderr, "lockstep run: --nproc-per-node %s = %d (%s)\n", word.c_str(), n,
                 why.c_str());
    return n;
  };
  if (word == "cpu") {
    return report(std::min(count_cpus(), kMaxNprocPerNode), "one per CPU");
  }
  const int gpus = lockstep::cuda::device_count();
  if (gpus > 0) return report(std::min(gpus, kMaxNprocPerNode), "one per GPU");
  if (word == "auto") {
    return report(std::min(count_cpus(), kMaxNprocPerNode), "no GPU found: one per CPU");
  }
  throw UsageError(source + " gpu starts one worker per GPU, but no CUDA GPU is visible (" +
                   (lockstep::cuda::compiled_with_cuda()
                        ? "no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them"
                        : "this build of lockstep has no CUDA support") +
                   "); give a number of workers, or cpu, or auto (one per GPU, else one per CPU)");
}

// PROGRAM as execve needs it: a path with a '/' as given, else the first executable on PATH.
std::string resolve_program(const std::string& program) {
  auto executable = [](const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    if (!executable(program)) {
      std::error_code ec;
      throw UsageError("the program '" + program + "' " +
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
  throw UsageError("the program '" + program + "' was not found on PATH");
}

// Note [Store token]
void choose_token(const RawRunOptions& raw, RunOptions& o) {
  const char* env_token = std::getenv(env::kStoreToken);
  const bool has_env = env_token != nullptr && *env_token != '\0';
  // LOCKSTEP_STORE_TOKEN_FILE, the workers' way to name a token file, names it here too.
  const char* env_file = std::getenv(env::kStoreTokenFile);
  const std::string token_file =
      !raw.token_file.empty() ? raw.token_file : (env_file != nullptr ? env_file : "");
  const std::string file_source = !raw.token_file.empty() ? source_of(raw, "--token-file")
                                                          : std::string(env::kStoreTokenFile);
  if (has_env && !token_file.empty()) {
    throw UsageError(std::string(env::kStoreToken) + " and " + file_source +
                     " both give the store's token; give only one");
  }
  if (has_env) {
    o.token = env_token;
    o.token_source = env::kStoreToken;
  } else if (!token_file.empty()) {
    o.token = read_token_file(token_file);
    o.token_source = raw.token_file.empty()
                         ? std::string(env::kStoreTokenFile) + "=" + token_file
                         : "--token-file " + token_file;
  } else if (o.nnodes == 1) {
    return;  // the agent makes a random one
  } else if (!raw.run_id.empty()) {
    o.token = "lockstep-run-" + o.run_id;
    o.token_source = "--run-id";
  } else if (raw.insecure) {
    o.token = "lockstep-run-" + o.run_id;
    o.token_source = "--insecure";
    std::fprintf(stderr,
                 "lockstep run: warning: --insecure: the store's token is derived from the run id "
                 "'%s', which anyone can guess: whoever reaches node 0's port (%s:%s) can read the "
                 "job's keys and stop it. Use this only on a network you trust.\n",
                 o.run_id.c_str(), o.master_addr.c_str(), raw.master_port.c_str());
  } else {
    throw UsageError(
        "a job on several machines (--nnodes " + std::to_string(o.nnodes) +
        ") needs a secret its machines share, or anyone who reaches node 0's port can read the "
        "job's keys and stop it: set " +
        env::kStoreToken +
        " to the same secret on every machine, or pass --token-file PATH (a file only you can "
        "read, e.g. made with `head -c 32 /dev/urandom | base64 > PATH; chmod 600 PATH`), or "
        "--run-id ID (the token is then derived from it: only as secret as the id); --insecure "
        "runs without a secret on a network you trust");
  }
  // The store refuses a longer token only when the first client says hello; checked here, the
  // message names where the token came from instead of blaming the port. (A token file is
  // held to the same limit by its reader.)
  if (o.token.size() > dist::kMaxStoreTokenBytes) {
    throw UsageError(o.token_source + " holds a token of " + std::to_string(o.token.size()) +
                     " bytes; the store takes at most " +
                     std::to_string(dist::kMaxStoreTokenBytes) +
                     " (a token is a short secret: e.g. 44 characters from `head -c 32 "
                     "/dev/urandom | base64`)");
  }
}

// 127.0.0.0/8, ::1, or ::ffff:127.x.y.z.
bool is_loopback_address(const std::string& a) {
  in_addr v4{};
  if (::inet_pton(AF_INET, a.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (::inet_pton(AF_INET6, a.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

// Note [Store bind address]
// Node 0's store listens only where the job needs it (docs/LAUNCHER.md, "Threat model"):
//   - --standalone: on loopback; nothing outside this machine can connect;
//   - otherwise on the local address toward --master-addr, the address the other machines
//     connect to (the kernel's route to it: the address itself when it is one of this machine's,
//     127.0.0.1 for the default);
//   - on every interface when that address cannot be found, or when on several machines a host
//     name resolves to loopback here (/etc/hosts often maps the machine's own name to 127.0.1.1,
//     while the other machines resolve it to its network address).
// Node 0's agent says which in one line.
StoreBind choose_store_bind(const RunOptions& o) {
  if (o.standalone) return {"127.0.0.1", "--standalone: this machine only"};
  const uint16_t port = o.master_port != 0 ? static_cast<uint16_t>(o.master_port)
                                           : dist::kDefaultStorePort;  // any port finds the route
  std::string local;
  try {
    local = dist::local_address_toward(o.master_addr, port);
  } catch (const Error& e) {
    return {"", "no local address toward --master-addr " + o.master_addr +
                    " was found: " + e.message()};
  }
  if (o.nnodes > 1 && is_loopback_address(local) && !is_loopback_address(o.master_addr) &&
      o.master_addr != "localhost") {
    return {"", "--master-addr " + o.master_addr + " is " + local +
                    " (loopback) on this machine, which the other machines cannot reach"};
  }
  return {local, "the address toward --master-addr " + o.master_addr};
}

// Note [Run id]
// The run id names the job's keys in the store (lockstep/<run-id>/...) and its folder under
// --log-dir (DIR/<run-id>/attempt_<n>/...), so it must be one safe file-name component: '/' or
// '..' would put the logs outside --log-dir and let two jobs' keys overlap. Allowed are the
// characters torchrun's rendezvous ids use in practice (a job name, $SLURM_JOB_ID, $RANDOM):
// letters, digits, '-', '_' and '.', at most kMaxRunIdLength of them, and not '.' or '..'.
void check_run_id(const std::string& id, const std::string& source) {
  const std::string expected = source + " must be 1 to " + std::to_string(kMaxRunIdLength) +
                               " letters, digits, '-', '_' or '.' (not '.' or '..': it names the "
                               "job's folder under --log-dir and its keys in the store)";
  if (id.empty() || id.size() > kMaxRunIdLength) {
    throw UsageError(expected + ", got " + std::to_string(id.size()) + " characters");
  }
  if (id == "." || id == "..") throw UsageError(expected + ", got '" + id + "'");
  for (size_t i = 0; i < id.size(); ++i) {
    const char c = id[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';  // ASCII, whatever the locale
    if (ok) continue;
    char shown[16];
    const auto byte = static_cast<unsigned char>(c);
    if (byte > 0x20 && byte < 0x7f) {
      std::snprintf(shown, sizeof shown, "'%c'", c);
    } else {
      std::snprintf(shown, sizeof shown, "byte 0x%02x", byte);
    }
    throw UsageError(expected + ", got '" + id + "' (" + shown + " at position " +
                     std::to_string(i + 1) + ")");
  }
}

}  // namespace

// Note [torchrun's variables]
// torchrun reads every option from PET_<NAME> as well (its arguments' `env` defaults), and the
// Kubernetes operators that start it (Kubeflow's PyTorchJob and TrainJob) set PET_NNODES,
// PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT in each pod. So a pod
// that runs `lockstep run PROGRAM` where it ran `torchrun PROGRAM` gets the same job: each option
// of the same meaning takes torchrun's variable when neither the command line nor
// LOCKSTEP_<NAME> gives it (PET_RDZV_ID is --run-id). The value becomes LOCKSTEP_<NAME>, so that
// it is checked like any other, and messages name the PET_ variable. LOCKSTEP_<NAME> and PET_
// both set to different values is an error rather than a silent choice.
constexpr std::pair<const char*, const char*> kTorchrunVariables[] = {
    {"--nnodes", "PET_NNODES"},
    {"--nproc-per-node", "PET_NPROC_PER_NODE"},
    {"--node-rank", "PET_NODE_RANK"},
    {"--master-addr", "PET_MASTER_ADDR"},
    {"--master-port", "PET_MASTER_PORT"},
    {"--max-restarts", "PET_MAX_RESTARTS"},
    {"--monitor-interval", "PET_MONITOR_INTERVAL"},
    {"--log-dir", "PET_LOG_DIR"},
    {"--local-ranks-filter", "PET_LOCAL_RANKS_FILTER"},
    {"--run-id", "PET_RDZV_ID"},
};

void adopt_torchrun_env(RawRunOptions& raw) {
  for (const auto& [flag, pet] : kTorchrunVariables) {
    const char* theirs = std::getenv(pet);
    if (theirs == nullptr || *theirs == '\0' || raw.on_command_line.count(flag) != 0) continue;
    const std::string ours_name = env_name_of(flag);
    const char* ours = std::getenv(ours_name.c_str());
    if (ours != nullptr && *ours != '\0') {
      if (std::string(ours) != theirs)
        throw UsageError(ours_name + "=" + ours + " and " + pet + "=" + theirs +
                         " (torchrun's variable for " + flag + ") disagree: unset one, or give " +
                         flag + " on the command line");
      continue;
    }
    ::setenv(ours_name.c_str(), theirs, 1);
    raw.from_torchrun[flag] = pet;
  }
}

std::string env_name_of(const std::string& flag) {
  std::string name = "LOCKSTEP_";
  for (char c : flag.substr(flag.find_first_not_of('-'))) {
    name += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return name;
}

void check_flag_env(const std::string& flag, const std::set<std::string>& on_command_line) {
  if (on_command_line.count(flag) != 0) return;
  const std::string env = env_name_of(flag);
  const char* v = std::getenv(env.c_str());
  if (v == nullptr || *v == '\0') return;
  std::string lower;
  for (const char* c = v; *c; ++c) lower += static_cast<char>(std::tolower(*c));
  for (const char* ok : {"1", "0", "true", "false", "yes", "no", "on", "off"}) {
    if (lower == ok) return;
  }
  throw UsageError(env + " (the variable for " + flag +
                   ") must be 1 or 0 (or true/false, yes/no, on/off), got '" + v + "'");
}

std::string read_token_file(const std::string& path) {
  try {
    return dist::read_store_token_file(path, "--token-file " + path);
  } catch (const Error& e) {
    throw UsageError(e.message());
  }
}

void check_log_dir(const std::string& dir) {
  const std::string what = "--log-dir " + dir;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw UsageError(what + " is not a directory");
  }
  fs::create_directories(dir, ec);
  if (ec) throw UsageError(what + ": cannot create the directory: " + ec.message());
  std::string pattern = (fs::path(dir) / ".lockstep-write-test-XXXXXX").string();
  const int fd = ::mkstemp(pattern.data());
  if (fd < 0) {
    throw UsageError(what + " is not writable: cannot create a file there: " + errno_text(errno));
  }
  ::close(fd);
  ::unlink(pattern.c_str());
}

RunOptions check_run_options(const RawRunOptions& raw, const std::vector<std::string>& command) {
  RunOptions o;
  auto src = [&](const char* flag) { return source_of(raw, flag); };
  if (raw.nproc == "auto" || raw.nproc == "gpu" || raw.nproc == "cpu") {
    o.nproc_per_node = nproc_from_word(raw.nproc, src("--nproc-per-node"));
  } else {
    o.nproc_per_node = static_cast<int>(parse_int(raw.nproc, src("--nproc-per-node"), 1,
                                                  kMaxNprocPerNode, ", or gpu, cpu or auto"));
  }
  // --nnodes N, or MIN:MAX for elastic membership (Note [Membership] in agent_membership.cpp).
  if (const size_t colon = raw.nnodes.find(':'); colon != std::string::npos) {
    const std::string what = src("--nnodes") + " " + raw.nnodes;
    o.min_nodes = static_cast<int>(
        parse_int(raw.nnodes.substr(0, colon), what + ": MIN", 1, kMaxNnodes, " (as in 1:4)"));
    o.nnodes = static_cast<int>(parse_int(raw.nnodes.substr(colon + 1), what + ": MAX", o.min_nodes,
                                          kMaxNnodes, " (at least MIN)"));
    o.elastic = true;
  } else {
    o.nnodes = static_cast<int>(
        parse_int(raw.nnodes, src("--nnodes"), 1, kMaxNnodes, ", or MIN:MAX (elastic)"));
    o.min_nodes = o.nnodes;
  }
  const std::string nnodes_text = o.elastic ? raw.nnodes : std::to_string(o.nnodes);
  // Elastic: a node's name, distinct per machine (node 0 hosts the store); its place in each
  // generation is its order among the members.
  o.node_rank = static_cast<int>(
      o.elastic ? parse_int(raw.node_rank, src("--node-rank"), 0, kMaxNnodes - 1,
                            " (elastic: a name per machine; 0 hosts the store)")
                : parse_int(raw.node_rank, src("--node-rank"), 0, o.nnodes - 1,
                            " (below --nnodes " + nnodes_text + ")"));
  if (raw.standalone && o.nnodes != 1) {
    throw UsageError("--standalone runs on one machine; it cannot be combined with --nnodes " +
                     nnodes_text);
  }
  o.rdzv_last_call_s = parse_seconds(raw.rdzv_last_call, src("--rdzv-last-call"), 0,
                                     kMaxRdzvTimeout);
  o.master_port = static_cast<int>(parse_int(raw.master_port, src("--master-port"), 0, 65535,
                                             " (0: any free port, on one machine)"));
  // Note [Standalone port]
  // --standalone means "a free port on loopback, so that two jobs never clash"; a port the user
  // also gave would be ignored (torchrun ignores it too, silently: --master-port is only for its
  // static rendezvous). The two ask for different things, so the combination is refused rather
  // than one of them dropped; 0 (any free port) is what --standalone does anyway.
  if (raw.standalone && o.master_port != 0 && is_given(raw, "--master-port")) {
    throw UsageError(src("--master-port") + " " + raw.master_port +
                     " cannot be combined with --standalone, which takes a free port on loopback "
                     "(so that two jobs never clash) and would ignore it: drop --master-port for "
                     "a free port, or drop --standalone for the store to listen on port " +
                     raw.master_port + " (on loopback too, with the default --master-addr " +
                     "127.0.0.1)");
  }
  if (o.nnodes > 1 && o.master_port == 0) {
    throw UsageError(src("--master-port") +
                     " 0 (any free port) works only on one machine (--nnodes 1): the other "
                     "machines must know the port; choose one from 1 to 65535");
  }
  o.max_restarts =
      static_cast<int>(parse_int(raw.max_restarts, src("--max-restarts"), 0, kMaxMaxRestarts));
  o.restart_backoff_s = parse_seconds(raw.restart_backoff, src("--restart-backoff"), 0,
                                      kMaxRestartBackoffOption);
  o.monitor_interval_s = parse_seconds(raw.monitor_interval, src("--monitor-interval"),
                                       kMinMonitorInterval, kMaxMonitorInterval);
  o.rdzv_timeout_s =
      parse_seconds(raw.rdzv_timeout, src("--rdzv-timeout"), kMinRdzvTimeout, kMaxRdzvTimeout);
  if (!raw.timeout.empty()) {
    parse_seconds(raw.timeout, src("--timeout"), dist::kMinTimeoutS, dist::kMaxTimeoutS);
    o.timeout = raw.timeout;
  }
  o.stall_timeout_s =
      raw.stall_timeout == "0"
          ? 0
          : parse_seconds(raw.stall_timeout, src("--stall-timeout"), 0.1, kMaxStallTimeout);
  o.node_timeout_s =
      parse_seconds(raw.node_timeout, src("--node-timeout"), kMinNodeTimeout, kMaxNodeTimeout);
  o.stop_grace_s = parse_seconds(raw.stop_grace, src("--stop-grace"), 0, kMaxStopGrace);
  if (raw.tee && raw.log_dir.empty()) throw UsageError("--tee needs --log-dir");
  o.master_addr = raw.standalone ? "127.0.0.1" : raw.master_addr;
  if (o.master_addr.empty()) throw UsageError(src("--master-addr") + " must not be empty");
  o.standalone = raw.standalone;
  o.output.log_dir = raw.log_dir;
  o.output.tee = raw.tee;
  if (!raw.local_ranks_filter.empty()) {
    std::stringstream ss(raw.local_ranks_filter);
    for (std::string item; std::getline(ss, item, ',');) {
      long long r = -1;
      const auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), r);
      if (item.empty() || ec != std::errc() || p != item.data() + item.size() || r < 0 ||
          r >= o.nproc_per_node) {
        throw UsageError(src("--local-ranks-filter") + " expects local ranks from 0 to " +
                         std::to_string(o.nproc_per_node - 1) + " separated by commas, got '" +
                         raw.local_ranks_filter + "'");
      }
      o.output.local_ranks_filter.push_back(static_cast<int>(r));
    }
  }
  // torchrun: "none" unless given; --standalone gets a fresh id of its own.
  o.run_id = !raw.run_id.empty() ? raw.run_id
             : raw.standalone    ? "standalone-" + std::to_string(::getpid())
                                 : "none";
  check_run_id(o.run_id, src("--run-id"));
  choose_token(raw, o);
  if (o.node_rank == 0) o.store_bind = choose_store_bind(o);
  if (command.empty()) {
    throw UsageError("no program given: lockstep run [options] PROGRAM [ARGS...]");
  }
  o.program = resolve_program(command.front());
  o.args.assign(command.begin() + 1, command.end());
  // Last: it creates the directory, which a bad option found above should not leave behind.
  if (!o.output.log_dir.empty()) check_log_dir(o.output.log_dir);
  return o;
}

}  // namespace lockstep::launch
