// The shm backend: ranks as threads over a HashStore (every collective, pieces, mismatches,
// timeouts, the same-machine check, against Gloo), then as processes (the sweep, a SIGKILLed
// peer, nothing left in /dev/shm, DDP over shm against DDP over Gloo).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "distributed/collective_sweep.h"
#include "distributed/ddp_helpers.h"
#include "distributed/spawn_ranks.h"
#include "distributed/thread_ranks.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/shm/process_group_shm.h"
#include "lockstep/distributed/store/hash_store.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;
using lockstep::testing::exited_zero;
using lockstep::testing::Result;

namespace {

// How every segment's name begins (in /dev/shm, without the '/').
constexpr const char* kSegmentPrefix = "lockstep-shm-";

// A slot that no test size is a multiple of, small enough that "several MiB" is many pieces.
constexpr int64_t kOddSlotBytes = 65536 - 64;

// Runs body(rank, group) on `world` threads, each with its own ProcessGroupShm over one
// HashStore; returns each rank's exception message ("" on success).
std::vector<std::string> run_shm_threads(int world,
                                         const std::function<void(int, ProcessGroupShm&)>& body,
                                         ShmOptions so = {},
                                         std::chrono::milliseconds timeout = 60s,
                                         std::shared_ptr<Store> store = nullptr) {
  if (!store) store = std::make_shared<HashStore>(30s);
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        BackendConfig c;
        c.store = store;
        c.rank = r;
        c.size = world;
        c.timeout = timeout;
        ProcessGroupShm pg(c, so);
        body(r, pg);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

bool in_dev_shm(const std::string& prefix) {
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return false;
  bool found = false;
  while (dirent* e = ::readdir(d)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) found = true;
  }
  ::closedir(d);
  return found;
}

class ShmThreads : public ::testing::TestWithParam<int> {};

TEST_P(ShmThreads, EveryCollectiveEveryDtypeMatchesReferenceInManyPieces) {
  const auto errors = run_shm_threads(
      GetParam(), [](int, ProcessGroupShm& pg) { lockstep::testing::run_collective_sweep(pg); },
      {.slot_bytes = kOddSlotBytes});
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmThreads, ::testing::Values(2, 3, 4));

TEST(ShmThreadsDefaultSlot, EveryCollectiveMatchesReference) {
  const auto errors = run_shm_threads(
      2, [](int, ProcessGroupShm& pg) { lockstep::testing::run_collective_sweep(pg); });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Random values, whose sums round: shm's result is bit-identical on every rank, bit-identical to
// Gloo's with two ranks (one addition, the same in any order) and equal within rounding with
// more (bf16 within two of its steps: shm rounds once, Gloo after every addition).
TEST(ShmThreads, AllReduceAgreesWithGlooAndIsIdenticalOnEveryRank) {
  constexpr int64_t n = 3 * 65536 + 13;  // several slots of kOddSlotBytes, not a multiple
  for (int world : {2, 3}) {
    for (DType t : {kFloat32, kFloat64, kBFloat16}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::product}) {
        auto input = [&](int r) {
          Generator gen(1000 + r);
          return randn({n}, gen).to(t);
        };
        std::vector<std::vector<double>> shm(world), gloo(world);
        auto shm_errors = run_shm_threads(world,
                                          [&](int r, ProcessGroupShm& pg) {
                                            Tensor x = input(r);
                                            pg.all_reduce(x, {.op = op})->wait();
                                            shm[r] = x.to_vector<double>();
                                          },
                                          {.slot_bytes = kOddSlotBytes});
        auto gloo_errors = lockstep::testing::run_ranks(world, [&](int r, ProcessGroupPtr pg) {
          Tensor x = input(r);
          pg->all_reduce(x, {.op = op})->wait();
          gloo[r] = x.to_vector<double>();
        });
        const std::string what = std::string(dtype_name(t)) + " " +
                                 std::string(reduce_op_name(op)) + " over " + std::to_string(world);
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(shm_errors[r], "") << what;
          ASSERT_EQ(gloo_errors[r], "") << what;
          ASSERT_EQ(shm[r], shm[0]) << what << ": rank " << r << " differs from rank 0";
        }
        const double tol = world == 2 ? 0.0 : (t == kBFloat16 ? 3e-2 : 1e-5);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_LE(std::abs(shm[0][i] - gloo[0][i]), tol * std::max(1.0, std::abs(gloo[0][i])))
              << what << ": element " << i << " is " << shm[0][i] << " over shm, " << gloo[0][i]
              << " over gloo";
        }
      }
    }
  }
}

