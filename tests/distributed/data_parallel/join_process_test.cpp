// Join (uneven inputs) as real processes over TCP: ranks with different numbers of batches finish
// together, hold bit-identical parameters, and equal one process that applies exactly the
// gradients of the ranks that had data at each step, averaged over those ranks.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "distributed/ddp_helpers.h"
#include "distributed/spawn_ranks.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/join.h"
#include "lockstep/distributed/zero.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace lockstep::testing::ddp;
using namespace std::chrono_literals;

namespace {

constexpr const char* kModeEnv = "LOCKSTEP_TEST_JOIN_MODE";
constexpr const char* kReportEnv = "LOCKSTEP_TEST_JOIN_REPORT";
constexpr auto kHangGuard = std::chrono::seconds(240);
constexpr int64_t kBatch = 4;
constexpr int kWorld = 3;

struct Scenario {
  std::vector<std::vector<int>> batches;  // per epoch, per rank
  int accumulate = 1;                     // micro-batches per synchronized step
  bool scaler = false;
  // ZeroRedundancyOptimizer around the SGD (Note [Join and ZeRO]): 1 its default mode (DDP
  // averages), 2 ZeroOptions::reduce_scatter_gradients with overlap_all_gather.
  int zero = 0;
};

Scenario scenario(const std::string& mode) {
  if (mode == "uneven") return {{{3, 5, 8}, {8, 3, 5}}, 1, false};  // 2 epochs: momentum synced
  if (mode == "accumulate") return {{{3, 5, 8}}, 2, true};
  if (mode == "zero") return {{{0, 2, 3}}, 1, false};
  if (mode == "zero1-uneven") return {{{3, 5, 8}, {8, 3, 5}}, 1, false, 1};
  if (mode == "zero1-accumulate") return {{{3, 5, 8}}, 2, true, 1};
  if (mode == "zero1-reduce-scatter") return {{{3, 5, 8}, {0, 3, 5}}, 1, false, 2};
  // A rank of zero batches from the first step: the first backward all-reduces whole buckets
  // (Note [ZeRO-1], Buckets) under Join's rescale.
  if (mode == "zero1-reduce-scatter-first") return {{{0, 2, 3}, {3, 0, 2}}, 1, false, 2};
  LS_THROW("unknown mode ", mode);
}

// Rank r's batch k of epoch e: the same on every rank and in the reference.
Data batch(int e, int r, int k) { return make_data(kBatch, 1000 + 100 * e + 10 * r + k); }

Tensor loss_of(nn::Module& m, const Data& d) { return cross_entropy(m.forward(d.x), d.y); }

optim::SGDOptions sgd() { return {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3}; }

// One process: at each synchronized step, the gradients (summed over the step's micro-batches)
// of the ranks that still had data, averaged over those ranks.
std::vector<std::vector<double>> reference(const Scenario& s) {
  auto model = mlp(7);
  optim::SGD opt(model->parameters(), sgd());
  for (size_t e = 0; e < s.batches.size(); ++e) {
    const auto& counts = s.batches[e];
    const int most = *std::max_element(counts.begin(), counts.end());
    for (int k = s.accumulate - 1; k < most; k += s.accumulate) {
      opt.zero_grad();
      int contributors = 0;
      for (int r = 0; r < kWorld; ++r) {
        if (counts[r] <= k) continue;
        ++contributors;
        for (int j = k - s.accumulate + 1; j <= k; ++j) {
          loss_of(*model, batch(static_cast<int>(e), r, j)).backward();
        }
      }
      autograd::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.grad().mul_(1.0 / contributors);
      opt.step();
    }
  }
  return param_values(*model);
}

Bytes as_bytes(const std::vector<std::vector<double>>& v) {
  Bytes b;
  for (const auto& t : v) {
    const auto* p = reinterpret_cast<const uint8_t*>(t.data());
    b.insert(b.end(), p, p + t.size() * sizeof(double));
  }
  return b;
}

int worker(const std::string& mode) {
  try {
    const Scenario s = scenario(mode);
    InitOptions io;
    io.timeout = 60s;
    auto pg = init_process_group(io);
    const int r = rank();
    DDPOptions o;
    o.first_bucket_bytes = 512;  // several buckets
    o.bucket_bytes = 2048;
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(7 + r), pg, o);
    std::unique_ptr<optim::Optimizer> owned;
    if (s.zero > 0) {
      owned = std::make_unique<ZeroRedundancyOptimizer>(
          ddp->parameters(), pg,
          [](std::vector<optim::ParamGroup> g) {
            return std::make_unique<optim::SGD>(std::move(g), sgd());
          },
          ZeroOptions{.reduce_scatter_gradients = s.zero == 2, .overlap_all_gather = s.zero == 2});
      // Note [ZeRO-1], Reduce-scatter: DDP's buckets go straight into the shards.
      if (s.zero == 2)
        ddp->register_comm_hook(static_cast<ZeroRedundancyOptimizer&>(*owned).comm_hook());
    } else {
      owned = std::make_unique<optim::SGD>(ddp->parameters(), sgd());
    }
    optim::Optimizer& opt = *owned;
    amp::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2});
    std::ostringstream report;
    for (size_t e = 0; e < s.batches.size(); ++e) {
      const int mine = s.batches[e][r];
      Join join(*ddp, {.optimizer = &opt, .scaler = s.scaler ? &scaler : nullptr});
      int k = 0;
      while (join.next(k < mine)) {
        const Data d = batch(static_cast<int>(e), r, k);
        // The scaled loss of every micro-batch (unscale_ divides the sum by the scale).
        auto backward = [&] {
          const Tensor loss = loss_of(*ddp, d);
          (s.scaler ? scaler.scale(loss) : loss).backward();
        };
        if (k % s.accumulate != s.accumulate - 1) {
          auto no_sync = ddp->no_sync();
          backward();
        } else if (s.scaler) {
          backward();
          scaler.step(opt);
          scaler.update();
          opt.zero_grad();
        } else {
          loss_of(*ddp, d).backward();
          opt.step();
          opt.zero_grad();
        }
        ++k;
      }
      report << "epoch " << e << ": taken " << join.steps_taken() << ", shadowed "
             << join.steps_shadowed() << "; ";
    }
    if (s.scaler) report << "scale " << scaler.get_scale();
    const auto got = param_values(*ddp->module());
    const auto all = pg->all_gather_object(as_bytes(got));
    for (int q = 1; q < kWorld; ++q) {
      LS_CHECK(all[q] == all[0], "rank ", q, "'s parameters differ from rank 0's");
    }
    const auto want = reference(s);
    for (size_t t = 0; t < want.size(); ++t) {
      for (size_t i = 0; i < want[t].size(); ++i) {
        LS_CHECK(std::abs(got[t][i] - want[t][i]) <= 1e-5 * std::max(1.0, std::abs(want[t][i])),
                 "parameter ", t, " element ", i, ": ", got[t][i], " vs the reference's ",
                 want[t][i]);
      }
    }
    // After the Join the model steps as before, with no header (every rank has data).
    loss_of(*ddp, batch(9, r, 0)).backward();
    opt.step();
    const auto after = pg->all_gather_object(as_bytes(param_values(*ddp->module())));
    LS_CHECK(after[1] == after[0] && after[2] == after[0], "ranks differ after a step past Join");
    if (const char* path = std::getenv(kReportEnv)) std::ofstream(path) << report.str();
    destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK"), e.what());
    if (const char* path = std::getenv(kReportEnv)) std::ofstream(path) << e.what();
    return 1;
  }
}

