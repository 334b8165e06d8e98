// GradScaler: skipped steps on inf/NaN, backoff and growth of the scale, clean steps equal to
// unscaled SGD, and under DDP the same decision on every rank when only one overflowed.
#include <cmath>
#include <limits>

#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "lockstep/amp/grad_scaler.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::testing::ddp;

namespace {

// One parameter w (3), loss = sum(w * x).
struct Toy {
  Tensor w = full({3}, 1.0).requires_grad_();
  optim::SGD opt{std::vector<Tensor>{w}, {.lr = 0.5}};
  void backward(const amp::GradScaler& s, double x) { s.scale(sum(mul(w, x))).backward(); }
};

TEST(GradScaler, CleanStepEqualsAnUnscaledStep) {
  Toy t;
  amp::GradScaler s({.init_scale = 1024.0});
  t.opt.zero_grad();
  t.backward(s, 2.0);
  EXPECT_DOUBLE_EQ(t.w.grad().to_vector<double>()[0], 2.0 * 1024.0);  // scaled gradient
  EXPECT_TRUE(s.step(t.opt));
  s.update();
  // dL/dw = 2, unscaled before the step: w = 1 - 0.5 * 2 = 0.
  for (double v : t.w.to_vector<double>()) EXPECT_DOUBLE_EQ(v, 0.0);
  EXPECT_DOUBLE_EQ(s.get_scale(), 1024.0);
  EXPECT_FALSE(s.last_step_skipped());
}

TEST(GradScaler, InfOrNanSkipsTheStepAndHalvesTheScale) {
  for (double bad :
       {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    Toy t;
    amp::GradScaler s({.init_scale = 1024.0});
    t.opt.zero_grad();
    t.backward(s, bad);
    EXPECT_FALSE(s.step(t.opt)) << bad;
    s.update();
    for (double v : t.w.to_vector<double>()) EXPECT_DOUBLE_EQ(v, 1.0) << bad;  // untouched
    EXPECT_DOUBLE_EQ(s.get_scale(), 512.0) << bad;
    EXPECT_TRUE(s.last_step_skipped());
  }
}

TEST(GradScaler, GrowsAfterGrowthIntervalCleanStepsAndAnOverflowRestartsTheCount) {
  Toy t;
  amp::GradScaler s({.init_scale = 8.0, .growth_interval = 3});
  auto one = [&](double x) {
    t.opt.zero_grad();
    t.backward(s, x);
    s.step(t.opt);
    s.update();
  };
  one(1e-3);
  one(1e-3);
  EXPECT_DOUBLE_EQ(s.get_scale(), 8.0);
  one(1e-3);
  EXPECT_DOUBLE_EQ(s.get_scale(), 16.0);  // third clean step
  one(1e-3);
  one(std::numeric_limits<double>::infinity());
  EXPECT_DOUBLE_EQ(s.get_scale(), 8.0);  // backoff, count restarts
  one(1e-3);
  one(1e-3);
  EXPECT_DOUBLE_EQ(s.get_scale(), 8.0);
  one(1e-3);
  EXPECT_DOUBLE_EQ(s.get_scale(), 16.0);
}

TEST(GradScaler, UnscaleThenClipSeesTheTrueGradients) {
  Toy t;
  amp::GradScaler s({.init_scale = 4096.0});
  t.opt.zero_grad();
  t.backward(s, 4.0);  // true gradient (4, 4, 4), norm sqrt(48)
  s.unscale_(t.opt);
  const double norm = optim::clip_grad_norm({t.w}, 1.0);
  EXPECT_NEAR(norm, std::sqrt(48.0), 1e-9);
  EXPECT_TRUE(s.step(t.opt));  // not unscaled twice
  s.update();
  for (double v : t.w.to_vector<double>())
    EXPECT_NEAR(v, 1.0 - 0.5 * 4.0 / std::sqrt(48.0), 1e-6);  // f32
}

TEST(GradScaler, MisuseIsAnError) {
  Toy t;
  amp::GradScaler s;
  t.opt.zero_grad();
  t.backward(s, 1.0);
  s.unscale_(t.opt);
  lockstep::testing::expect_error([&] { s.unscale_(t.opt); }, {"already called", "update()"});
  lockstep::testing::expect_error([] { amp::GradScaler bad({.backoff_factor = 1.5}); },
                                  {"backoff_factor", "1.5"});
}

TEST(GradScaler, DisabledIsAPassThrough) {
  Toy t;
  amp::GradScaler s({.enabled = false});
  t.opt.zero_grad();
  t.backward(s, 2.0);
  EXPECT_DOUBLE_EQ(t.w.grad().to_vector<double>()[0], 2.0);
  EXPECT_TRUE(s.step(t.opt));
  s.update();
  for (double v : t.w.to_vector<double>()) EXPECT_DOUBLE_EQ(v, 0.0);
}

TEST(GradScaler, StateDictRoundTrips) {
  amp::GradScaler a({.init_scale = 8.0, .growth_interval = 5});
  Toy t;
  for (int i = 0; i < 2; ++i) {
    t.opt.zero_grad();
    t.backward(a, 1.0);
    a.step(t.opt);
    a.update();
  }
  amp::GradScaler b;
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.state_dict(), a.state_dict());
  EXPECT_DOUBLE_EQ(b.state_dict().at("_growth_tracker"), 2.0);
  lockstep::testing::expect_error([&] { b.load_state_dict({{"scale", -1.0}}); }, {"scale"});
  auto bad = a.state_dict();
  bad["backoff_factor"] = 2.0;
  lockstep::testing::expect_error([&] { b.load_state_dict(bad); }, {"backoff_factor", "2"});
}

// Rank 1 alone overflows (its loss is multiplied by inf); after DDP's all-reduce both ranks see
// the inf, both skip, both back off, and the parameters stay identical.
TEST(GradScaler, DdpOverflowOnOneRankSkipsOnEveryRank) {
  const Data data = make_data(16, 31);
  std::vector<std::vector<std::vector<double>>> before(2), after(2);
  std::vector<std::vector<bool>> stepped(2);
  std::vector<double> scales(2);
  const auto errors = lockstep::testing::run_ranks(2, [&](int r, dist::ProcessGroupPtr pg) {
    auto ddp = std::make_shared<dist::DistributedDataParallel>(mlp(40 + r), pg);
    optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    amp::GradScaler scaler({.init_scale = 256.0});
    const Data mine = shard(data, r, 2);
    for (int step = 0; step < 3; ++step) {
      if (step == 1) before[r] = param_values(*ddp->module());
      opt.zero_grad();
      Tensor loss = cross_entropy(ddp->forward(mine.x), mine.y);
      if (step == 1 && r == 1) loss = mul(loss, std::numeric_limits<double>::infinity());
      scaler.scale(loss).backward();
      stepped[r].push_back(scaler.step(opt));
      scaler.update();
      if (step == 1) after[r] = param_values(*ddp->module());
    }
    scales[r] = scaler.get_scale();
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(stepped[r], (std::vector<bool>{true, false, true})) << "rank " << r;
    EXPECT_EQ(after[r], before[r]) << "rank " << r << " changed its parameters on a skipped step";
    EXPECT_DOUBLE_EQ(scales[r], 128.0) << "rank " << r;
  }
  EXPECT_EQ(after[0], after[1]);
}

}  // namespace