// reduce_scatter reduces each chunk as all_reduce does (rank order), for every op and dtype: rank
// r's output is bit-identical to chunk r of the all_reduce of the same inputs.
TEST(ShmThreads, ReduceScatterEqualsTheChunkOfAllReduceForEveryOpAndDtype) {
  constexpr int64_t m = 70001;  // per rank; several pieces of kOddSlotBytes / 3 ranks
  const auto errors = run_shm_threads(
      3,
      [](int r, ProcessGroupShm& pg) {
        for (DType t : lockstep::testing::kCollectiveDTypes) {
          std::vector<ReduceOp> ops = {ReduceOp::sum, ReduceOp::min, ReduceOp::max,
                                       ReduceOp::product};
          if (is_floating(t)) ops.push_back(ReduceOp::avg);
          for (ReduceOp op : ops) {
            Generator gen(77 + r);
            Tensor in = (randn({3 * m}, gen) * 3.0).to(t);
            Tensor out = full({m}, 99.0, t);
            pg.reduce_scatter(out, in, {.op = op})->wait();
            Tensor all = in.clone();
            pg.all_reduce(all, {.op = op})->wait();
            LS_CHECK(out.to_vector<double>() == all.narrow(0, r * m, m).to_vector<double>(),
                     dtype_name(t), " ", reduce_op_name(op),
                     ": reduce_scatter differs from all_reduce's chunk");
          }
        }
      },
      {.slot_bytes = kOddSlotBytes});
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(ShmThreads, MismatchesFailEveryRankNamingBothAndTheGroupGoesOn) {
  const auto errors = run_shm_threads(
      3, [](int r, ProcessGroupShm& pg) { lockstep::testing::run_mismatch_round(r, pg); });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(ShmThreads, ATimeoutFailsThisRankAndPoisonsTheGroupForEveryRank) {
  std::atomic<bool> rank0_failed{false};
  const auto errors = run_shm_threads(
      2,
      [&](int r, ProcessGroupShm& pg) {
        Tensor x = full({100}, 1.0, kFloat32);
        if (r == 0) {
          try {
            pg.all_reduce(x)->wait();
            LS_THROW("all_reduce succeeded without rank 1");
          } catch (const Error& e) {
            rank0_failed = true;
            LS_CHECK(std::string(e.what()).find("timed out after 300 ms waiting for rank 1") !=
                         std::string::npos,
                     e.what());
          }
          try {
            pg.barrier()->wait();
            LS_THROW("a poisoned group ran a barrier");
          } catch (const Error& e) {
            LS_CHECK(std::string(e.what()).find("this group failed earlier (all_reduce #1") !=
                         std::string::npos,
                     e.what());
          }
        } else {
          while (!rank0_failed) std::this_thread::sleep_for(1ms);
          try {
            pg.all_reduce(x)->wait();
            LS_THROW("all_reduce succeeded after rank 0 gave up");
          } catch (const Error& e) {
            LS_CHECK(std::string(e.what()).find("rank 0 failed first") != std::string::npos,
                     e.what());
          }
        }
      },
      {}, 300ms);
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Forwards to a HashStore but makes rank 2's machine identity say "b".
class OtherHostStore : public Store {
 public:
  OtherHostStore() : Store(30s) {}

 protected:
  void do_set(const std::string& key, const Bytes& value) override {
    inner_.set(key, key == "shm/host/2" ? to_bytes("b") : value);
  }
  Bytes do_get(const std::string& key) override { return inner_.get(key); }
  int64_t do_add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }
  Bytes do_compare_set(const std::string& key, const Bytes& expected,
                       const Bytes& desired) override {
    return inner_.compare_set(key, expected, desired);
  }
  bool do_check(const std::vector<std::string>& keys) override { return inner_.check(keys); }
  void do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds t) override {
    inner_.wait(keys, t);
  }
  bool do_delete_key(const std::string& key) override { return inner_.delete_key(key); }
  int64_t do_num_keys() override { return inner_.num_keys(); }

 private:
  HashStore inner_{30s};
};

TEST(ShmThreads, RanksOnTwoMachinesFailEveryRankNamingTheOtherHost) {
  const auto errors = run_shm_threads(
      3, [](int, ProcessGroupShm&) {}, {}, 60s, std::make_shared<OtherHostStore>());
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("shm needs every rank on one machine: rank 2 is "
                                                "on host b"))
        << "rank " << r;
  }
}