[[maybe_unused]] const bool kRanAsWorker = [] {
  const char* mode = std::getenv(kModeEnv);
  if (mode == nullptr) return false;
  std::exit(worker(mode));
}();

std::vector<lockstep::testing::Result> run(const std::string& mode) {
  auto results =
      lockstep::testing::run_ranks_as_processes(kWorld, kModeEnv, mode, kReportEnv, kHangGuard);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(lockstep::testing::exited_zero(results[r]))
        << "rank " << r << ": " << results[r].report;
  }
  return results;
}

TEST(JoinProcesses, RanksWith3_5_8BatchesFinishTogetherAndEqualTheReference) {
  const auto results = run("uneven");
  // Epoch 0: 3, 5, 8 batches; epoch 1: 8, 3, 5. Every rank goes through 8 steps per epoch.
  EXPECT_EQ(results[0].report, "epoch 0: taken 3, shadowed 5; epoch 1: taken 8, shadowed 0; ");
  EXPECT_EQ(results[1].report, "epoch 0: taken 5, shadowed 3; epoch 1: taken 3, shadowed 5; ");
  EXPECT_EQ(results[2].report, "epoch 0: taken 8, shadowed 0; epoch 1: taken 5, shadowed 3; ");
}

TEST(JoinProcesses, NoSyncAccumulationAndGradScalerEqualTheReference) {
  const auto results = run("accumulate");
  // Headers are per forward: the rank with 3 micro-batches shadows the other 5. The scale grows
  // x2 every 2 clean steps on the ranks that step: 4 steps on the last rank, copied to all.
  EXPECT_EQ(results[0].report, "epoch 0: taken 3, shadowed 5; scale 4096");
  EXPECT_EQ(results[1].report, "epoch 0: taken 5, shadowed 3; scale 4096");
  EXPECT_EQ(results[2].report, "epoch 0: taken 8, shadowed 0; scale 4096");
}

