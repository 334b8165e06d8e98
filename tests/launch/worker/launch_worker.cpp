// The program that tests/launch starts under `lockstep run`: argv[1] picks what a worker does
// (report its environment, fail, die by a signal, sleep, flood its output, redraw a progress
// line with '\r', throw, train with DDP, skip a collective, allocate memory, be killed on cue and
// then train after the restart, take a while to save when stopped).
//
// With LAUNCH_TEST_PID_DIR set, every worker first records its pid and the pid of one grandchild
// (`sleep 300`, in the worker's process group) as <dir>/<pid>.pid, so a test can check that the
// launcher left nothing running. Ranks that are meant to fail wait until every local worker has
// recorded its pids, so that the test knows how many processes to look for.
#include <signal.h>
#include <spawn.h>
#include <unistd.h>

extern char** environ;

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "distributed/ddp_helpers.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/error_file.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/preemption.h"
#include "lockstep/distributed/shm/process_group_shm.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "lockstep/lockstep.h"

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

constexpr const char* kPidDirEnv = "LAUNCH_TEST_PID_DIR";
// How long a failing rank waits before failing, so that the others are up and sleeping.
constexpr auto kFailDelay = 300ms;
constexpr auto kPidWait = 20s;
// The variables `lockstep run` sets (or passes through) for a worker.
constexpr const char* kReportedVars[] = {"RANK",
                                         "LOCAL_RANK",
                                         "WORLD_SIZE",
                                         "LOCAL_WORLD_SIZE",
                                         "GROUP_RANK",
                                         "MASTER_ADDR",
                                         "MASTER_PORT",
                                         "LOCKSTEP_RESTART_COUNT",
                                         "LOCKSTEP_MAX_RESTARTS",
                                         "LOCKSTEP_RUN_ID",
                                         "OMP_NUM_THREADS",
                                         "LOCKSTEP_USE_AGENT_STORE",
                                         "LOCKSTEP_STORE_TOKEN",
                                         "LOCKSTEP_ERROR_FILE",
                                         "LOCKSTEP_TIMEOUT"};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

// Writes `text` to `path` through a temporary name, so a reader never sees half a file.
void write_file(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  std::ofstream(tmp) << text;
  fs::rename(tmp, path);
}

void record_pid(const fs::path& dir, pid_t pid) {
  write_file(dir / (std::to_string(pid) + ".pid"), std::to_string(pid) + "\n");
}

// Records this process and a `sleep 300` grandchild when LAUNCH_TEST_PID_DIR is set.
void record_pids() {
  const char* dir = std::getenv(kPidDirEnv);
  if (dir == nullptr) return;
  pid_t child = 0;
  char sleep_name[] = "sleep", seconds[] = "300";
  char* argv[] = {sleep_name, seconds, nullptr};
  if (::posix_spawnp(&child, "sleep", nullptr, nullptr, argv, environ) != 0) {
    std::fprintf(stderr, "launch_worker: cannot start sleep\n");
    std::exit(90);
  }
  record_pid(dir, child);
  record_pid(dir, ::getpid());
}

// Waits until every local worker recorded its two pids (or kPidWait passed).
void wait_for_all_pids() {
  const char* dir = std::getenv(kPidDirEnv);
  if (dir == nullptr) return;
  const auto want = static_cast<size_t>(2 * env_int("LOCAL_WORLD_SIZE", 1));
  const auto deadline = std::chrono::steady_clock::now() + kPidWait;
  while (std::chrono::steady_clock::now() < deadline) {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir)) n += e.path().extension() == ".pid";
    if (n >= want) return;
    std::this_thread::sleep_for(10ms);
  }
}

// Ranks that are not the one failing wait here to be stopped by the launcher.
int sleep_then_fail(std::chrono::seconds s) {
  std::this_thread::sleep_for(s);
  std::fprintf(stderr, "launch_worker: rank %d was not stopped within %lld s\n",
               env_int("RANK", -1), static_cast<long long>(s.count()));
  return 91;
}