TEST(ShmThreads, ARankThatNeverComesFailsTheConstructionInTime) {
  BackendConfig c;
  c.store = std::make_shared<HashStore>(30s);
  c.rank = 0;
  c.size = 2;
  c.timeout = 200ms;
  try {
    ProcessGroupShm pg(c);
    FAIL() << "a group of 2 was built by 1 rank";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("rank 0/2 (shm): building the shm group, waiting "
                                               "for every rank's machine identity"));
  }
}

TEST(ShmThreads, BadSlotSizeIsAnError) {
  const auto errors = run_shm_threads(2, [](int, ProcessGroupShm&) {}, {.slot_bytes = 1000});
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("slot_bytes must be a multiple of 64"));
    EXPECT_THAT(e, ::testing::HasSubstr("got 1000"));
  }
}

TEST(ShmThreads, TheSegmentIsUnlinkedOnceEveryRankMappedIt) {
  std::vector<std::string> names(2);
  const auto errors = run_shm_threads(2, [&](int r, ProcessGroupShm& pg) {
    names[r] = pg.segment_name();
    pg.barrier()->wait();
    LS_CHECK(!in_dev_shm(names[r].substr(1)), names[r], " is still in /dev/shm");
    LS_CHECK(names[r].rfind("/lockstep-shm-", 0) == 0, "segment name ", names[r]);
  });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_EQ(names[0], names[1]);
}

