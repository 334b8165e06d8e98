// The hier backend: an shm group inside each machine composed with Gloo across machines, with
// two "machines" simulated on one through HierOptions' testing hook; as threads and processes.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <latch>
#include <sstream>
#include <thread>

#include "distributed/collective_sweep.h"
#include "distributed/ddp_helpers.h"
#include "distributed/hier/register.h"
#include "distributed/machine.h"
#include "distributed/spawn_ranks.h"
#include "distributed/thread_ranks.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/hier/process_group_hier.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/store/hash_store.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;
using lockstep::testing::exited_zero;
using lockstep::testing::Result;

namespace {

// Runs body(rank, group) on one thread per entry of `machines` (rank r claims to run on machine
// machines[r]); returns each rank's exception message ("" on success).
std::vector<std::string> run_hier_threads(const std::vector<std::string>& machines,
                                          const std::function<void(int, ProcessGroupHier&)>& body,
                                          std::chrono::milliseconds timeout = 60s) {
  const int world = static_cast<int>(machines.size());
  auto store = std::make_shared<HashStore>(30s);
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
        ProcessGroupHier pg(c, {.machine_identity_for_testing = machines[r]});
        body(r, pg);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void expect_all_succeeded(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

const std::vector<std::string> kTwoByTwo = {"machine-a", "machine-a", "machine-b", "machine-b"};

TEST(HierThreads, TwoMachinesOfTwoRanksRunEveryCollectiveAsTheReferenceSays) {
  expect_all_succeeded(run_hier_threads(kTwoByTwo, [](int, ProcessGroupHier& pg) {
    LS_CHECK(pg.num_machines() == 2 && pg.local_size() == 2, "layout ", pg.num_machines(), "x",
             pg.local_size());
    lockstep::testing::run_collective_sweep(pg);
  }));
}

TEST(HierThreads, OneMachineIsShmAloneAndOneRankPerMachineIsGlooAlone) {
  for (const auto& machines : std::vector<std::vector<std::string>>{
           {"machine-a", "machine-a"}, {"machine-a", "machine-b", "machine-c"}}) {
    expect_all_succeeded(run_hier_threads(machines, [&](int, ProcessGroupHier& pg) {
      const int world = static_cast<int>(machines.size());
      const bool one_machine = machines.front() == machines.back();
      LS_CHECK(pg.num_machines() == (one_machine ? 1 : world), "machines ", pg.num_machines());
      LS_CHECK(pg.local_size() == (one_machine ? world : 1), "local size ", pg.local_size());
      lockstep::testing::run_collective_sweep(pg);
    }));
  }
}

// Random floats, sizes that 2 and 3 local ranks do not divide, every collective: equal to a
// flat Gloo group of the same ranks within rounding (bitwise where no sum is involved), and
// identical on every rank.
TEST(HierThreads, EqualsFlatGlooAndIsIdenticalOnEveryRank) {
  const std::vector<std::vector<std::string>> layouts = {kTwoByTwo, {"a", "a", "a", "b", "b", "b"}};
  for (const auto& machines : layouts) {
    const int world = static_cast<int>(machines.size());
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::product}) {
        auto input = [&](int r, int64_t count) {
          Generator gen(500 + r);
          return randn({count}, gen);
        };
        using Results = std::vector<std::vector<std::vector<double>>>;  // [rank][collective]
        auto collectives = [&](int r, ProcessGroup& pg) {
          std::vector<std::vector<double>> out;
          Tensor x = input(r, n);
          pg.all_reduce(x, {.op = op})->wait();
          out.push_back(x.to_vector<double>());
          Tensor rs = zeros({n});
          pg.reduce_scatter(rs, input(r, world * n),
                            {.op = op == ReduceOp::avg ? op : ReduceOp::sum})
              ->wait();
          out.push_back(rs.to_vector<double>());
          Tensor g = zeros({world * n});
          pg.all_gather(g, input(r, n))->wait();
          out.push_back(g.to_vector<double>());
          Tensor b = input(r, n);
          pg.broadcast(b, {.root = world - 1})->wait();
          out.push_back(b.to_vector<double>());
          pg.barrier()->wait();
          return out;
        };
        Results hier(world), gloo(world);
        expect_all_succeeded(run_hier_threads(
            machines, [&](int r, ProcessGroupHier& pg) { hier[r] = collectives(r, pg); }));
        expect_all_succeeded(lockstep::testing::run_ranks(
            world, [&](int r, ProcessGroupPtr pg) { gloo[r] = collectives(r, *pg); }));
        const std::string what = "world " + std::to_string(world) + " n=" + std::to_string(n) +
                                 " " + std::string(reduce_op_name(op));
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(hier[r].size(), 4u) << what;
          ASSERT_EQ(hier[r][0], hier[0][0]) << what << ": all_reduce differs between ranks";
          for (size_t c = 0; c < 4; ++c) {
            // Gathers and copies move bytes; max picks one of them.
            const bool exact = c >= 2 || (c == 0 && op == ReduceOp::max);
            ASSERT_EQ(hier[r][c].size(), gloo[r][c].size()) << what << " collective " << c;
            for (size_t i = 0; i < hier[r][c].size(); ++i) {
              const double h = hier[r][c][i], g = gloo[r][c][i];
              if (exact) {
                ASSERT_EQ(h, g) << what << " collective " << c << " rank " << r << " element " << i;
              } else {
                ASSERT_LE(std::abs(h - g), 1e-5 * std::max(1.0, std::abs(g)))
                    << what << " collective " << c << " rank " << r << " element " << i;
              }
            }
          }
        }
      }
    }
  }
}