// A worker that saves when stopped (Note [Preemption]): SIGTERM is caught, and the "save" takes
// `save_s` seconds before the worker exits 143.
int slow_stop(double save_s) {
  lockstep::dist::StopOnSignal stop;
  std::printf("rank %d ready\n", env_int("RANK", -1));
  std::fflush(stdout);
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (stop.caught() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(10ms);
  if (stop.caught() == 0) return sleep_then_fail(0s);
  std::this_thread::sleep_for(std::chrono::duration<double>(save_s));
  std::printf("rank %d saved after %s\n", env_int("RANK", -1),
              lockstep::dist::signal_name(stop.caught()).c_str());
  std::fflush(stdout);
  return lockstep::dist::StopOnSignal::exit_code(stop.caught());
}

int report_env(const fs::path& out_dir, int argc, char** argv) {
  const int rank = env_int("RANK", -1);
  std::string text;
  for (const char* name : kReportedVars) {
    if (const char* v = std::getenv(name)) text += std::string(name) + "=" + v + "\n";
  }
  std::string args;
  for (int i = 3; i < argc; ++i) args += (i > 3 ? " " : "") + std::string(argv[i]);
  text += "ARGS=" + args + "\n";
  write_file(out_dir / ("rank" + std::to_string(rank) + ".env"), text);
  std::printf("hello from rank %d\n", rank);
  std::fprintf(stderr, "env of rank %d written\n", rank);
  return 0;
}

// Elastic tests: reports the environment as OUT/gen<LOCKSTEP_RESTART_COUNT>/rank<RANK>.env, then
// ends (0) in a world of `want` ranks (LAUNCH_TEST_ELASTIC_WANT, where set, instead: every node
// of a job runs the same arguments, Note [Job signature]), and in any other waits to be stopped
// for a new generation; with LAUNCH_TEST_ELASTIC_FAIL=1 it fails (3) at once instead, and so it
// does in generation G with LAUNCH_TEST_ELASTIC_FAIL_IN_GEN=G; with
// LAUNCH_TEST_ELASTIC_STAY_IN_GEN=G it waits to be stopped in generation G whatever the world.
int elastic(const fs::path& out, int want) {
  want = env_int("LAUNCH_TEST_ELASTIC_WANT", want);
  const fs::path dir = out / ("gen" + std::to_string(env_int("LOCKSTEP_RESTART_COUNT", -1)));
  fs::create_directories(dir);
  char* argv[] = {nullptr, nullptr, nullptr};
  report_env(dir, 3, argv);
  std::fflush(stdout);
  if (env_int("LAUNCH_TEST_ELASTIC_FAIL", 0) != 0) {  // a machine that cannot run the job
    std::fprintf(stderr, "cannot open the data set on this machine\n");
    return 3;
  }
  if (env_int("LAUNCH_TEST_ELASTIC_FAIL_IN_GEN", -1) ==
      env_int("LOCKSTEP_RESTART_COUNT", -1)) {  // a failure that counts as a restart
    std::fprintf(stderr, "fails in this generation\n");
    return 3;
  }
  const bool stay = env_int("LAUNCH_TEST_ELASTIC_STAY_IN_GEN", -1) ==
                   env_int("LOCKSTEP_RESTART_COUNT", -1);  // waits to be stopped there
  if (env_int("WORLD_SIZE", -1) == want && !stay) return 0;
  return sleep_then_fail(60s);
}

// Rank 1 ends (0) once it joined. Rank 0 waits until the launcher has reaped rank 1, then looks
// for the join's `error` key for a while (Note [A rank that leaves before joining]: the launcher
// must not write it for a rank that joined): it fails (4) naming the key's text if it appears.
int leave_after_join(int rank) {
  lockstep::dist::install_error_handler();
  lockstep::dist::init_process_group();
  lockstep::dist::TCPStoreOptions so;
  so.host = std::getenv("MASTER_ADDR");
  so.port = static_cast<uint16_t>(env_int("MASTER_PORT", 0));
  so.wait_for_workers = false;
  lockstep::dist::TCPStore store(so);  // the launcher's: the token is LOCKSTEP_STORE_TOKEN
  const std::string world = std::string("lockstep/") + std::getenv("LOCKSTEP_RUN_ID") + "/gen" +
                            std::to_string(env_int("LOCKSTEP_RESTART_COUNT", -1)) + "/";
  if (rank == 1) {
    store.set(world + "test/leaver_pid", std::to_string(::getpid()));
    return 0;
  }
  const pid_t leaver = std::stoi(store.get_string(world + "test/leaver_pid"));
  const auto reaped_by = std::chrono::steady_clock::now() + 60s;
  while (fs::exists("/proc/" + std::to_string(leaver)) &&
         std::chrono::steady_clock::now() < reaped_by) {
    std::this_thread::sleep_for(10ms);
  }
  // The launcher looks right after it reaps; two seconds is far more than it takes.
  const auto look_until = std::chrono::steady_clock::now() + 2s;
  while (std::chrono::steady_clock::now() < look_until) {
    if (store.check({world + "error"})) {
      std::printf("the join's error key was written: %s\n",
                  store.get_string(world + "error").c_str());
      return 4;
    }
    std::this_thread::sleep_for(20ms);
  }
  std::printf("rank 0 done\n");
  return 0;
}

// N lines of `R:i:` and 200 copies of the digit R, through stdio's buffer (which splits writes
// at arbitrary points, not at line ends).
int print_lines(int n) {
  const int rank = env_int("RANK", 0);
  const std::string body(200, static_cast<char>('0' + rank % 10));
  for (int i = 0; i < n; ++i) std::printf("%d:%d:%s\n", rank, i, body.c_str());
  return 0;
}

// A progress bar's way of writing, each piece with its own write(2) (stdio would hold the pieces
// until a newline): "a\rb\n", "bar 1\r", then (once `go` exists, when it is not "-": the test
// saw "bar 1" arrive) "bar 2\r", "done\n", "x\r\n" and "tail\r" without a newline at exit.
int redraw(const std::string& go) {
  auto put = [](const std::string& s) {
    if (::write(1, s.data(), s.size()) != static_cast<ssize_t>(s.size())) std::exit(93);
  };
  const char* tty = std::getenv("LOCKSTEP_STDOUT_IS_TTY");
  put(std::string("tty=") + (tty != nullptr ? tty : "none") + "\n");
  put("a\rb\n");
  put("bar 1\r");
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (go != "-" && !fs::exists(go) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  put("bar 2\r");
  put("done\n");
  put("x\r\n");
  put("tail\r");
  return 0;
}

// FNV-1a over the bytes of every parameter.
uint64_t params_hash(const lockstep::nn::Module& m) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : m.parameters()) {
    const lockstep::Tensor c = p.contiguous();
    const auto* b = static_cast<const uint8_t*>(c.data_ptr());
    const int64_t bytes = c.numel() * static_cast<int64_t>(lockstep::dtype_size(c.dtype()));
    for (int64_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  return h;
}

// Trains the DDP test MLP for `steps` steps on this rank's own data and writes its hash.
int train_ddp(const fs::path& out_dir, int steps) {
  using namespace lockstep;
  using namespace lockstep::testing::ddp;
  constexpr int64_t kBatch = 8;
  dist::InitOptions io;
  io.timeout = 60s;
  auto pg = dist::init_process_group(io);
  const int r = dist::rank();
  auto model = std::make_shared<dist::DistributedDataParallel>(mlp(100 + r), pg);
  optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  const Data data = make_data(steps * kBatch, 17 + r);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    cross_entropy(model->forward(data.x.narrow(0, s * kBatch, kBatch)),
                  data.y.narrow(0, s * kBatch, kBatch))
        .backward();
    opt.step();
  }
  write_file(out_dir / ("rank" + std::to_string(r) + ".hash"),
             std::to_string(params_hash(*model->module())) + "\n");
  dist::destroy_process_group();
  std::printf("rank %d trained %d steps\n", r, steps);
  return 0;
}

// `lines` lines of `bytes` characters each, then a last short line, then exit code 3.
int spew_then_fail(int lines, int bytes) {
  const int rank = env_int("RANK", 0);
  const std::string body(static_cast<size_t>(bytes), 'x');
  for (int i = 0; i < lines; ++i) std::printf("spew %d:%d:%s\n", rank, i, body.c_str());
  std::printf("final words of rank %d\n", rank);
  std::fflush(stdout);
  return 3;
}

// First attempt: rank 1 SIGKILLs itself once `go` exists (the test has its connections to the
// store open by then); the others wait to be stopped. After the restart: DDP training, which
// needs the store, for `steps` steps.
int killed_then_train(const fs::path& go, const fs::path& out_dir, int steps) {
  if (env_int("LOCKSTEP_RESTART_COUNT", -1) > 0) return train_ddp(out_dir, steps);
  if (env_int("RANK", -1) != 1) return sleep_then_fail(120s);
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!fs::exists(go) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  std::printf("rank 1 kills itself\n");
  std::fflush(stdout);
  ::raise(SIGKILL);
  return 92;
}

// Rank 1 never issues the all_reduce that rank 0 waits in; the program sets no timeout, so
// LOCKSTEP_TIMEOUT (`lockstep run --timeout`) decides when rank 0 fails. Rank 0 then says how
// long it waited before rethrowing (the error reaches the launcher's summary).
int skip_collective() {
  lockstep::dist::install_error_handler();
  auto pg = lockstep::dist::init_process_group();
  if (pg->rank() == 1) return sleep_then_fail(60s);
  lockstep::Tensor x = lockstep::full({4}, 1.0, lockstep::kFloat32);
  const auto start = std::chrono::steady_clock::now();
  try {
    pg->all_reduce(x)->wait();
  } catch (const std::exception&) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
    std::printf("rank 0 waited %lld ms\n", static_cast<long long>(ms));
    std::fflush(stdout);
    throw;
  }
  return 95;  // the all_reduce cannot succeed without rank 1
}

