// DistributedDataParallel as real processes over TCP: each rank trains on its shard; rank 0 checks
// the result against one process on the whole batch, and every rank checks that all ranks hold
// bit-identical parameters.
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "distributed/ddp_helpers.h"
#include "distributed/spawn_ranks.h"
#include "lockstep/data/data.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/init.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace lockstep::testing::ddp;
using namespace std::chrono_literals;

namespace {

constexpr const char* kModeEnv = "LOCKSTEP_TEST_DDP_MODE";
constexpr const char* kBackendEnv = "DDP_TEST_BACKEND";  // not LOCKSTEP_: the spawner drops those
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

// FNV-1a over the bytes of every parameter.
uint64_t params_hash(const nn::Module& m) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : m.parameters()) {
    const Tensor c = p.contiguous();
    const auto* b = static_cast<const uint8_t*>(c.data_ptr());
    for (int64_t i = 0; i < c.numel() * static_cast<int64_t>(dtype_size(c.dtype())); ++i) {
      h = (h ^ b[i]) * 1099511628211ull;
    }
  }
  return h;
}

Bytes u64_bytes(uint64_t v) {
  Bytes b(8);
  std::memcpy(b.data(), &v, 8);
  return b;
}

// Many steps over three epochs of a DataLoader with the DistributedSampler: every epoch the ranks
// read disjoint shards that together cover the dataset, in a new order each epoch (set_epoch),
// and after every epoch all ranks hold bit-identical parameters (hash compared across ranks).
int sampler_worker(const ProcessGroupPtr& pg) {
  constexpr int64_t kSamples = 384, kEpochs = 3;
  const int r = pg->rank(), world = pg->size();
  const Data all = make_data(kSamples, 23);
  auto ds = std::make_shared<data::TensorDataset>(all.x, all.y);
  auto sampler = std::make_shared<data::DistributedSampler>(kSamples, world, r, true, 5);
  data::DataLoader loader(ds, sampler, {.batch_size = kBatch});
  auto ddp = std::make_shared<DistributedDataParallel>(mlp(7 + r), pg);
  optim::SGD opt(ddp->parameters(), {.lr = 0.05, .momentum = 0.9});
  const uint64_t initial = params_hash(*ddp->module());
  std::vector<int64_t> first_epoch_order;
  int64_t steps = 0;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    loader.set_epoch(epoch);
    std::vector<int64_t> seen;
    for (data::Batch& b : loader) {
      seen.insert(seen.end(), b.indices.begin(), b.indices.end());
      opt.zero_grad();
      cross_entropy(ddp->forward(b.input), b.target).backward();
      opt.step();
      ++steps;
    }
    if (epoch == 0) first_epoch_order = seen;
    if (epoch == 1) LS_CHECK(seen != first_epoch_order, "epoch 1 repeated epoch 0's order");
    Bytes mine(seen.size() * sizeof(int64_t));
    std::memcpy(mine.data(), seen.data(), mine.size());
    std::vector<int> owner(kSamples, -1);
    const auto shards = pg->all_gather_object(mine);
    for (int q = 0; q < world; ++q) {
      const auto* idx = reinterpret_cast<const int64_t*>(shards[q].data());
      for (size_t i = 0; i < shards[q].size() / sizeof(int64_t); ++i) {
        LS_CHECK(owner[idx[i]] == -1, "epoch ", epoch, ": sample ", idx[i], " read by rank ",
                 owner[idx[i]], " and rank ", q);
        owner[idx[i]] = q;
      }
    }
    for (int64_t i = 0; i < kSamples; ++i) {
      LS_CHECK(owner[i] != -1, "epoch ", epoch, ": no rank read sample ", i);
    }
    const uint64_t h = params_hash(*ddp->module());
    const auto hashes = pg->all_gather_object(u64_bytes(h));
    for (int q = 1; q < world; ++q) {
      LS_CHECK(hashes[q] == hashes[0], "after epoch ", epoch, " (", steps, " steps) rank ", q,
               "'s parameters differ from rank 0's");
    }
  }
  LS_CHECK(params_hash(*ddp->module()) != initial, "training changed no parameter");
  report("steps " + std::to_string(steps));
  destroy_process_group();
  return 0;
}

int worker(const std::string& mode) {
  try {
    InitOptions io;
    io.timeout = 60s;
    // The backend under test (the spawner passes no LOCKSTEP_ variable through).
    if (const char* b = std::getenv(kBackendEnv)) io.backend = b;
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
    if (mode == "sampler") return sampler_worker(pg);
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
    report("backend " + std::string(pg->backend()) + ": " + ddp->stats().str());
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

// World size, backend (through kBackendEnv, which the ranks inherit).
class DDPProcesses : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

TEST_P(DDPProcesses, ShardsEqualOneProcessAndRanksStayIdentical) {
  const auto [world, backend] = GetParam();
  ::setenv(kBackendEnv, backend, 1);
  const auto results = lockstep::testing::run_ranks_as_processes(world, kModeEnv, "train",
                                                                 kReportEnv, kHangGuard);
  ::unsetenv(kBackendEnv);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(lockstep::testing::exited_zero(results[r]))
        << "rank " << r << ": " << results[r].report;
  }
  EXPECT_THAT(results[0].report, ::testing::HasSubstr("rebuilt in ready order"));
  EXPECT_THAT(results[0].report, ::testing::StartsWith(std::string("backend ") + backend));
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndBackends, DDPProcesses,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values("gloo", "shm")),
                         [](const auto& info) {
                           return std::string(std::get<1>(info.param)) + "_" +
                                  std::to_string(std::get<0>(info.param));
                         });

TEST(DDPProcesses, SamplerShardsDifferAndParametersStayBitIdenticalOverEpochs) {
  const auto results =
      lockstep::testing::run_ranks_as_processes(2, kModeEnv, "sampler", kReportEnv, kHangGuard);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_TRUE(lockstep::testing::exited_zero(results[r]))
        << "rank " << r << ": " << results[r].report;
  }
  // 384 samples / 2 ranks / batch 8 = 24 steps per epoch, 3 epochs.
  EXPECT_EQ(results[0].report, "steps 72");
}

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
