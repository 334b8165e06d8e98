// ZeroRedundancyOptimizer with ranks as threads: parameters and optimizer state bitwise those of
// plain DDP with the same optimizer over 2, 3 and 4 ranks, optimizer state per rank about
// 1/world of the whole, and checkpoints that move between ZeRO and plain runs of any size.
#include <cmath>
#include <cstdio>
#include <thread>

#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "lockstep/amp/grad_scaler.h"
#include "lockstep/distributed/checkpoint.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/store/hash_store.h"
#include "lockstep/distributed/zero.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;
using namespace lockstep::testing::ddp;

namespace {

constexpr int64_t kPerRank = 4;  // samples per rank per step
constexpr int kSteps = 20;
constexpr int kLrChangeStep = 5;

enum class Opt { sgd, adamw };

std::unique_ptr<optim::Optimizer> make_optimizer(Opt o, std::vector<optim::ParamGroup> groups) {
  if (o == Opt::sgd) {
    return std::make_unique<optim::SGD>(
        std::move(groups),
        optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
  }
  return std::make_unique<optim::AdamW>(std::move(groups), optim::AdamWOptions{.lr = 1e-2});
}

// Two groups, so that each piece must land in its parameter's group: the first layer at its own
// learning rate, the rest at the optimizer's.
std::vector<optim::ParamGroup> groups_of(const nn::Module& m) {
  const auto ps = m.parameters();
  optim::ParamGroup first{{ps[0], ps[1]}, 0.02};
  optim::ParamGroup rest{{ps.begin() + 2, ps.end()}};
  return {first, rest};
}

struct Snapshot {
  optim::NamedTensors model;
  optim::NamedTensors optimizer;
};

struct Result {
  std::vector<std::vector<double>> params;
  Snapshot snapshot;
  ZeroStats zero;
  DDPStats ddp;
};

// Steps [start, start + steps) of a run on rank r: the MLP (from `from` when given) under DDP,
// the optimizer plain or wrapped in ZeRO. Step s's batch depends on s and the world size only.
// `reduce_scatter`: DDP's buckets are reduce-scattered into ZeRO's shards during backward
// (ZeroRedundancyOptimizer::comm_hook()), `overlap`: the all-gathers are waited for in the next
// forward. Small buckets, so that there are several (and their rebuild after step 1 moves the
// shards).
Result train(int r, const ProcessGroupPtr& pg, Opt o, bool zero, int start, int steps,
             const Snapshot* from, bool reduce_scatter = false, bool overlap = false) {
  auto model = mlp(7);
  if (from) model->load_state_dict(from->model);
  DDPOptions ddp_opts;
  ddp_opts.first_bucket_bytes = 300;
  ddp_opts.bucket_bytes = 1000;
  DistributedDataParallel ddp(model, pg, ddp_opts);
  std::unique_ptr<optim::Optimizer> opt;
  if (zero) {
    auto z = std::make_unique<ZeroRedundancyOptimizer>(
        groups_of(*model), pg, [o](auto g) { return make_optimizer(o, std::move(g)); },
        ZeroOptions{.reduce_scatter_gradients = reduce_scatter, .overlap_all_gather = overlap});
    if (reduce_scatter) ddp.register_comm_hook(z->comm_hook());
    opt = std::move(z);
  } else {
    opt = make_optimizer(o, groups_of(*model));
  }
  if (from) opt->load_state_dict(from->optimizer);
  const int world = pg->size();
  for (int s = start; s < start + steps; ++s) {
    const Data batch = shard(make_data(kPerRank * world, 100 + static_cast<uint64_t>(s)), r, world);
    // A schedule's change to one group, which the wrapped optimizer must follow.
    if (s == kLrChangeStep) opt->param_groups()[0].lr *= 0.5;
    opt->zero_grad();
    cross_entropy(ddp.forward(batch.x), batch.y).backward();
    opt->step();
  }
  if (overlap) static_cast<ZeroRedundancyOptimizer&>(*opt).wait_parameters();
  Result res;
  res.params = param_values(*model);
  res.snapshot.model = model->state_dict();
  res.snapshot.optimizer = opt->state_dict();
  if (zero) res.zero = static_cast<ZeroRedundancyOptimizer&>(*opt).stats();
  res.ddp = ddp.stats();
  return res;
}

// Runs `world` ranks; every rank's result must be the same parameters (lockstep).
std::vector<Result> run(int world, Opt o, bool zero, int start, int steps,
                        const Snapshot* from = nullptr, const std::string& backend = "gloo",
                        bool reduce_scatter = false, bool overlap = false) {
  std::vector<Result> results(static_cast<size_t>(world));
  const auto errors =
      lockstep::testing::run_ranks_on(backend, world, [&](int r, ProcessGroupPtr pg) {
        results[r] = train(r, pg, o, zero, start, steps, from, reduce_scatter, overlap);
      });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  for (int r = 1; r < world; ++r) EXPECT_EQ(results[r].params, results[0].params) << "rank " << r;
  return results;
}

// Names, shapes and every value bitwise equal (f32 and f64 values are exact as doubles).
void expect_same_state(const optim::NamedTensors& got, const optim::NamedTensors& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k].first, want[k].first);
    EXPECT_EQ(got[k].second.shape(), want[k].second.shape()) << got[k].first;
    EXPECT_EQ(got[k].second.to_vector<double>(), want[k].second.to_vector<double>())
        << got[k].first;
  }
}

