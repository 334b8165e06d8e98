// DistributedDataParallel with ranks as threads over a HashStore: equivalence with one process
// on the whole batch, gradient accumulation with no_sync, unused parameters, mismatched models,
// compression hooks, bucket statistics.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "distributed/cost_model_settings.h"
#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/distributed/cost_model.h"
#include "lockstep/distributed/data_parallel.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/gloo/process_group_gloo.h"
#include "lockstep/distributed/store/hash_store.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;
using namespace lockstep::testing::ddp;

namespace {

void expect_close_params(const std::vector<std::vector<double>>& got,
                         const std::vector<std::vector<double>>& want, double rel,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k) {
    ASSERT_EQ(got[k].size(), want[k].size()) << what;
    for (size_t i = 0; i < got[k].size(); ++i) {
      const double tol = rel * std::max(1.0, std::abs(want[k][i]));
      ASSERT_NEAR(got[k][i], want[k][i], tol) << what << ": parameter " << k << " element " << i;
    }
  }
}

// Groups as the registry makes them (a world of one needs no network).
std::vector<std::string> run_ranks(int world,
                                   const std::function<void(int, ProcessGroupPtr)>& body) {
  return lockstep::testing::run_ranks(world, body, 60s, /*via_registry=*/true);
}

// Completes a Work as a backend does: the test's slow channel below plays a backend.
struct BackendSide : ProcessGroup {
  using ProcessGroup::work_finish;
};

// Small caps: the MLP's 1,491 parameters (~6 KiB) spread over several buckets.
DDPOptions many_buckets() {
  DDPOptions o;
  o.first_bucket_bytes = 256;
  o.bucket_bytes = 1024;
  return o;
}

constexpr int kSteps = 4;
constexpr int64_t kBatch = 8;  // the whole batch per step, over all ranks

// One process on the whole batch: the reference.
std::vector<std::vector<double>> train_single(const Data& data) {
  auto model = mlp(7);
  optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < kSteps; ++s) {
    Data step{data.x.narrow(0, s * kBatch, kBatch), data.y.narrow(0, s * kBatch, kBatch)};
    opt.zero_grad();
    cross_entropy(model->forward(step.x), step.y).backward();
    opt.step();
  }
  return param_values(*model);
}

class DDPEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(DDPEquivalence, RanksOnShardsEqualOneProcessOnTheWholeBatch) {
  const int world = GetParam();
  const Data data = make_data(kSteps * kBatch, 11);
  const auto want = train_single(data);
  std::vector<std::vector<std::vector<double>>> got(static_cast<size_t>(world));
  std::vector<DDPStats> stats(static_cast<size_t>(world));
  const auto errors = run_ranks(world, [&](int r, ProcessGroupPtr pg) {
    // Ranks build their models from different seeds: DDP must broadcast rank 0's parameters.
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(7 + r), pg, many_buckets());
    optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
    for (int s = 0; s < kSteps; ++s) {
      Data step{data.x.narrow(0, s * kBatch, kBatch), data.y.narrow(0, s * kBatch, kBatch)};
      Data mine = shard(step, r, world);
      opt.zero_grad();
      cross_entropy(ddp->forward(mine.x), mine.y).backward();
      opt.step();
    }
    got[r] = param_values(*ddp->module());
    stats[r] = ddp->stats();
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < world; ++r)
    expect_close_params(got[r], want, 1e-5, "rank " + std::to_string(r));
  // Bit-identical across ranks.
  for (int r = 1; r < world; ++r) EXPECT_EQ(got[r], got[0]) << "rank " << r << " drifted";
  EXPECT_GE(stats[0].bucket_bytes.size(), 4u) << stats[0].str();
  EXPECT_TRUE(stats[0].buckets_rebuilt);
  EXPECT_EQ(stats[0].synced_steps, kSteps);
  int64_t total = 0, want_bytes = 0;
  for (int64_t b : stats[0].bucket_bytes) total += b;
  for (const auto& p : mlp(0)->parameters()) want_bytes += p.nbytes();
  EXPECT_EQ(total, want_bytes);
  EXPECT_EQ(stats[0].bytes_reduced_last_step, want_bytes);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DDPEquivalence, ::testing::Values(1, 2, 4));