TEST(HierThreads, RanksOfAMachineNotContiguousIsAnErrorNamingTheLayoutOnEveryRank) {
  const auto errors = run_hier_threads({"machine-a", "machine-b", "machine-a", "machine-b"},
                                       [](int, ProcessGroupHier&) {});
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("contiguous")) << "rank " << r;
    EXPECT_THAT(errors[r], ::testing::HasSubstr("machine-a: ranks 0,2; machine-b: ranks 1,3"))
        << "rank " << r;
  }
}

TEST(HierThreads, MachinesOfDifferentSizesAreAnErrorNamingTheLayoutOnEveryRank) {
  const auto errors =
      run_hier_threads({"machine-a", "machine-a", "machine-a", "machine-b"}, [](int, auto&) {});
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("same number of ranks on every machine"));
    EXPECT_THAT(errors[r], ::testing::HasSubstr("machine-a: ranks 0,1,2; machine-b: ranks 3"))
        << "rank " << r;
  }
}

// 7 and 8 elements both make shards of 3 on 3 local ranks: the sub-groups would not notice.
TEST(HierThreads, AllReduceSizesThatPadAlikeStillFailEveryRankNamingBoth) {
  const auto errors = run_hier_threads({"m", "m", "m"}, [](int r, ProcessGroupHier& pg) {
    Tensor x = full({r == 0 ? 8 : 7}, 1.0, kFloat32);
    pg.all_reduce(x)->wait();
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("sizes range from 7 to 8")) << "rank " << r;
  }
}

// Rank 3 skips an all_reduce: its machine's peer fails inside the machine, the other machine's
// ranks across machines, each within the timeout; every later collective then fails at once.
TEST(HierThreads, ARankThatNeverArrivesFailsTheOthersInTimeAndPoisonsTheGroup) {
  std::vector<std::string> first(4), later(4);
  std::latch done(4);
  const auto errors = run_hier_threads(
      kTwoByTwo,
      [&](int r, ProcessGroupHier& pg) {
        if (r != 3) {
          Tensor x = full({1000}, 1.0, kFloat32);
          try {
            pg.all_reduce(x, {.timeout = 1000ms})->wait();
          } catch (const Error& e) {
            first[r] = e.what();
          }
          try {
            pg.barrier()->wait();
          } catch (const Error& e) {
            later[r] = e.what();
          }
        }
        done.arrive_and_wait();  // rank 3's group lives until the others are done
      },
      60s);
  expect_all_succeeded(errors);
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(first[r], ::testing::HasSubstr("all_reduce")) << "rank " << r;
    // The words every backend's poisoned group gives (Note [Poisoned group]).
    EXPECT_THAT(later[r], ::testing::HasSubstr("barrier #")) << "rank " << r;
    EXPECT_THAT(later[r], ::testing::HasSubstr(" was not run: this group failed earlier ("))
        << "rank " << r;
  }
}

TEST(HierBackend, IsRegisteredByName) { EXPECT_TRUE(has_backend("hier")); }

// What "auto" (the default) builds for each layout: the machines of every rank, in rank order.
TEST(AutoBackend, ChoosesShmOnOneMachineGlooForOneRankEachHierOtherwise) {
  struct Case {
    std::vector<std::string> machines;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{"a", "a", "a", "a"}, "shm"},  {{"a", "b", "c"}, "gloo"},
      {{"a", "a", "b", "b"}, "hier"}, {{"a", "a", "a", "b", "b", "b"}, "hier"},
      {{"a", "b", "a", "b"}, "gloo"},  // ranks of a machine interleaved
      {{"a", "a", "a", "b"}, "gloo"},  // machines of different sizes
  };
  for (const auto& c : cases) {
    const auto layout = dist::detail::machine_layout(c.machines);
    EXPECT_EQ(choose_cpu_backend(layout, static_cast<int>(c.machines.size())), c.want)
        << layout.found;
  }
  const auto odd = dist::detail::machine_layout({"a", "b", "a", "b"});
  EXPECT_FALSE(odd.regular);
  EXPECT_EQ(odd.found, "a: ranks 0,2; b: ranks 1,3");
}