int64_t per_element_state_bytes(const optim::NamedTensors& state) {
  int64_t bytes = 0;
  for (const auto& [name, t] : state)
    if (name[0] >= '0' && name[0] <= '9' && t.dim() > 0) bytes += t.nbytes();
  return bytes;
}

struct Case {
  int world;
  Opt opt;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << (c.opt == Opt::sgd ? "SGD" : "AdamW") << " over " << c.world << " ranks";
}

class ZeroEqualsDDP : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroEqualsDDP, ParametersAndStateBitwiseOverManyStepsWithAShardOfTheStatePerRank) {
  const auto [world, o] = GetParam();
  const auto plain = run(world, o, false, 0, kSteps);
  const auto zero = run(world, o, true, 0, kSteps);
  EXPECT_EQ(zero[0].params, plain[0].params);
  for (int r = 0; r < world; ++r)
    expect_same_state(zero[r].snapshot.optimizer, plain[0].snapshot.optimizer);
  // Training moved the parameters (the comparison is not of two untouched models).
  EXPECT_NE(plain[0].params, param_values(*mlp(7)));

  // The state per rank: its 1/world of the per-element state, plus a scalar per piece (AdamW's
  // step count; a rank has at most one piece per parameter); padding holds no state.
  const int64_t total_bytes = per_element_state_bytes(plain[0].snapshot.optimizer);
  const int64_t fields = o == Opt::sgd ? 1 : 2;
  const int64_t params = static_cast<int64_t>(plain[0].params.size());
  const int64_t scalar_slack = o == Opt::adamw ? params * 8 : 0;
  int64_t sum = 0;
  for (int r = 0; r < world; ++r) {
    const ZeroStats& s = zero[r].zero;
    // One segment: world shards of total / world and a tail of fewer than world elements.
    EXPECT_EQ(s.segments, 1);
    EXPECT_EQ(s.shard_elements, s.total_elements / world + s.total_elements % world);
    EXPECT_EQ(s.replicated_elements, s.total_elements % world);
    EXPECT_LE(s.state_bytes, s.shard_elements * fields * 4 + scalar_slack) << "rank " << r;
    EXPECT_LE(s.state_bytes, total_bytes / world + fields * 4 * world + scalar_slack);
    sum += s.state_bytes;
    std::printf("world %d %s rank %d: optimizer state %lld bytes of %lld (plain), ratio %.3f\n",
                world, o == Opt::sgd ? "SGD" : "AdamW", r, static_cast<long long>(s.state_bytes),
                static_cast<long long>(total_bytes),
                static_cast<double>(s.state_bytes) / static_cast<double>(total_bytes));
  }
  EXPECT_GE(sum, total_bytes);  // every element's state is somewhere
}

