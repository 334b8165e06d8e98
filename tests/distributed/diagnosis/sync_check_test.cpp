// Silent divergence (Note [Sync check]): check_in_sync and DDPOptions::check_sync_every, ranks as
// threads over a HashStore.
#include "lockstep/distributed/sync_check.h"
#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/nn/layers.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;
using namespace lockstep::testing::ddp;

namespace {

std::vector<std::string> run_ranks(int world,
                                   const std::function<void(int, ProcessGroupPtr)>& body) {
  return lockstep::testing::run_ranks(world, body, 60s, /*via_registry=*/true);
}

TEST(TensorHash, SeesEveryBitTheDtypeAndTheShapeButNotTheStrides) {
  Tensor a = from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3}).to(kFloat32);
  Tensor b = a.clone();
  EXPECT_EQ(tensor_hash(a), tensor_hash(b));
  // The smallest change of one element: its last mantissa bit.
  auto* p = static_cast<uint32_t*>(b.data_ptr());
  p[4] ^= 1u;
  EXPECT_NE(tensor_hash(a), tensor_hash(b));
  EXPECT_NE(tensor_hash(a), tensor_hash(a.to(kFloat64)));
  EXPECT_NE(tensor_hash(a), tensor_hash(a.view({3, 2})));
  // A transposed view hashes as its contiguous copy.
  Tensor t = a.transpose(0, 1);
  ASSERT_FALSE(t.is_contiguous());
  EXPECT_EQ(tensor_hash(t), tensor_hash(t.contiguous()));
  // Sizes that are not a multiple of 8 bytes: the tail counts too.
  Tensor odd = from_vector(std::vector<double>{1, 2, 3}, {3}).to(kFloat32);
  Tensor odd2 = odd.clone();
  static_cast<uint32_t*>(odd2.data_ptr())[2] ^= 1u;
  EXPECT_NE(tensor_hash(odd), tensor_hash(odd2));
}

// DDP with check_sync_every = 2: steps in sync pass; after rank 1 alone nudges one parameter, the
// next check fails on every rank, naming that parameter and the ranks on each side.
TEST(SyncCheck, ADivergedParameterStopsEveryRankNamingItAndTheRanks) {
  const Data data = make_data(8 * 6, 5);
  std::vector<std::string> name(3);
  const auto errors = run_ranks(3, [&](int r, ProcessGroupPtr pg) {
    DDPOptions o;
    o.check_sync_every = 2;
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(3), pg, o);
    optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    for (int s = 0; s < 6; ++s) {
      if (s == 3 && r == 1) {
        auto named = ddp->module()->named_parameters();
        name[r] = named[1].first;
        autograd::NoGradGuard no_grad;
        named[1].second.add_(full(named[1].second.shape(), 1e-6, kFloat32));
      }
      Data step{data.x.narrow(0, s * 8, 8), data.y.narrow(0, s * 8, 8)};
      Data mine = shard(step, r, 3);
      opt.zero_grad();
      cross_entropy(ddp->forward(mine.x), mine.y).backward();
      opt.step();
      // The checks run at forwards 0, 2 and 4: the nudge before forward 3 is seen at forward 4.
      LS_CHECK(s < 4, "step ", s, " ran past the check that should have failed");
    }
  });
  ASSERT_FALSE(name[1].empty());
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("parameters diverged: the parameter '" + name[1] +
                                                "' differs between ranks: ranks 0, 2 hold one "
                                                "value"))
        << "rank " << r;
    EXPECT_THAT(errors[r], ::testing::HasSubstr("rank 1 another")) << "rank " << r;
  }
}

// Buffers too (DDP's buffer broadcast would hide a buffer's divergence, so this calls the check
// directly): three ranks, three different running means.
TEST(SyncCheck, BuffersAreComparedAndEverySideIsNamed) {
  const auto errors = run_ranks(3, [&](int r, ProcessGroupPtr pg) {
    nn::BatchNorm1d bn(4);
    check_in_sync(bn, *pg);  // the same on every rank: no error
    if (r > 0) {
      autograd::NoGradGuard no_grad;
      bn.named_buffers()[0].second.fill_(static_cast<double>(r));
    }
    check_in_sync(bn, *pg);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("the buffer '")) << "rank " << r;
    EXPECT_THAT(errors[r], ::testing::HasSubstr("rank 0 holds one value")) << "rank " << r;
    EXPECT_THAT(errors[r], ::testing::HasSubstr(", rank 1 another")) << "rank " << r;
    EXPECT_THAT(errors[r], ::testing::HasSubstr(", and rank 2 another")) << "rank " << r;
    EXPECT_EQ(errors[r], errors[0]) << "every rank reports the same";
  }
}

TEST(SyncCheck, ANegativePeriodIsAnError) {
  const auto errors = run_ranks(1, [&](int, ProcessGroupPtr pg) {
    DDPOptions o;
    o.check_sync_every = -1;
    DistributedDataParallel ddp(mlp(3), pg, o);
  });
  EXPECT_THAT(errors[0], ::testing::HasSubstr("check_sync_every must be >= 0"));
}

}  // namespace

// Note [Same settings]: ranks that agree pass; a setting that differs stops every rank with the
// same message, naming it and the value of each side (long values too: they travel in words).
TEST(SameSettings, ADifferentSettingStopsEveryRankNamingItAndBothValues) {
  const std::string long_path(1000, 'd');
  const auto errors = run_ranks(3, [&](int r, ProcessGroupPtr pg) {
    check_same_settings(*pg, {{"--seed", "1"}, {"--lr", "0.05"}}, "why");
    check_same_settings(
        *pg, {{"--seed", "1"}, {"--batch-size", r == 2 ? "32" : "64"}, {"the data", long_path}},
        "Start every rank with the same flags.");
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(errors[r],
                ::testing::HasSubstr("ranks disagree on --batch-size: ranks 0, 1 have 64, and "
                                     "rank 2 has 32. Start every rank with the same flags."))
        << "rank " << r;
    EXPECT_EQ(errors[r], errors[0]) << "every rank reports the same";
  }
  const auto long_errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    check_same_settings(*pg, {{"the data", r == 0 ? long_path : long_path + "x"}}, "");
  });
  EXPECT_THAT(long_errors[1], ::testing::HasSubstr("rank 1 has " + long_path + "x"));
  EXPECT_THAT(long_errors[1], ::testing::HasSubstr("rank 0 has " + long_path + ","));
}

TEST(SameSettings, ADifferentCountOfSettingsIsAnErrorNotAHang) {
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    std::vector<Setting> s{{"--seed", "1"}};
    if (r == 1) s.push_back({"--lr", "1"});
    check_same_settings(*pg, s, "");
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_THAT(errors[r], ::testing::HasSubstr("ranks disagree on the settings they check"));
}