// Ranks on one machine with no backend named: "auto" builds an shm group.
TEST(ShmBackend, IsWhatTheDefaultBuildsForRanksOnOneMachine) {
  EXPECT_TRUE(has_backend("shm"));
  EXPECT_EQ(connect_world(DistEnv{}, InitOptions{}).backend, "auto");
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::string> errors(3), backends(3);
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r) {
    ts.emplace_back([&, r] {
      try {
        BackendConfig c;
        c.store = store;
        c.rank = r;
        c.size = 3;
        c.timeout = 30s;
        auto pg = create_process_group(kDefaultBackend, c);
        backends[r] = pg->backend();
        Tensor x = full({5}, static_cast<double>(r), kFloat32);
        pg->all_reduce(x)->wait();
        LS_CHECK(x.to_vector<double>() == std::vector<double>(5, 3.0), "sum over auto's group");
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(backends[r], "shm") << "rank " << r;
  }
}

// ---- Ranks as processes ----

constexpr const char* kModeEnv = "LOCKSTEP_TEST_SHM_MODE";
constexpr const char* kReportEnv = "LOCKSTEP_TEST_SHM_REPORT";
constexpr auto kHangGuard = 240s;

void write_report(const std::string& text) {
  if (const char* path = std::getenv(kReportEnv)) std::ofstream(path) << text;
}

// Every worker's segments carry this run id, so the parent can look for leftovers of its own.
std::string run_id_of(pid_t parent) { return "shmtest" + std::to_string(parent); }

std::string params_text(const nn::Module& m) {
  std::ostringstream out;
  out.precision(17);
  for (const auto& p : m.parameters()) {
    for (double v : p.to_vector<double>()) out << v << " ";
  }
  return out.str();
}

// DDP as ddp_process_test.cpp trains it, over `backend`; reports the parameters.
int ddp_worker(const std::string& backend) {
  using namespace lockstep::testing::ddp;
  constexpr int kSteps = 5;
  constexpr int64_t kBatch = 8;
  InitOptions io;
  io.timeout = 60s;
  io.backend = backend;
  auto pg = init_process_group(io);
  LS_CHECK(pg->backend() == backend, "backend ", pg->backend());
  const int r = rank(), world = world_size();
  const Data data = make_data(kSteps * kBatch, 17);
  DDPOptions o;
  o.first_bucket_bytes = 512;
  o.bucket_bytes = 2048;
  auto ddp = std::make_shared<DistributedDataParallel>(mlp(100 + r), pg, o);
  optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3});
  for (int s = 0; s < kSteps; ++s) {
    Data step{data.x.narrow(0, s * kBatch, kBatch), data.y.narrow(0, s * kBatch, kBatch)};
    Data mine = shard(step, r, world);
    opt.zero_grad();
    cross_entropy(ddp->forward(mine.x), mine.y).backward();
    opt.step();
  }
  write_report(params_text(*ddp->module()));
  destroy_process_group();
  return 0;
}

// The first entry of /dev/shm that begins with `prefix` ("" if none within 60 s).
std::string await_dev_shm(const std::string& prefix) {
  for (auto until = std::chrono::steady_clock::now() + 60s; std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(5ms)) {
    DIR* d = ::opendir("/dev/shm");
    if (d == nullptr) return "";
    std::string found;
    while (dirent* e = ::readdir(d)) {
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) found = e->d_name;
    }
    ::closedir(d);
    if (!found.empty()) return found;
  }
  return "";
}

// A job killed while its shm group is being built: rank 0 creates the segment and waits for rank
// 1 to map it; rank 1 instead kills rank 0 (whose pid the segment's name holds) as a launcher's
// SIGKILL would, reports the name and leaves.
ProcessGroupPtr killed_in_setup(const BackendConfig& c) {
  if (c.rank == 0) return std::make_shared<ProcessGroupShm>(c);
  // Rank 1 says it is on rank 0's machine, so that rank 0 goes on to create the segment.
  c.store->wait({"shm/host/0"}, 60s);
  c.store->set("shm/host/1", c.store->get_string("shm/host/0"));
  const std::string name = await_dev_shm(std::string(kSegmentPrefix) + run_id_of(::getppid()) + "-");
  LS_CHECK(!name.empty(), "rank 0 made no segment");
  // lockstep-shm-<run>-<pid namespace>-<pid>-<nonce>
  std::vector<std::string> fields;
  std::stringstream in(name);
  for (std::string f; std::getline(in, f, '-');) fields.push_back(f);
  LS_CHECK(fields.size() == 6, "segment name ", name);
  ::kill(std::stoi(fields[4]), SIGKILL);
  write_report(name);
  std::_Exit(0);
}

