// DistributedDataParallel as real processes over TCP: each rank trains on its shard; rank 0 checks
// the result against one process on the whole batch, and every rank checks that all ranks hold
// bit-identical parameters.
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "dist/ddp_helpers.h"
#include "dist/spawn_ranks.h"
#include "lockstep/dist/ddp.h"
#include "lockstep/dist/init.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace lockstep::testing::ddp;
using namespace std::chrono_literals;

namespace {

constexpr const char* kModeEnv = "LOCKSTEP_TEST_DDP_MODE";
constexpr const char* kReportEnv = "LOCKSTEP_TEST_DDP_REPORT";
constexpr auto kHangGuard = std::chrono::seconds(240);
constexpr int kSteps = 5;
constexpr int64_t kBatch = 8;

void report(const std::string& text) {
  if (const char* path = std::getenv(kReportEnv)) std::ofstream(path) << text;
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
    InitOptions io;
    io.timeout = 60s;
    auto pg = init_process_group(io);
    const int r = rank(), world = world_size();
    if (mode == "mismatch") {
      try {
        DistributedDataParallel ddp(mlp(1, r == 1 ? 16 : kHidden), pg);
        LS_THROW("different models were accepted");
      } catch (const Error& e) {
        report(e.what());
        destroy_process_group();
        return 0;
      }
    }
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
    const auto got = param_values(*ddp->module());
    // Every rank holds exactly rank 0's parameters.
    const auto all = pg->all_gather_object(as_bytes(got));
    for (int q = 1; q < world; ++q) {
      LS_CHECK(all[q] == all[0], "rank ", q, "'s parameters differ from rank 0's");
    }
    if (r == 0) {
      auto ref = mlp(100);
      optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3});
      for (int s = 0; s < kSteps; ++s) {
        ref_opt.zero_grad();
        cross_entropy(ref->forward(data.x.narrow(0, s * kBatch, kBatch)),
                      data.y.narrow(0, s * kBatch, kBatch))
            .backward();
        ref_opt.step();
      }
      const auto want = param_values(*ref);
      for (size_t k = 0; k < want.size(); ++k) {
        for (size_t i = 0; i < want[k].size(); ++i) {
          LS_CHECK(std::abs(got[k][i] - want[k][i]) <= 1e-5 * std::max(1.0, std::abs(want[k][i])),
                   "parameter ", k, " element ", i, ": ", got[k][i], " vs one process's ",
                   want[k][i]);
        }
      }
    }
    report(ddp->stats().str());
    destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK"), e.what());
    report(e.what());
    return 1;
  }
}

[[maybe_unused]] const bool kRanAsWorker = [] {
  const char* mode = std::getenv(kModeEnv);
  if (mode == nullptr) return false;
  std::exit(worker(mode));
}();

class DDPProcesses : public ::testing::TestWithParam<int> {};

TEST_P(DDPProcesses, ShardsEqualOneProcessAndRanksStayIdentical) {
  const auto results = lockstep::testing::run_ranks_as_processes(GetParam(), kModeEnv, "train",
                                                                 kReportEnv, kHangGuard);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(lockstep::testing::exited_zero(results[r]))
        << "rank " << r << ": " << results[r].report;
  }
  EXPECT_THAT(results[0].report, ::testing::HasSubstr("rebuilt in ready order"));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DDPProcesses, ::testing::Values(2, 4));

TEST(DDPProcesses, MismatchedModelsFailEveryRank) {
  const auto results =
      lockstep::testing::run_ranks_as_processes(3, kModeEnv, "mismatch", kReportEnv, kHangGuard);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(lockstep::testing::exited_zero(results[r]))
        << "rank " << r << ": " << results[r].report;
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("ranks built different models"));
    EXPECT_THAT(results[r].report, ::testing::HasSubstr("on rank 1"));
  }
}

}  // namespace