// The hangs the diagnosis names, each under the launcher's stall watch and verdict (Note [Verdict]):
// "stop": rank 1 stops itself (SIGSTOP) after the first all_reduce, rank 0 goes on to the
// second; "mismatch-size": rank 0 all-reduces 1024 elements, rank 1 512; "mismatch-op": rank 1
// broadcasts instead; "die": rank 1 SIGKILLs itself a moment after rank 0 issued its all_reduce.
int hang(const std::string& how) {
  lockstep::dist::install_error_handler();
  auto pg = lockstep::dist::init_process_group();
  const int rank = pg->rank();
  lockstep::Tensor x = lockstep::full({1024}, 1.0, lockstep::kFloat32);
  if (how == "stop") {
    pg->all_reduce(x)->wait();
    if (rank == 1) ::raise(SIGSTOP);
    pg->all_reduce(x)->wait();
    return 95;  // rank 0 cannot get here while rank 1 is stopped
  }
  if (how == "mismatch-size") {
    lockstep::Tensor y = rank == 0 ? x : lockstep::full({512}, 1.0, lockstep::kFloat32);
    pg->all_reduce(y)->wait();
    return 95;
  }
  if (how == "mismatch-op") {
    if (rank == 0) pg->all_reduce(x)->wait();
    if (rank == 1) pg->broadcast(x)->wait();
    return 95;
  }
  if (how == "die") {
    if (rank == 1) {
      std::this_thread::sleep_for(1s);
      ::raise(SIGKILL);
    }
    pg->all_reduce(x)->wait();
    return 95;
  }
  std::fprintf(stderr, "launch_worker: unknown hang %s\n", how.c_str());
  return 2;
}