int worker_main(const std::string& mode) {
  try {
    ::setenv(env::kRunId, run_id_of(::getppid()).c_str(), 1);
    if (mode == "ddp_shm" || mode == "ddp_gloo") return ddp_worker(mode.substr(4));
    if (mode == "killed_in_setup") {
      register_backend("shm_killed_in_setup", killed_in_setup);
      InitOptions o;
      o.timeout = 60s;
      o.backend = "shm_killed_in_setup";
      init_process_group(o);
      LS_THROW("rank ", rank(), " built a group that should never form");
    }
    register_backend("shm_odd_slot", [](const BackendConfig& c) -> ProcessGroupPtr {
      return std::make_shared<ProcessGroupShm>(c, ShmOptions{.slot_bytes = kOddSlotBytes});
    });
    InitOptions opts;
    opts.timeout = 60s;
    opts.backend = mode == "sweep_odd" ? "shm_odd_slot" : "shm";
    auto pg = init_process_group(opts);
    const std::string name = dynamic_cast<ProcessGroupShm&>(*pg).segment_name();
    LS_CHECK(!in_dev_shm(name.substr(1)), name, " is still in /dev/shm after the group was built");
    if (mode == "sweep" || mode == "sweep_odd") {
      lockstep::testing::run_collective_sweep(*pg);
    } else if (mode == "throw") {
      pg->barrier()->wait();
      LS_THROW("an exception that ends the worker");
    } else if (mode == "die") {
      pg->barrier()->wait();
      if (rank() == world_size() - 1) {
        // Killed while the others wait for it inside the all_reduce.
        std::this_thread::sleep_for(50ms);
        ::kill(::getpid(), SIGKILL);
      }
      Tensor x = full({1 << 20}, 1.0, kFloat32);
      try {
        pg->all_reduce(x)->wait();
        LS_THROW("all_reduce succeeded although rank ", world_size() - 1, " is dead");
      } catch (const Error& e) {
        std::string report = e.what();
        try {
          pg->barrier()->wait();
          report += "\nBARRIER SUCCEEDED";
        } catch (const Error& later) {
          report += std::string("\nlater: ") + later.what();
        }
        write_report(report);
        destroy_process_group();
        return 0;
      }
    }
    destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK"), e.what());
    write_report(e.what());
    return 1;
  }
}

[[maybe_unused]] const bool kRanAsWorker = [] {
  const char* mode = std::getenv(kModeEnv);
  if (mode == nullptr) return false;
  std::exit(worker_main(mode));
}();

std::vector<Result> run_job(int world, const std::string& mode) {
  return lockstep::testing::run_ranks_as_processes(world, kModeEnv, mode, kReportEnv, kHangGuard);
}

std::string own_segments() { return std::string("lockstep-shm-") + run_id_of(::getpid()) + "-"; }

class ShmProcesses : public ::testing::TestWithParam<int> {};

// 4 ranks on a 2-core machine too: waiting ranks block on futexes instead of spinning.
TEST_P(ShmProcesses, EveryCollectiveEveryDtypeMatchesReferenceAndLeavesNothingInDevShm) {
  for (const char* mode : {"sweep", "sweep_odd"}) {
    const auto results = run_job(GetParam(), mode);
    for (size_t r = 0; r < results.size(); ++r) {
      EXPECT_TRUE(exited_zero(results[r])) << mode << " rank " << r << ": " << results[r].report;
    }
  }
  EXPECT_FALSE(in_dev_shm(own_segments()));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmProcesses,
                         ::testing::ValuesIn(lockstep::testing::process_sweep_world_sizes(false)));

TEST(ShmProcesses, AnExceptionLeavesNothingInDevShm) {
  const auto results = run_job(2, "throw");
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_FALSE(exited_zero(results[r])) << "rank " << r;
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("an exception that ends the worker"));
  }
  EXPECT_FALSE(in_dev_shm(own_segments()));
}

TEST(ShmProcesses, ASigkilledPeerFailsTheOthersNamingItAndPoisonsTheGroup) {
  const auto results = run_job(4, "die");
  ASSERT_EQ(results.size(), 4u);
  EXPECT_TRUE(WIFSIGNALED(results[3].status) && WTERMSIG(results[3].status) == SIGKILL);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(exited_zero(results[r])) << "rank " << r << ": " << results[r].report;
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("all_reduce #2"));
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("rank 3 (pid "));
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("died"));
    EXPECT_THAT(results[r].report, ::testing::Not(::testing::HasSubstr("timed out")));
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("later: "));
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("this group failed earlier"));
  }
  EXPECT_FALSE(in_dev_shm(own_segments()));
}