TEST(JoinProcesses, ARankWithZeroBatchesDoesNotHang) {
  const auto results = run("zero");
  EXPECT_EQ(results[0].report, "epoch 0: taken 0, shadowed 3; ");
  EXPECT_EQ(results[1].report, "epoch 0: taken 2, shadowed 1; ");
  EXPECT_EQ(results[2].report, "epoch 0: taken 3, shadowed 0; ");
}

// Note [Join and ZeRO]: with a ZeroRedundancyOptimizer a joined rank takes the step with the
// others (its shard would stop moving, and the all-gather would hang, without), and the result
// is the same reference, bit-identical on every rank.
TEST(JoinProcesses, ZeroRedundancyOptimizerStepsAlongOnJoinedRanks) {
  const auto results = run("zero1-uneven");
  EXPECT_EQ(results[0].report, "epoch 0: taken 3, shadowed 5; epoch 1: taken 8, shadowed 0; ");
  EXPECT_EQ(results[2].report, "epoch 0: taken 8, shadowed 0; epoch 1: taken 5, shadowed 3; ");
}

TEST(JoinProcesses, ZeroWithNoSyncAccumulationAndGradScalerEqualsTheReference) {
  const auto results = run("zero1-accumulate");
  // Every rank's scaler moved with the steps (the joined ones' through the shadow step).
  for (const auto& r : results) EXPECT_THAT(r.report, ::testing::EndsWith("scale 4096"));
}

TEST(JoinProcesses, ZeroReduceScatterModeWithARankOfZeroBatchesEqualsTheReference) {
  const auto results = run("zero1-reduce-scatter");
  EXPECT_EQ(results[0].report, "epoch 0: taken 3, shadowed 5; epoch 1: taken 0, shadowed 5; ");
}

TEST(JoinProcesses, ZeroReduceScatterModeWithARankOfZeroBatchesAtTheFirstStep) {
  const auto results = run("zero1-reduce-scatter-first");
  EXPECT_EQ(results[0].report, "epoch 0: taken 0, shadowed 3; epoch 1: taken 3, shadowed 0; ");
  EXPECT_EQ(results[1].report, "epoch 0: taken 2, shadowed 1; epoch 1: taken 0, shadowed 3; ");
}

}  // namespace