// A job stopped while its shm group is being built: rank 0 creates the group's segment and waits
// for rank 1 to map it; rank 1 only says it is on rank 0's machine (so that rank 0 goes on) and
// sleeps. The test stops the launcher then, and looks for the segment in /dev/shm.
int shm_setup() {
  lockstep::dist::register_backend(
      "shm_setup", [](const lockstep::dist::BackendConfig& c) -> lockstep::dist::ProcessGroupPtr {
        if (c.rank == 0) return std::make_shared<lockstep::dist::ProcessGroupShm>(c);
        c.store->wait({"shm/host/0"}, std::chrono::seconds(60));
        c.store->set("shm/host/1", c.store->get_string("shm/host/0"));
        std::this_thread::sleep_for(std::chrono::seconds(120));
        throw std::runtime_error("rank 1 was not stopped");
      });
  lockstep::dist::InitOptions o;
  o.backend = "shm_setup";
  o.timeout = std::chrono::seconds(120);
  lockstep::dist::init_process_group(o);
  return 95;  // never: rank 1 does not map the segment
}

// Rank `who` allocates and touches `mib` MiB, then "kill": SIGKILLs itself; "hold": sleeps (for
// the out-of-memory killer to end it). The others wait to be stopped.
int alloc(int mib, const std::string& then, int who) {
  if (env_int("RANK", -1) != who) return sleep_then_fail(60s);
  constexpr size_t kChunk = 1 << 20;
  std::vector<std::unique_ptr<char[]>> chunks;
  for (int i = 0; i < mib; ++i) {
    chunks.emplace_back(new char[kChunk]);
    std::memset(chunks.back().get(), i + 1, kChunk);  // touched: resident, not only reserved
  }
  std::printf("rank %d touched %d MiB\n", who, mib);
  std::fflush(stdout);
  if (then == "kill") ::raise(SIGKILL);
  return sleep_then_fail(60s);
}