// bucket_bytes = kBucketBytesFromGroup (bucket_bytes_from_group): the cap a gloo group's link
// makes worth it. The link settings are cleared around each test, so that the caller's
// environment cannot change the caps.
class DDPBucketsFromGroup : public ::testing::Test {
 protected:
  void SetUp() override { lockstep::testing::clear_cost_model_settings(); }
  void TearDown() override { lockstep::testing::clear_cost_model_settings(); }

};

// Six 512 x 512 layers: 1 MiB weights, 6 MiB in all, more than the default link's cap.
std::shared_ptr<nn::Module> six_layers() {
  Generator gen(3);
  auto s = std::make_shared<nn::Sequential>();
  for (int i = 0; i < 6; ++i) s->push_back(std::make_shared<nn::Linear>(512, 512, gen));
  return s;
}

TEST_F(DDPBucketsFromGroup, BucketsAreThoseOfTheCapTheGroupsLinkGives) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  const auto errors = run_ranks(4, [&](int r, ProcessGroupPtr pg) {
    // The default link (50 us, 10 Gbit/s) over four ranks: 3 alpha is 5% of a 2.4 MB call.
    const int64_t cap = bucket_bytes_from_group(*pg);
    EXPECT_EQ(cap, 3 * kMiB) << "rank " << r;
    DDPOptions from_group;
    from_group.bucket_bytes = kBucketBytesFromGroup;
    DDPOptions explicit_cap;
    explicit_cap.bucket_bytes = cap;
    auto buckets_with = [&](const DDPOptions& o) {
      return std::make_shared<DistributedDataParallel>(six_layers(), pg, o)->stats().bucket_bytes;
    };
    const auto got = buckets_with(from_group);
    const auto want = buckets_with(explicit_cap);
    const auto by_default = buckets_with(DDPOptions{});
    EXPECT_EQ(got, want) << "rank " << r;
    EXPECT_NE(got, by_default) << "rank " << r;  // the default's 25 MiB holds all but the first
    for (int64_t b : got) EXPECT_LE(b, cap) << "rank " << r;
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_F(DDPBucketsFromGroup, FollowTheLinkWithinOneAnd25MiBAndOtherBackendsKeepTheDefault) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  auto cap_on = [](const std::string& backend) {
    std::vector<int64_t> caps(3);
    const auto errors = lockstep::testing::run_ranks_on(
        backend, 3, [&](int r, ProcessGroupPtr pg) { caps[r] = bucket_bytes_from_group(*pg); });
    for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << backend << " rank " << r;
    for (int r = 1; r < 3; ++r) EXPECT_EQ(caps[r], caps[0]) << backend << " rank " << r;
    return caps[0];
  };
  // 2 ms rounds at 1 Gbit/s over three ranks: bucket_bytes_for's own answer, inside the range.
  ::setenv(env::kNetAlphaUs, "2000", 1);
  ::setenv(env::kNetGbps, "1", 1);
  const int64_t slow = bucket_bytes_for(LinkModel{2e-3, 8e-9}, 3);
  EXPECT_GT(slow, kMiB);
  EXPECT_LT(slow, kDefaultBucketBytes);
  EXPECT_EQ(cap_on("gloo"), slow);
  // One-second rounds would want gigabyte buckets: capped at the default.
  ::setenv(env::kNetAlphaUs, "1000000", 1);
  EXPECT_EQ(cap_on("gloo"), kDefaultBucketBytes);
  // A fast link would want less than a MiB: the first bucket's size is the floor.
  ::setenv(env::kNetAlphaUs, "1", 1);
  ::setenv(env::kNetGbps, "100", 1);
  EXPECT_EQ(cap_on("gloo"), kMiB);
  // Shared memory has no link model: the default.
  EXPECT_EQ(cap_on("shm"), kDefaultBucketBytes);
}

TEST(DDP, NoSyncAccumulatesLocallyThenReducesOnce) {
  // 3 micro-batches per rank, the first two inside no_sync(), loss / 3: one step on the
  // 3 x 2 x 2 = 12-sample batch of one process.
  constexpr int kMicro = 3, kWorld = 2;
  constexpr int64_t kMicroBatch = 2;
  const Data data = make_data(kMicro * kWorld * kMicroBatch, 5);
  auto ref = mlp(3);
  optim::SGD ref_opt(ref->parameters(), {.lr = 0.5});
  cross_entropy(ref->forward(data.x), data.y).backward();
  ref_opt.step();
  const auto want = param_values(*ref);

  std::vector<std::vector<std::vector<double>>> got(kWorld);
  std::vector<int64_t> synced(kWorld), launches(kWorld), buckets(kWorld);
  const auto errors = run_ranks(kWorld, [&](int r, ProcessGroupPtr pg) {
    // Counts the all-reduces the reducer launches (one per bucket per synced backward).
    DDPOptions o = many_buckets();
    const CommHook inner = o.comm_hook;
    o.comm_hook.start = [&, inner](ProcessGroup& g, GradBucket& b) {
      ++launches[r];
      return inner.start(g, b);
    };
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(3), pg, o);
    optim::SGD opt(ddp->parameters(), {.lr = 0.5});
    opt.zero_grad();
    // Rank r's micro-batch k: rows of the big batch, so the union over ranks and k is all of it.
    auto micro = [&](int k) {
      const int64_t start = (k * kWorld + r) * kMicroBatch;
      return Data{data.x.narrow(0, start, kMicroBatch), data.y.narrow(0, start, kMicroBatch)};
    };
    for (int k = 0; k < kMicro - 1; ++k) {
      auto guard = ddp->no_sync();
      Data d = micro(k);
      div(cross_entropy(ddp->forward(d.x), d.y), static_cast<double>(kMicro)).backward();
    }
    Data d = micro(kMicro - 1);
    div(cross_entropy(ddp->forward(d.x), d.y), static_cast<double>(kMicro)).backward();
    opt.step();
    got[r] = param_values(*ddp->module());
    synced[r] = ddp->stats().synced_steps;
    buckets[r] = static_cast<int64_t>(ddp->stats().bucket_bytes.size());
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < kWorld; ++r) {
    expect_close_params(got[r], want, 1e-5, "rank " + std::to_string(r));
    EXPECT_EQ(synced[r], 1) << "no_sync backward passes must not communicate";
    EXPECT_GT(buckets[r], 1);
    EXPECT_EQ(launches[r], buckets[r]) << "one all-reduce per bucket, once per optimizer step";
  }
}

TEST(DDP, UnusedParameterIsAnErrorOnEveryRankNamingIt) {
  const Data data = make_data(4, 9);
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    auto ddp = std::make_shared<DistributedDataParallel>(std::make_shared<OneHeadUsed>(1), pg);
    Data d = shard(data, r, 2);
    cross_entropy(ddp->forward(d.x), d.y).backward();
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("received no gradient"));
    EXPECT_THAT(e, ::testing::HasSubstr("unused.weight"));
    EXPECT_THAT(e, ::testing::HasSubstr("find_unused_parameters"));
  }
}