// Note [Segments of dead jobs]: a job killed while its group is built leaves its segment in
// /dev/shm (a signal runs no cleanup); remove_dead_shm_segments() finds it by its dead creator and
// removes it, and rank 0 of the next shm group on the machine does so before creating its own.
TEST(ShmProcesses, ASegmentOfAJobKilledDuringSetupIsRemovedByTheNextGroup) {
  for (bool by_next_group : {false, true}) {
    const auto results = run_job(2, "killed_in_setup");
    ASSERT_EQ(results.size(), 2u);
    EXPECT_TRUE(WIFSIGNALED(results[0].status) && WTERMSIG(results[0].status) == SIGKILL);
    ASSERT_TRUE(exited_zero(results[1])) << results[1].report;
    const std::string name = results[1].report;
    ASSERT_TRUE(in_dev_shm(name)) << name << " vanished by itself: the case is not reproduced";
    if (by_next_group) {
      const auto errors = run_shm_threads(2, [](int, ProcessGroupShm& pg) { pg.barrier()->wait(); });
      for (const auto& e : errors) EXPECT_EQ(e, "");
    } else {
      EXPECT_GE(remove_dead_shm_segments(), 1u);
    }
    EXPECT_FALSE(in_dev_shm(name)) << name << " outlived its job";
  }
}

// Only segments whose creator is gone, in this pid namespace, are removed: not a running
// process's, not another namespace's (whose pid means nothing here), not names of another form.
TEST(ShmSegments, OnlyThoseOfDeadCreatorsInThisPidNamespaceAreRemoved) {
  struct stat ns {};
  ASSERT_EQ(::stat("/proc/self/ns/pid", &ns), 0);
  const pid_t dead = ::fork();
  if (dead == 0) std::_Exit(0);
  ASSERT_GT(dead, 0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  const std::string tag = "nsrm" + std::to_string(::getpid());
  auto name = [&](uint64_t pidns, pid_t pid) {
    return std::string(kSegmentPrefix) + tag + "-" + std::to_string(pidns) + "-" +
           std::to_string(pid) + "-00000000deadbeef";
  };
  const std::string of_dead = name(ns.st_ino, dead);
  const std::string of_live = name(ns.st_ino, ::getpid());
  const std::string other_ns = name(ns.st_ino + 1, dead);
  const std::string old_form = std::string(kSegmentPrefix) + tag + "-" + std::to_string(dead) + "-0";
  for (const auto& n : {of_dead, of_live, other_ns, old_form}) {
    const int fd = ::shm_open(("/" + n).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << n;
    ::close(fd);
  }
  remove_dead_shm_segments();
  EXPECT_FALSE(in_dev_shm(of_dead));
  EXPECT_TRUE(in_dev_shm(of_live));
  EXPECT_TRUE(in_dev_shm(other_ns));
  EXPECT_TRUE(in_dev_shm(old_form));
  for (const auto& n : {of_dead, of_live, other_ns, old_form}) ::shm_unlink(("/" + n).c_str());
}

TEST(ShmProcesses, DdpOverShmEqualsDdpOverGloo) {
  const auto shm = run_job(2, "ddp_shm");
  const auto gloo = run_job(2, "ddp_gloo");
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(exited_zero(shm[r])) << "shm rank " << r << ": " << shm[r].report;
    ASSERT_TRUE(exited_zero(gloo[r])) << "gloo rank " << r << ": " << gloo[r].report;
  }
  // Two ranks: each sum is one addition, the same in any order, so the runs agree bit for bit.
  EXPECT_EQ(shm[0].report, gloo[0].report);
  EXPECT_EQ(shm[0].report, shm[1].report);
  EXPECT_FALSE(shm[0].report.empty());
}

}  // namespace