INSTANTIATE_TEST_SUITE_P(Worlds, ZeroEqualsDDP,
                         ::testing::Values(Case{2, Opt::sgd}, Case{3, Opt::sgd}, Case{4, Opt::sgd},
                                           Case{2, Opt::adamw}, Case{3, Opt::adamw},
                                           Case{4, Opt::adamw}),
                         [](const auto& info) {
                           return std::string(info.param.opt == Opt::sgd ? "SGD" : "AdamW") + "_" +
                                  std::to_string(info.param.world) + "ranks";
                         });

// Note [ZeRO-1], Reduce-scatter: both backends reduce-scatter in the rank order their all_reduce
// adds in (Note [Gloo rank-order reduction]), so the gradients reduce-scattered by ZeRO step the
// parameters to bitwise those of plain DDP on the same backend, at any world size.
// Several buckets (their rebuild after step 1 moves the shards); with overlap_all_gather the
// parameters come in at the next forward.
struct BackendCase {
  int world;
  Opt opt;
  const char* backend;
  bool overlap;
};

void PrintTo(const BackendCase& c, std::ostream* os) {
  *os << (c.opt == Opt::sgd ? "SGD" : "AdamW") << " over " << c.world << " ranks of " << c.backend
      << (c.overlap ? ", all-gather overlapped" : "");
}

class ZeroReduceScatter : public ::testing::TestWithParam<BackendCase> {};

TEST_P(ZeroReduceScatter, EqualsPlainDDPBitwiseOnTheSameBackend) {
  const auto [world, o, backend, overlap] = GetParam();
  const auto plain = run(world, o, false, 0, kSteps, nullptr, backend);
  const auto zero =
      run(world, o, true, 0, kSteps, nullptr, backend, /*reduce_scatter=*/true, overlap);
  EXPECT_EQ(zero[0].params, plain[0].params) << backend;
  const int64_t total_bytes = per_element_state_bytes(plain[0].snapshot.optimizer);
  for (int r = 0; r < world; ++r) {
    expect_same_state(zero[r].snapshot.optimizer, plain[0].snapshot.optimizer);
    // A segment per DDP bucket, each a shard per rank and a tail of fewer than world elements.
    EXPECT_TRUE(zero[r].ddp.buckets_rebuilt);
    EXPECT_GT(zero[r].zero.segments, 2);
    EXPECT_EQ(zero[r].zero.segments, static_cast<int64_t>(zero[r].ddp.bucket_bytes.size()));
    EXPECT_LT(zero[r].zero.replicated_elements, zero[r].zero.segments * world);
    EXPECT_EQ(zero[r].zero.shard_elements * world,
              zero[r].zero.total_elements + (world - 1) * zero[r].zero.replicated_elements);
    const int64_t fields = o == Opt::sgd ? 1 : 2;
    EXPECT_LE(zero[r].zero.state_bytes,
              total_bytes / world + fields * 4 * zero[r].zero.replicated_elements + 8 * 8);
    // The hook still averages the slow-rank slots: every rank knows every rank's time.
    ASSERT_EQ(zero[r].ddp.rank_compute_ms.size(), static_cast<size_t>(world));
    for (double ms : zero[r].ddp.rank_compute_ms) EXPECT_GT(ms, 0.0) << "rank " << r;
    EXPECT_EQ(zero[r].ddp.rank_compute_ms, zero[0].ddp.rank_compute_ms);
  }
}