TEST(DDP, UnusedOnOneRankOnlyFailsBothRanks) {
  // Rank 1's forward skips the model (a data-dependent branch): its parameters are all unused
  // there, used on rank 0. Neither rank may hang.
  const Data data = make_data(4, 9);
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(1), pg, many_buckets());
    Data d = shard(data, r, 2);
    if (r == 0) {
      cross_entropy(ddp->forward(d.x), d.y).backward();
    } else {
      ddp->forward(d.x);  // output not used in the loss
      // The loss touches one parameter only, directly.
      Tensor p0 = ddp->module()->parameters()[0];
      sum(mul(p0, 0.0)).backward();
    }
  });
  for (const auto& e : errors) EXPECT_THAT(e, ::testing::HasSubstr("received no gradient"));
  EXPECT_THAT(errors[0], ::testing::HasSubstr("rank 1: "));
}

TEST(DDP, FindUnusedParametersReducesWithZeroContribution) {
  const Data data = make_data(4, 9);
  std::vector<std::vector<double>> used_grad(2), unused_grad(2);
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    DDPOptions o;
    o.find_unused_parameters = true;
    auto ddp = std::make_shared<DistributedDataParallel>(std::make_shared<OneHeadUsed>(1), pg, o);
    Data d = shard(data, r, 2);
    cross_entropy(ddp->forward(d.x), d.y).backward();
    for (const auto& [name, p] : ddp->module()->named_parameters()) {
      if (name == "used.weight") used_grad[r] = p.grad().to_vector<double>();
      if (name == "unused.weight") unused_grad[r] = p.grad().to_vector<double>();
    }
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  // The used head's gradient is the whole batch's.
  auto ref = std::make_shared<OneHeadUsed>(1);
  cross_entropy(ref->forward(data.x), data.y).backward();
  std::vector<double> want;
  for (const auto& [name, p] : ref->named_parameters()) {
    if (name == "used.weight") want = p.grad().to_vector<double>();
  }
  for (int r = 0; r < 2; ++r) {
    expect_close_params({used_grad[r]}, {want}, 1e-5, "used head");
    for (double v : unused_grad[r]) EXPECT_EQ(v, 0.0);
  }
}