// ---- Ranks as processes ----

constexpr const char* kModeEnv = "LOCKSTEP_TEST_HIER_MODE";
constexpr const char* kReportEnv = "LOCKSTEP_TEST_HIER_REPORT";

void write_report(const std::string& text) {
  if (const char* path = std::getenv(kReportEnv)) std::ofstream(path) << text;
}

// DDP as ddp_process_test.cpp trains it; reports the parameters.
void ddp_worker(const ProcessGroupPtr& pg) {
  using namespace lockstep::testing::ddp;
  constexpr int kSteps = 5;
  constexpr int64_t kBatch = 12;
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
  std::ostringstream out;
  out.precision(17);
  for (const auto& p : ddp->module()->parameters())
    for (double v : p.to_vector<double>()) out << v << " ";
  write_report(out.str());
}

// "sweep": ranks 0, 1 claim one machine, ranks 2, 3 another (the testing hook). "sweep_detected":
// the machines as detected (hier_two_namespaces.sh gives each pair its own host name), through
// the default backend, which must choose hier. "one_per_machine": 2 ranks on 2 machines, through
// the default backend, which must choose gloo.
int worker_main(const std::string& mode) {
  try {
    register_backend("hier_two_machines", [](const BackendConfig& c) -> ProcessGroupPtr {
      return std::make_shared<ProcessGroupHier>(
          c, HierOptions{.machine_identity_for_testing = "machine-" + std::to_string(c.rank / 2)});
    });
    InitOptions opts;
    opts.timeout = 60s;
    // sweep_detected and one_per_machine take the default backend, "auto".
    opts.backend = mode == "sweep_detected" || mode == "one_per_machine" ? ""
                   : mode == "ddp_gloo"                                  ? "gloo"
                                                                         : "hier_two_machines";
    auto pg = init_process_group(opts);
    if (mode == "one_per_machine") {
      LS_CHECK(pg->backend() == "gloo", "auto chose ", pg->backend(),
               " for one rank per machine, expected gloo");
      lockstep::testing::run_collective_sweep(*pg);
      destroy_process_group();
      return 0;
    }
    if (mode == "ddp_gloo" || mode == "ddp_hier") {
      ddp_worker(pg);
      destroy_process_group();
      return 0;
    }
    LS_CHECK(pg->backend() == "hier", "the group's backend is ", pg->backend(), ", expected hier");
    const auto& hier = dynamic_cast<ProcessGroupHier&>(*pg);
    LS_CHECK(hier.num_machines() == 2 && hier.local_size() == 2, "layout ", hier.num_machines(),
             " machines x ", hier.local_size(), " ranks, expected 2 x 2");
    lockstep::testing::run_collective_sweep(*pg);
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

TEST(HierProcesses, TwoMachinesOfTwoProcessesRunEveryCollectiveAsTheReferenceSays) {
  const auto results =
      lockstep::testing::run_ranks_as_processes(4, kModeEnv, "sweep", kReportEnv, 240s);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(exited_zero(results[r])) << "rank " << r << ": " << results[r].report;
  }
}

std::vector<double> numbers(const std::string& text) {
  std::istringstream in(text);
  std::vector<double> v;
  for (double x; in >> x;) v.push_back(x);
  return v;
}

// 4 ranks on 2 simulated machines: the gradients' sums run in another order than flat Gloo's,
// so the parameters agree within rounding; they are identical on every rank.
TEST(HierProcesses, DdpOverHierEqualsDdpOverGlooAndIsIdenticalOnEveryRank) {
  const auto hier =
      lockstep::testing::run_ranks_as_processes(4, kModeEnv, "ddp_hier", kReportEnv, 240s);
  const auto gloo =
      lockstep::testing::run_ranks_as_processes(4, kModeEnv, "ddp_gloo", kReportEnv, 240s);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(exited_zero(hier[r])) << "hier rank " << r << ": " << hier[r].report;
    ASSERT_TRUE(exited_zero(gloo[r])) << "gloo rank " << r << ": " << gloo[r].report;
    EXPECT_EQ(hier[r].report, hier[0].report) << "rank " << r << " differs from rank 0";
  }
  const auto h = numbers(hier[0].report), g = numbers(gloo[0].report);
  ASSERT_EQ(h.size(), g.size());
  ASSERT_FALSE(h.empty());
  for (size_t i = 0; i < h.size(); ++i) {
    EXPECT_NEAR(h[i], g[i], 1e-5 * std::max(1.0, std::abs(g[i]))) << "parameter element " << i;
  }
}

}  // namespace