int run(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: launch_worker MODE [ARGS...]\n");
    return 64;
  }
  const std::string mode = argv[1];
  const int rank = env_int("RANK", -1);
  record_pids();
  if (mode == "env" && argc >= 3) return report_env(argv[2], argc, argv);
  if (mode == "exit" && argc >= 3) {
    const int failing = argc >= 4 ? std::atoi(argv[3]) : 1;
    if (rank != failing) return sleep_then_fail(60s);
    wait_for_all_pids();
    std::this_thread::sleep_for(kFailDelay);
    std::printf("some output of rank %d\nlast words of rank %d (stdout)\n", rank, rank);
    std::fprintf(stderr, "last words of rank %d (stderr)\n", rank);
    std::fflush(stdout);
    return std::atoi(argv[2]);
  }
  if (mode == "sigkill") {
    if (rank != 1) return sleep_then_fail(60s);
    wait_for_all_pids();
    std::this_thread::sleep_for(kFailDelay);
    std::printf("rank %d kills itself\n", rank);
    std::fflush(stdout);
    ::raise(SIGKILL);
    return 92;
  }
  if (mode == "fail-first") {
    const int restart = env_int("LOCKSTEP_RESTART_COUNT", -1);
    if (restart == 0) {
      if (rank != 0) return sleep_then_fail(60s);
      std::this_thread::sleep_for(kFailDelay);
      std::printf("rank %d fails on the first attempt\n", rank);
      return 7;
    }
    std::printf("restart count %d\n", restart);
    return 0;
  }
  if (mode == "sleep") return sleep_then_fail(120s);
  if (mode == "slow-stop" && argc >= 3) return slow_stop(std::atof(argv[2]));
  if (mode == "leave-before-join") {
    // Rank 1 ends (0) without joining; rank 0 joins with the default rendezvous timeout (300 s).
    lockstep::dist::install_error_handler();
    if (rank == 1) return 0;
    lockstep::dist::init_process_group();
    std::printf("rank 0 done\n");
    return 0;
  }
  if (mode == "leave-after-join") return leave_after_join(rank);
  if (mode == "shm-setup") return shm_setup();
  if (mode == "elastic" && argc >= 4) return elastic(argv[2], std::atoi(argv[3]));
  if (mode == "lines" && argc >= 3) return print_lines(std::atoi(argv[2]));
  if (mode == "redraw" && argc >= 3) return redraw(argv[2]);
  if (mode == "throw") {
    lockstep::dist::install_error_handler();
    if (rank != 1) return sleep_then_fail(60s);
    wait_for_all_pids();
    std::this_thread::sleep_for(kFailDelay);
    throw std::runtime_error("boom from rank " + std::to_string(rank));
  }
  if (mode == "skip-collective") return skip_collective();
  if (mode == "hang" && argc >= 3) return hang(argv[2]);
  if (mode == "alloc" && argc >= 5) return alloc(std::atoi(argv[2]), argv[3], std::atoi(argv[4]));
  if (mode == "ddp" && argc >= 4) return train_ddp(argv[2], std::atoi(argv[3]));
  if (mode == "spew" && argc >= 4) return spew_then_fail(std::atoi(argv[2]), std::atoi(argv[3]));
  if (mode == "killed-then-train" && argc >= 5) {
    return killed_then_train(argv[2], argv[3], std::atoi(argv[4]));
  }
  std::fprintf(stderr, "launch_worker: unknown mode or missing arguments: %s\n", mode.c_str());
  return 64;
}

}  // namespace

int main(int argc, char** argv) { return run(argc, argv); }