TEST(DDP, MismatchedModelsFailEveryRankNamingTheDifference) {
  const auto errors = run_ranks(3, [&](int r, ProcessGroupPtr pg) {
    DistributedDataParallel ddp(mlp(1, r == 2 ? 16 : kHidden), pg);
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("ranks built different models"));
    EXPECT_THAT(e, ::testing::HasSubstr("'0.weight' [32, 6] f32 on rank 0"));
    EXPECT_THAT(e, ::testing::HasSubstr("'0.weight' [16, 6] f32 on rank 2"));
  }
}

class DDPCompression : public ::testing::TestWithParam<std::string> {};

TEST_P(DDPCompression, HalvesTheWireAndStaysWithinItsPrecision) {
  const Data data = make_data(kBatch, 13);
  auto ref = mlp(2);
  cross_entropy(ref->forward(data.x), data.y).backward();
  std::vector<std::vector<double>> want;
  for (const auto& p : ref->parameters()) want.push_back(p.grad().to_vector<double>());
  std::vector<std::vector<std::vector<double>>> got(2);
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    DDPOptions o = many_buckets();
    o.comm_hook = GetParam() == "bf16" ? bf16_compress_hook() : fp16_compress_hook();
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(2), pg, o);
    Data d = shard(data, r, 2);
    cross_entropy(ddp->forward(d.x), d.y).backward();
    for (const auto& p : ddp->module()->parameters()) {
      got[r].push_back(p.grad().to_vector<double>());
      LS_CHECK(p.grad().dtype() == kFloat32, "gradients stay f32");
    }
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  const double tol = GetParam() == "bf16" ? 1e-2 : 2e-3;
  for (int r = 0; r < 2; ++r) {
    for (size_t k = 0; k < want.size(); ++k) {
      for (size_t i = 0; i < want[k].size(); ++i) {
        ASSERT_NEAR(got[r][k][i], want[k][i], tol * std::max(0.05, std::abs(want[k][i])))
            << GetParam() << " parameter " << k << " element " << i;
      }
    }
  }
  EXPECT_EQ(got[0], got[1]);
}

INSTANTIATE_TEST_SUITE_P(Hooks, DDPCompression, ::testing::Values("bf16", "fp16"));

TEST(DDP, GradientsAreViewsIntoBucketsAndSurviveSetToNone) {
  const Data data = make_data(4, 3);
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(1), pg);  // one bucket
    optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad(/*set_to_none=*/s % 2 == 0);
      Data d = shard(data, r, 2);
      cross_entropy(ddp->forward(d.x), d.y).backward();
      opt.step();
    }
    // The last layer's weight and bias are neighbours in the one bucket's flat buffer.
    auto ps = ddp->module()->parameters();
    const auto* w = static_cast<const char*>(ps[4].grad().data_ptr());
    const auto* b = static_cast<const char*>(ps[5].grad().data_ptr());
    LS_CHECK(b == w + ps[4].nbytes() || w == b + ps[5].nbytes(),
             "gradients are not laid out in a shared bucket");
    LS_CHECK(ddp->stats().bucket_bytes.size() == 1, ddp->stats().str());
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
}

}  // namespace