std::vector<BackendCase> reduce_scatter_cases() {
  std::vector<BackendCase> cases;
  for (const char* backend : {"gloo", "shm"}) {
    for (Opt o : {Opt::sgd, Opt::adamw}) {
      for (int world : {2, 3, 4}) cases.push_back({world, o, backend, o == Opt::adamw});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Worlds, ZeroReduceScatter, ::testing::ValuesIn(reduce_scatter_cases()),
                         [](const auto& info) {
                           return std::string(info.param.opt == Opt::sgd ? "SGD" : "AdamW") + "_" +
                                  std::to_string(info.param.world) + "ranks_" + info.param.backend +
                                  (info.param.overlap ? "_overlap" : "");
                         });

TEST(ZeroCheckpoint, SavedByTwoRanksResumesInThreeZeroRanksAndInPlainDDPAndBack) {
  lockstep::testing::TempDir dir;
  const std::string path = dir.path("zero.safetensors");
  constexpr int kHalf = kSteps / 2;
  // A ZeRO run of 2 ranks writes one ordinary checkpoint file (rank 0), the full state gathered.
  const auto errors = lockstep::testing::run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    const Result res = train(r, pg, Opt::adamw, true, 0, kHalf, nullptr);
    io::TrainingCheckpoint ckpt;
    ckpt.model = res.snapshot.model;
    ckpt.optimizer = res.snapshot.optimizer;
    ckpt.step = kHalf;
    ckpt.world_size = pg->size();
    save_checkpoint(*pg, path, ckpt);
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  const io::TrainingCheckpoint ckpt = io::load_checkpoint(path);
  const Snapshot saved{ckpt.model, ckpt.optimizer};
  // It is the checkpoint plain DDP writes at that step.
  expect_same_state(saved.optimizer, run(2, Opt::adamw, false, 0, kHalf)[0].snapshot.optimizer);

  // Uninterrupted, the 2-rank ZeRO run goes on as if never saved.
  EXPECT_EQ(run(2, Opt::adamw, true, kHalf, kHalf, &saved)[0].params,
            run(2, Opt::adamw, true, 0, kSteps)[0].params);

  // Into 3 ranks, ZeRO and plain: the same continuation, bitwise.
  const auto zero3 = run(3, Opt::adamw, true, kHalf, kHalf, &saved);
  const auto plain3 = run(3, Opt::adamw, false, kHalf, kHalf, &saved);
  EXPECT_EQ(zero3[0].params, plain3[0].params);
  expect_same_state(zero3[0].snapshot.optimizer, plain3[0].snapshot.optimizer);

  // And back: a plain 3-rank checkpoint half way resumes in 4 ZeRO ranks as in 4 plain ones.
  const Snapshot mid = run(3, Opt::adamw, false, kHalf, kHalf / 2, &saved)[0].snapshot;
  const auto zero4 = run(4, Opt::adamw, true, kHalf + kHalf / 2, kHalf / 2, &mid);
  const auto plain4 = run(4, Opt::adamw, false, kHalf + kHalf / 2, kHalf / 2, &mid);
  EXPECT_EQ(zero4[0].params, plain4[0].params);
  expect_same_state(zero4[0].snapshot.optimizer, plain4[0].snapshot.optimizer);
}

// More ranks than parameter elements: ranks 2 and 3 own only padding (no wrapped optimizer), and
// a 0-dim parameter is one piece. Gradients are set by hand, the same on every rank, as DDP leaves
// them.
// Note [ZeRO-1], Buckets: the shards follow DDP's buckets, and a checkpoint is still the one
// file plain DDP writes: saved by 3 bucket-sharded ranks (one of them mid-overlap), resumed in 2
// bucket-sharded ranks and in 2 plain ones to the same bits (shm: rank-order reduction), and a
// bucket-sharded run resumed from its own checkpoint goes on as if never saved.
TEST(ZeroCheckpoint, BucketShardsSaveTheFullStateAndReshardAcrossWorldSizes) {
  constexpr int kHalf = kSteps / 2;
  auto run_rs = [](int world, int start, int steps, const Snapshot* from, bool overlap) {
    return run(world, Opt::adamw, true, start, steps, from, "shm", /*reduce_scatter=*/true,
               overlap);
  };
  const auto saved3 = run_rs(3, 0, kHalf, nullptr, true);
  const Snapshot saved = saved3[0].snapshot;
  for (const auto& r : saved3) expect_same_state(r.snapshot.optimizer, saved.optimizer);
  expect_same_state(saved.optimizer,
                    run(3, Opt::adamw, false, 0, kHalf, nullptr, "shm")[0].snapshot.optimizer);

  const auto rs2 = run_rs(2, kHalf, kHalf, &saved, false);
  const auto plain2 = run(2, Opt::adamw, false, kHalf, kHalf, &saved, "shm");
  EXPECT_EQ(rs2[0].params, plain2[0].params);
  expect_same_state(rs2[0].snapshot.optimizer, plain2[0].snapshot.optimizer);

  EXPECT_EQ(run_rs(3, kHalf, kHalf, &saved, true)[0].params,
            run_rs(3, 0, kSteps, nullptr, true)[0].params);
}

// Note [ZeRO-1], Overlap: step() leaves the parameters as they were until the next forward of
// the DDP model (or wait_parameters()); that forward computes with the new ones.
TEST(ZeroRedundancyOptimizer, OverlappedAllGatherWritesTheParametersAtTheNextForward) {
  const auto errors = lockstep::testing::run_ranks_on("gloo", 2, [&](int r, ProcessGroupPtr pg) {
    auto model = mlp(7);
    DistributedDataParallel ddp(model, pg, {});
    ZeroRedundancyOptimizer z(
        model->parameters(), pg, [](auto g) { return make_optimizer(Opt::sgd, std::move(g)); },
        ZeroOptions{.reduce_scatter_gradients = true, .overlap_all_gather = true});
    ddp.register_comm_hook(z.comm_hook());
    const Data batch = shard(make_data(2 * kPerRank, 5), r, 2);
    z.zero_grad();
    cross_entropy(ddp.forward(batch.x), batch.y).backward();
    const auto before = param_values(*model);
    z.step();
    EXPECT_EQ(param_values(*model), before) << "rank " << r;  // not yet written
    autograd::NoGradGuard no_grad;
    const Tensor out = ddp.forward(batch.x);
    const auto after = param_values(*model);
    EXPECT_NE(after, before) << "rank " << r;
    EXPECT_EQ(out.to_vector<double>(), model->forward(batch.x).to_vector<double>());
    z.wait_parameters();  // nothing left to wait for
    EXPECT_EQ(param_values(*model), after);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// A GradScaler over bucket shards: it unscales the averaged shards each rank steps, and step 2,
// whose gradients overflow (rank 1's sample of 1e36), is skipped on every rank: 8 steps, bitwise
// plain DDP's parameters and scales. An inf found in one rank's shards alone becomes every
// rank's through agree_found_inf (checked directly: which elements overflow is not ours to pick).
TEST(ZeroRedundancyOptimizer, GradScalerSkipsOnEveryRankWhenOneShardOverflows) {
  auto run_scaled = [](bool zero) {
    std::vector<std::vector<std::vector<double>>> params(3);
    std::vector<std::vector<double>> scales(3);
    const auto errors = lockstep::testing::run_ranks_on("shm", 3, [&](int r, ProcessGroupPtr pg) {
      auto model = mlp(7);
      DistributedDataParallel ddp(model, pg, {.first_bucket_bytes = 300, .bucket_bytes = 1000});
      auto factory = [](auto g) { return make_optimizer(Opt::adamw, std::move(g)); };
      std::unique_ptr<optim::Optimizer> opt;
      if (zero) {
        auto z = std::make_unique<ZeroRedundancyOptimizer>(
            model->parameters(), pg, factory, ZeroOptions{.reduce_scatter_gradients = true});
        ddp.register_comm_hook(z->comm_hook());
        opt = std::move(z);
      } else {
        opt = factory(std::vector<optim::ParamGroup>{{model->parameters()}});
      }
      amp::GradScaler scaler;
      for (int s = 0; s < 8; ++s) {
        const Data batch = shard(make_data(3 * kPerRank, 300 + static_cast<uint64_t>(s)), r, 3);
        if (s == 2 && r == 1) {
          autograd::NoGradGuard no_grad;
          batch.x.narrow(0, 0, 1).fill_(1e36);
        }
        opt->zero_grad();
        scaler.scale(cross_entropy(ddp.forward(batch.x), batch.y)).backward();
        scaler.step(*opt);
        scaler.update();
        scales[r].push_back(scaler.get_scale());
      }
      params[r] = param_values(*model);
      // An inf that one rank alone found is every rank's (a collective; plain: as it is).
      EXPECT_EQ(opt->agree_found_inf(r == 1), zero || r == 1) << "rank " << r;
      EXPECT_FALSE(opt->agree_found_inf(false)) << "rank " << r;
    });
    for (const auto& e : errors) EXPECT_EQ(e, "");
    for (int r = 1; r < 3; ++r) EXPECT_EQ(params[r], params[0]) << "rank " << r;
    return std::make_pair(params[0], scales[0]);
  };
  const auto plain = run_scaled(false);
  const auto zero = run_scaled(true);
  EXPECT_EQ(zero.second, plain.second);
  EXPECT_EQ(zero.first, plain.first);
  // Step 2 was skipped (the scale backed off), and the others stepped (the parameters moved).
  ASSERT_EQ(plain.second.size(), 8u);
  EXPECT_LT(plain.second[2], plain.second[1]);
  EXPECT_NE(plain.first, param_values(*mlp(7)));
}

// Parameters registered big first, used big last: the gradients become ready big first, and
// DDP's rebuild (first bucket 300 bytes, later ones 1000) turns its 3 buckets (small | small |
// big, registration order reversed) into 2 (big | small small).
class ReorderedNet : public nn::Module {
 public:
  ReorderedNet() : nn::Module("ReorderedNet") {
    Generator gen(11);
    big_ = register_parameter("big", mul(randn({kIn, 250 / kIn}, gen), 0.3).requires_grad_(true));
    b_ = register_parameter("b", add(mul(randn({50}, gen), 0.1), 1.0).requires_grad_(true));
    c_ = register_parameter("c", add(mul(randn({50}, gen), 0.1), 1.0).requires_grad_(true));
  }
  Tensor forward(const Tensor& x) override {
    // (N, kIn) -> scaled by c then b (their first kIn entries), then the big product.
    const Tensor h = mul(mul(x, c_.narrow(0, 0, kIn)), b_.narrow(0, 0, kIn));
    return matmul(h, big_).narrow(1, 0, kClasses);
  }

 private:
  Tensor big_, b_, c_;
};

TEST(ZeroReduceScatter, BucketsThatTheRebuildMakesFewerEqualPlainDDP) {
  for (int world : {2, 3}) {
    std::vector<std::vector<std::vector<double>>> got(2);
    for (bool zero : {false, true}) {
      std::vector<std::vector<std::vector<double>>> params(world);
      const auto errors =
          lockstep::testing::run_ranks_on("shm", world, [&](int r, ProcessGroupPtr pg) {
            auto model = std::make_shared<ReorderedNet>();
            DistributedDataParallel ddp(model, pg,
                                        {.first_bucket_bytes = 300, .bucket_bytes = 1000});
            EXPECT_EQ(ddp.stats().bucket_bytes.size(), 3u);
            auto factory = [](auto g) { return make_optimizer(Opt::adamw, std::move(g)); };
            std::unique_ptr<optim::Optimizer> opt;
            if (zero) {
              auto z = std::make_unique<ZeroRedundancyOptimizer>(
                  model->parameters(), pg, factory,
                  ZeroOptions{.reduce_scatter_gradients = true, .overlap_all_gather = true});
              ddp.register_comm_hook(z->comm_hook());
              opt = std::move(z);
            } else {
              opt = factory(std::vector<optim::ParamGroup>{{model->parameters()}});
            }
            for (int s = 0; s < 6; ++s) {
              const Data batch =
                  shard(make_data(world * kPerRank, 500 + static_cast<uint64_t>(s)), r, world);
              opt->zero_grad();
              cross_entropy(ddp.forward(batch.x), batch.y).backward();
              opt->step();
            }
            if (zero) static_cast<ZeroRedundancyOptimizer&>(*opt).wait_parameters();
            EXPECT_EQ(ddp.stats().bucket_bytes.size(), 2u);
            params[r] = param_values(*model);
          });
      for (const auto& e : errors) EXPECT_EQ(e, "") << world << " ranks";
      for (int r = 1; r < world; ++r) EXPECT_EQ(params[r], params[0]);
      got[zero] = params[0];
    }
    EXPECT_EQ(got[1], got[0]) << world << " ranks";
    EXPECT_NE(got[0], param_values(ReorderedNet())) << world << " ranks";
  }
}

// The mistakes the bucket-sharded mode can meet, each an Error that says what to do.
TEST(ZeroRedundancyOptimizer, BucketShardingMisuseIsAClearError) {
  const auto errors = lockstep::testing::run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    auto factory = [](auto g) { return make_optimizer(Opt::sgd, std::move(g)); };
    const Data batch = shard(make_data(2 * kPerRank, 5), r, 2);
    {
      // comm_hook() never registered: DDP all-reduced, and step() says so.
      auto model = mlp(7);
      DistributedDataParallel ddp(model, pg, {});
      ZeroRedundancyOptimizer z(model->parameters(), pg, factory,
                                ZeroOptions{.reduce_scatter_gradients = true});
      cross_entropy(ddp.forward(batch.x), batch.y).backward();
      lockstep::testing::expect_error([&] { z.step(); }, {"register_comm_hook"});
      // Registered after a synchronized backward: too late.
      lockstep::testing::expect_error([&] { ddp.register_comm_hook(z.comm_hook()); },
                                      {"before the first one"});
    }
    {
      // Not every DDP parameter is the optimizer's.
      auto model = mlp(7);
      DistributedDataParallel ddp(model, pg, {});
      const auto ps = model->parameters();
      ZeroRedundancyOptimizer z(std::vector<Tensor>(ps.begin(), ps.end() - 1), pg, factory,
                                ZeroOptions{.reduce_scatter_gradients = true});
      // Said when the hook learns DDP's buckets, at registration.
      lockstep::testing::expect_error([&] { ddp.register_comm_hook(z.comm_hook()); },
                                      {"which this optimizer does not step", "'4.bias'"});
    }
    auto model = mlp(7);
    ZeroRedundancyOptimizer plain(model->parameters(), pg, factory);
    lockstep::testing::expect_error([&] { plain.comm_hook(); },
                                    {"is for ZeroOptions::reduce_scatter_gradients"});
    lockstep::testing::expect_error(
        [&] {
          ZeroRedundancyOptimizer(model->parameters(), pg, factory, {.overlap_all_gather = true});
        },
        {"needs reduce_scatter_gradients"});
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// clip_grad_norm over the shards: the norm optim::clip_grad_norm computes over the averaged
// gradients (up to the order of the f64 sums), and the step after it as plain DDP's with
// clipping.
TEST(ZeroRedundancyOptimizer, ClipGradNormOverTheShardsIsTheWholeGradientsNorm) {
  constexpr double kMaxNorm = 0.05;  // below the norm, so that it clips
  std::vector<double> norms(2), plain_norms(2);
  std::vector<std::vector<double>> got(2), want(2);
  const auto errors = lockstep::testing::run_ranks_on("shm", 2, [&](int r, ProcessGroupPtr pg) {
    const Data batch = shard(make_data(2 * kPerRank, 5), r, 2);
    auto factory = [](auto g) { return make_optimizer(Opt::adamw, std::move(g)); };
    {
      auto model = mlp(7);
      DistributedDataParallel ddp(model, pg, {.first_bucket_bytes = 300, .bucket_bytes = 1000});
      auto opt = factory(std::vector<optim::ParamGroup>{{model->parameters()}});
      cross_entropy(ddp.forward(batch.x), batch.y).backward();
      plain_norms[r] = optim::clip_grad_norm(model->parameters(), kMaxNorm);
      opt->step();
      want[r] = param_values(*model)[0];
    }
    auto model = mlp(7);
    DistributedDataParallel ddp(model, pg, {.first_bucket_bytes = 300, .bucket_bytes = 1000});
    ZeroRedundancyOptimizer z(model->parameters(), pg, factory,
                              ZeroOptions{.reduce_scatter_gradients = true});
    ddp.register_comm_hook(z.comm_hook());
    cross_entropy(ddp.forward(batch.x), batch.y).backward();
    norms[r] = z.clip_grad_norm(kMaxNorm);
    z.step();
    got[r] = param_values(*model)[0];
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  EXPECT_GT(plain_norms[0], kMaxNorm);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NEAR(norms[r], plain_norms[0], 1e-12 * plain_norms[0]) << "rank " << r;
    ASSERT_EQ(got[r].size(), want[0].size());
    for (size_t k = 0; k < got[r].size(); ++k) EXPECT_NEAR(got[r][k], want[0][k], 1e-6) << k;
  }
}

// Two elements over four ranks: no shard holds anything, the tail is everything, and every rank
// steps it (Note [ZeRO-1]).
TEST(ZeroRedundancyOptimizer, FewerElementsThanRanksAndAZeroDimParameterStepAsThePlainOptimizer) {
  constexpr int kWorld = 4;
  auto make_params = [] {
    return std::vector<Tensor>{full({1}, 0.5).requires_grad_(true),
                               full({}, -1.25).requires_grad_(true)};
  };
  auto set_grads = [](const std::vector<Tensor>& ps, int s) {
    autograd::NoGradGuard no_grad;
    ps[0].set_grad(full({1}, 0.1 * (s + 1)));
    ps[1].set_grad(full({}, -0.3 + 0.05 * s));
  };
  auto factory = [](std::vector<optim::ParamGroup> g) {
    return std::make_unique<optim::AdamW>(std::move(g), optim::AdamWOptions{.lr = 0.1});
  };
  const auto want_params = make_params();
  auto plain = factory({optim::ParamGroup{want_params}});
  for (int s = 0; s < 5; ++s) {
    set_grads(want_params, s);
    plain->step();
  }
  std::vector<std::vector<double>> got(kWorld);
  std::vector<optim::NamedTensors> state(kWorld);
  std::vector<ZeroStats> stats(kWorld);
  const auto errors = lockstep::testing::run_ranks(kWorld, [&](int r, ProcessGroupPtr pg) {
    const auto ps = make_params();
    ZeroRedundancyOptimizer z(ps, pg, factory);
    for (int s = 0; s < 5; ++s) {
      set_grads(ps, s);
      z.step();
    }
    got[r] = {ps[0].item(), ps[1].item()};
    state[r] = z.state_dict();
    stats[r] = z.stats();
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(got[r], (std::vector<double>{want_params[0].item(), want_params[1].item()}));
    expect_same_state(state[r], plain->state_dict());
    EXPECT_EQ(stats[r].shard_elements, 2) << "rank " << r;
    EXPECT_EQ(stats[r].replicated_elements, 2) << "rank " << r;
  }
}

TEST(ZeroRedundancyOptimizer, RejectsParametersOfMixedDtypes) {
  const auto errors = lockstep::testing::run_ranks(1, [&](int, ProcessGroupPtr pg) {
    Tensor a = zeros({3}).requires_grad_(true);
    Tensor b = zeros({3}, kFloat64).requires_grad_(true);
    ZeroRedundancyOptimizer z({a, b}, pg, [](auto g) {
      return std::make_unique<optim::SGD>(std::move(g), optim::SGDOptions{});
    });
  });
  EXPECT_NE(errors[0].find("one dtype and device"), std::string::npos) << errors[0];
}

}  // namespace
