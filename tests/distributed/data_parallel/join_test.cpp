// Join with ranks as threads: what it costs (nothing outside it, one header per forward inside)
// and what it refuses, on every rank alike.
#include "lockstep/distributed/join.h"
#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "lockstep/distributed/sync_batchnorm.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace lockstep::testing::ddp;
using lockstep::testing::run_ranks;

namespace {

TEST(Join, OutsideAJoinDDPIssuesNoExtraCollectiveAndInsideOneHeaderPerForward) {
  constexpr int kWorld = 2;
  std::vector<int64_t> plain(kWorld), joined(kWorld), buckets(kWorld);
  const auto errors = run_ranks(kWorld, [&](int r, ProcessGroupPtr pg) {
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(1), pg);
    optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    const Data d = make_data(4, 10 + r);
    auto step = [&] {
      opt.zero_grad();
      cross_entropy(ddp->forward(d.x), d.y).backward();
      opt.step();
    };
    // Collectives of one step: the difference of the sequence numbers of barriers around it.
    auto collectives_of = [&](const std::function<void()>& fn) {
      const int64_t before = pg->barrier()->seq();
      fn();
      return pg->barrier()->seq() - before - 1;
    };
    step();  // the first step also rebuilds the buckets (one more collective)
    plain[r] = collectives_of(step);
    Join join(*ddp);
    joined[r] = collectives_of(step);
    join.finish();
    buckets[r] = static_cast<int64_t>(ddp->stats().bucket_bytes.size());
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(plain[r], buckets[r]) << "rank " << r << ": one all-reduce per bucket, nothing else";
    EXPECT_EQ(joined[r], plain[r] + 1) << "rank " << r << ": plus the header";
  }
}

TEST(Join, RanksThatDisagreeOnNoSyncFailAlikeSayingSo) {
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(1), pg);
    const Data d = make_data(4, 10 + r);
    Join join(*ddp);
    if (r == 0) {
      auto no_sync = ddp->no_sync();
      ddp->forward(d.x);
    } else {
      ddp->forward(d.x);
    }
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("1 of the 2 ranks with data synchronize"));
    EXPECT_THAT(e, ::testing::HasSubstr("no_sync()"));
  }
}

TEST(Join, AModelWithSyncBatchNormIsRefusedOnEveryRank) {
  const auto errors = run_ranks(2, [&](int, ProcessGroupPtr pg) {
    Generator gen(1);
    auto model =
        std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
            std::make_shared<nn::Linear>(kIn, 4, gen), std::make_shared<nn::BatchNorm1d>(4)});
    auto ddp = std::make_shared<DistributedDataParallel>(convert_sync_batchnorm(model, pg), pg);
    Join join(*ddp);
  });
  for (const auto& e : errors) EXPECT_THAT(e, ::testing::HasSubstr("has a SyncBatchNorm (1)"));
}

TEST(Join, OneJoinAtATimeAndFinishOnce) {
  const auto errors = run_ranks(1, [&](int, ProcessGroupPtr pg) {
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(1), pg);
    {
      Join first(*ddp);
      EXPECT_THROW(Join second(*ddp), Error);
      first.finish();
      EXPECT_THROW(first.finish(), Error);
      Join after_finish(*ddp);  // finish() detached the first
    }
    Join after_scope(*ddp);  // so did the destructor
    EXPECT_FALSE(after_scope.next(false));
    EXPECT_EQ(after_scope.steps_shadowed(), 0);
  });
  EXPECT_EQ(errors[0], "");
}

}  // namespace