namespace {

// Overlap, shown by the order of events rather than by timing. The communication hook hands
// buckets to a deliberately slow channel (a thread that holds every reduction back until the
// backward pass has computed the first layer's gradient, the last one it computes). If DDP
// waited for a bucket's reduction before finishing backward, the channel would never be
// released (it gives up after 30 s and the test fails); with overlap, bucket 0 is launched
// before that gradient exists and reduced while backward goes on.
TEST(DDP, BucketsAreReducedWhileBackwardStillRuns) {
  const Data data = make_data(4, 21);
  std::vector<std::vector<std::string>> events(2);
  std::vector<std::vector<std::vector<double>>> grads(2);
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    std::mutex mu;
    std::condition_variable cv;
    bool first_layer_done = false, stop = false;
    std::deque<std::pair<GradBucket*, WorkPtr>> requests;
    auto log = [&](const std::string& e) {
      std::lock_guard<std::mutex> lock(mu);
      events[r].push_back(e);
    };
    std::thread channel([&] {
      std::unique_lock<std::mutex> lock(mu);
      if (!cv.wait_for(lock, 30s, [&] { return first_layer_done; })) {
        events[r].push_back("channel gave up: backward waited for communication");
      }
      for (;;) {
        cv.wait(lock, [&] { return stop || !requests.empty(); });
        if (requests.empty()) return;
        auto [bucket, work] = requests.front();
        requests.pop_front();
        lock.unlock();
        pg->all_reduce(bucket->buffer, {.op = ReduceOp::avg})->wait();
        BackendSide::work_finish(*work);
        lock.lock();
      }
    });
    DDPOptions o = many_buckets();
    o.comm_hook.name = "slow channel";
    o.comm_hook.start = [&](ProcessGroup&, GradBucket& b) {
      auto work = std::make_shared<Work>("slow bucket " + std::to_string(b.index), b.index);
      {
        std::lock_guard<std::mutex> lock(mu);
        events[r].push_back("launch " + std::to_string(b.index));
        requests.emplace_back(&b, work);
      }
      cv.notify_all();
      return work;
    };
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(4), pg, o);
    // The first layer's weight is the last gradient backward computes.
    auto first = ddp->module()->parameters()[0];
    first.register_post_accumulate_grad_hook([&](Tensor&) {
      {
        std::lock_guard<std::mutex> lock(mu);
        events[r].push_back("grad of the first layer");
        first_layer_done = true;
      }
      cv.notify_all();
    });
    Data d = shard(data, r, 2);
    cross_entropy(ddp->forward(d.x), d.y).backward();
    log("backward returned");
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    channel.join();
    for (const auto& p : ddp->module()->parameters())
      grads[r].push_back(p.grad().to_vector<double>());
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  EXPECT_EQ(grads[0], grads[1]);
  for (int r = 0; r < 2; ++r) {
    const auto& ev = events[r];
    auto at = [&](const std::string& e) { return std::find(ev.begin(), ev.end(), e) - ev.begin(); };
    const auto n = static_cast<long>(ev.size());
    ASSERT_LT(at("launch 0"), n) << "bucket 0 never launched";
    EXPECT_LT(at("launch 0"), at("grad of the first layer"))
        << "the first bucket went out only after backward had computed every gradient";
    EXPECT_EQ(at("channel gave up: backward waited for communication"), n);
    EXPECT_LT(at("grad of the first layer"), at("backward returned"));
  }
}

}  // namespace

namespace {

TEST(DataParallel, ReplicasOnThreadsEqualOneModelOnTheWholeBatch) {
  const Data data = make_data(kSteps * 9, 31);  // 9 rows per step: chunks of 3/3/3 and 5/4
  for (int replicas : {2, 3}) {
    auto ref = mlp(8);
    optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
    int seed = 0;
    DataParallel dp([&] { return mlp(8 + seed++); }, replicas);  // replicas differ until synced
    optim::SGD opt(dp.module()->parameters(), {.lr = 0.1, .momentum = 0.9});
    for (int s = 0; s < kSteps; ++s) {
      Tensor x = data.x.narrow(0, s * 9, 9), y = data.y.narrow(0, s * 9, 9);
      ref_opt.zero_grad();
      Tensor l = cross_entropy(ref->forward(x), y);
      l.backward();
      ref_opt.step();
      opt.zero_grad();
      const double dl = dp.forward_backward(
          x, y, [](const Tensor& out, const Tensor& t) { return cross_entropy(out, t); });
      opt.step();
      EXPECT_NEAR(dl, l.item(), 1e-5) << replicas << " replicas, step " << s;
    }
    expect_close_params(param_values(*dp.module()), param_values(*ref), 1e-5,
                        std::to_string(replicas) + " replicas");
  }
}

TEST(DataParallel, ReplicasOfDifferentArchitecturesAreAnError) {
  int k = 0;
  lockstep::testing::expect_error(
      [&] { DataParallel dp([&] { return mlp(1, k++ == 0 ? 32 : 16); }, 2); },
      {"replica 1's parameter 0", "[16, 6]", "[32, 6]"});
}

}  // namespace

namespace {

// A CNN and a model with BatchNorm, through the same check as the MLP: K steps of DDP on shards
// against one process. BatchNorm normalizes with each rank's own batch statistics (as PyTorch's
// DDP without SyncBatchNorm), so its single-process reference forwards each rank's half
// separately and averages the losses; buffers follow rank 0's (broadcast before each forward).
using ModelFactory = std::function<std::shared_ptr<nn::Module>(uint64_t)>;

std::shared_ptr<nn::Module> small_cnn(uint64_t seed) {
  Generator gen(seed);
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Conv2d>(1, 4, 3, gen), std::make_shared<nn::ReLU>(),  // (B,4,6,6)
      std::make_shared<nn::MaxPool2d>(2),                                        // (B,4,3,3)
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(36, kClasses, gen)});
}

std::shared_ptr<nn::Module> with_batchnorm(uint64_t seed) {
  Generator gen(seed);
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(64, 16, gen),
      std::make_shared<nn::BatchNorm1d>(16), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(16, kClasses, gen)});
}

void check_equivalence(const ModelFactory& make, bool per_rank_reference) {
  constexpr int kWorld = 2;
  Generator gen(41);
  Tensor x = randn({kSteps * kBatch, 1, 8, 8}, gen);
  Tensor y = randint(0, kClasses, {kSteps * kBatch}, gen);
  auto ref = make(3);
  optim::SGD ref_opt(ref->parameters(), {.lr = 0.05, .momentum = 0.9});
  for (int s = 0; s < kSteps; ++s) {
    Tensor xs = x.narrow(0, s * kBatch, kBatch), ys = y.narrow(0, s * kBatch, kBatch);
    ref_opt.zero_grad();
    if (per_rank_reference) {
      const int64_t h = kBatch / kWorld;
      Tensor l0 = cross_entropy(ref->forward(xs.narrow(0, 0, h)), ys.narrow(0, 0, h));
      Tensor l1 = cross_entropy(ref->forward(xs.narrow(0, h, h)), ys.narrow(0, h, h));
      div(add(l0, l1), 2.0).backward();
    } else {
      cross_entropy(ref->forward(xs), ys).backward();
    }
    ref_opt.step();
  }
  const auto want = param_values(*ref);
  std::vector<std::vector<std::vector<double>>> got(kWorld), bufs(kWorld);
  const auto errors = run_ranks(kWorld, [&](int r, ProcessGroupPtr pg) {
    auto ddp = std::make_shared<DistributedDataParallel>(make(3 + r), pg, many_buckets());
    optim::SGD opt(ddp->parameters(), {.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < kSteps; ++s) {
      const int64_t h = kBatch / kWorld;
      Tensor xs = x.narrow(0, s * kBatch + r * h, h), ys = y.narrow(0, s * kBatch + r * h, h);
      opt.zero_grad();
      cross_entropy(ddp->forward(xs), ys).backward();
      opt.step();
    }
    ddp->forward(x.narrow(0, 0, 2));  // one more buffer broadcast: every rank has rank 0's
    got[r] = param_values(*ddp->module());
    for (const auto& b : ddp->module()->buffers()) bufs[r].push_back(b.to_vector<double>());
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < kWorld; ++r)
    expect_close_params(got[r], want, 1e-5, "rank " + std::to_string(r));
  EXPECT_EQ(got[0], got[1]);
  EXPECT_EQ(bufs[0], bufs[1]);
}

TEST(DDP, CnnOnShardsEqualsOneProcess) { check_equivalence(small_cnn, false); }

TEST(DDP, BatchNormModelOnShardsEqualsOneProcessWithPerRankStatistics) {
  check_equivalence(with_batchnorm, true);
}

}  // namespace
