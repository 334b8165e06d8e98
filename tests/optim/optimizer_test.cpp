// Optimizers against updates computed by hand, state round trips, schedules, clipping.
#include <cmath>

#include "lockstep/optim/optimizer.h"
#include "lockstep/optim/schedule.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::optim;
using lockstep::testing::expect_error;
using lockstep::testing::values;

namespace {
// A parameter with a fixed gradient pattern for each step.
Tensor param(std::vector<double> v) {
  return from_vector<double>(v, {static_cast<int64_t>(v.size())}).requires_grad_();
}
void set_grad(Tensor& p, std::vector<double> g) {
  p.set_grad(from_vector<double>(g, {static_cast<int64_t>(g.size())}));
}
}  // namespace

TEST(SGD, PlainMomentumNesterovWeightDecayByHand) {
  // p = 1, grads 0.5, -1, 2; lr 0.1, momentum 0.9, weight decay 0.01, dampening 0.
  {
    Tensor p = param({1.0});
    SGD opt({p}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
    double pv = 1.0, buf = 0;
    const double grads[] = {0.5, -1.0, 2.0};
    for (int s = 0; s < 3; ++s) {
      set_grad(p, {grads[s]});
      opt.step();
      const double d = grads[s] + 0.01 * pv;
      buf = s == 0 ? d : 0.9 * buf + d;
      pv -= 0.1 * buf;
      EXPECT_NEAR(p.at({0}), pv, 1e-12) << "step " << s;
    }
  }
  {
    Tensor p = param({1.0, -2.0});
    SGD opt({p}, {.lr = 0.05, .momentum = 0.5, .nesterov = true});
    set_grad(p, {1.0, 1.0});
    opt.step();  // buf = 1, d = 1 + 0.5 = 1.5
    EXPECT_NEAR(p.at({0}), 1.0 - 0.075, 1e-12);
    set_grad(p, {2.0, 0.0});
    opt.step();  // buf = 0.5 + 2 = 2.5, d = 2 + 1.25 = 3.25
    EXPECT_NEAR(p.at({0}), 0.925 - 0.1625, 1e-12);
    EXPECT_NEAR(p.at({1}), -2.0 - 0.075 - 0.05 * 0.25, 1e-12);  // buf 0.5, d = 0 + 0.25
  }
  {
    Tensor p = param({0.0});
    SGD opt({p}, {.lr = 1.0, .momentum = 0.9, .dampening = 0.5});
    set_grad(p, {1.0});
    opt.step();  // buf = 1
    set_grad(p, {1.0});
    opt.step();  // buf = 0.9 + 0.5 = 1.4
    EXPECT_NEAR(p.at({0}), -2.4, 1e-12);
  }
}

TEST(SGD, SkipsParametersWithoutGradientAndGroupsHaveOwnLr) {
  Tensor a = param({1.0}), b = param({1.0});
  SGD opt({ParamGroup{{a}, 0.5}, ParamGroup{{b}}}, {.lr = 0.1});
  set_grad(a, {1.0});
  opt.step();
  EXPECT_NEAR(a.at({0}), 0.5, 1e-12);
  EXPECT_EQ(b.at({0}), 1.0);
  set_grad(b, {1.0});
  opt.step();
  EXPECT_NEAR(b.at({0}), 0.9, 1e-12);
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  expect_error([] { SGD bad({param({1.0})}, {.lr = -1}); }, {"lr must be >= 0"});
  expect_error([] { SGD bad({param({1.0})}, {.lr = 0.1, .nesterov = true}); }, {"nesterov"});
}

TEST(AdamW, MatchesHandComputedSteps) {
  Tensor p = param({0.5, -1.0});
  AdamWOptions o{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
  AdamW opt({p}, o);
  double pv[2] = {0.5, -1.0}, m[2] = {0, 0}, v[2] = {0, 0};
  const double grads[3][2] = {{0.2, -0.3}, {0.1, 0.4}, {-0.5, 0.0}};
  for (int s = 0; s < 3; ++s) {
    set_grad(p, {grads[s][0], grads[s][1]});
    opt.step();
    const int t = s + 1;
    for (int k = 0; k < 2; ++k) {
      const double g = grads[s][k];
      pv[k] *= 1 - 0.01 * 0.1;
      m[k] = 0.9 * m[k] + 0.1 * g;
      v[k] = 0.99 * v[k] + 0.01 * g * g;
      const double mh = m[k] / (1 - std::pow(0.9, t)), vh = v[k] / (1 - std::pow(0.99, t));
      pv[k] -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
      EXPECT_NEAR(p.at({k}), pv[k], 1e-12) << "step " << s << " elem " << k;
    }
  }
}

// Note [AdamW on AVX2]: f32 parameters update 8 lanes at a time where the CPU has AVX2, with
// the bits of the scalar f32 loop written out here (same operations, same order, no fused
// multiply-adds): sizes below, at and past 8, a tail of 7, and a NaN gradient that must make
// its own element NaN and no other.
TEST(AdamW, Float32UpdateHasTheBitsOfTheScalarLoop) {
  const double lr = 0.003, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  for (int64_t n : {1, 7, 8, 9, 16, 1031}) {
    Generator gen(static_cast<uint64_t>(n));
    const Tensor p0 = randn({n}, gen);
    Tensor p = p0.clone().requires_grad_();
    AdamW opt({p}, {.lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd});
    std::vector<float> pv = p0.to_vector<float>(), m(n, 0.0f), v(n, 0.0f);
    for (int t = 1; t <= 3; ++t) {
      std::vector<float> g = randn({n}, gen).to_vector<float>();
      if (t == 2 && n > 3) g[3] = std::nanf("");
      p.set_grad(from_vector<float>(g, {n}));
      opt.step();
      const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
      const float step_size = static_cast<float>(lr / bc1);
      const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
      const std::vector<float> got = p.to_vector<float>();
      for (int64_t k = 0; k < n; ++k) {
        pv[k] *= static_cast<float>(1 - lr * wd);
        m[k] = static_cast<float>(b1) * m[k] + static_cast<float>(1 - b1) * g[k];
        v[k] = static_cast<float>(b2) * v[k] + static_cast<float>(1 - b2) * g[k] * g[k];
        const float denom = std::sqrt(v[k]) / bc2_sqrt + static_cast<float>(eps);
        pv[k] -= step_size * m[k] / denom;
        if (std::isnan(pv[k])) {
          ASSERT_TRUE(std::isnan(got[k])) << "n " << n << " step " << t << " elem " << k;
          ASSERT_TRUE(k == 3) << "a NaN only where the gradient had one, elem " << k;
        } else {
          ASSERT_EQ(got[k], pv[k]) << "n " << n << " step " << t << " elem " << k;
        }
      }
    }
  }
}

TEST(Optimizer, StateRoundTripContinuesIdentically) {
  auto run = [](bool reload) {
    Tensor p = param({1.0, 2.0, 3.0});
    AdamW opt({p}, {.lr = 0.1});
    for (int s = 0; s < 5; ++s) {
      set_grad(p, {0.1 * s, -0.2, 0.3});
      opt.step();
      if (reload && s == 2) {
        auto st = opt.state_dict();
        Tensor q = p.detach().clone().requires_grad_();
        AdamW fresh({q}, {.lr = 0.1});
        fresh.load_state_dict(st);
        EXPECT_EQ(fresh.steps(), 3);
        opt.load_state_dict(fresh.state_dict());
      }
    }
    return values(p);
  };
  EXPECT_EQ(run(false), run(true));
  Tensor p = param({1.0});
  SGD opt({p}, {.lr = 0.1, .momentum = 0.9});
  set_grad(p, {1.0});
  opt.step();
  auto st = opt.state_dict();
  st.back().second = zeros({2}, kFloat64);
  expect_error([&] { opt.load_state_dict(st); }, {"0.momentum_buffer", "[2]", "[1]"});
  auto bad_group = opt.state_dict();
  bad_group.emplace_back("group.x.lr", full({}, 0.1, kFloat64));
  expect_error([&] { opt.load_state_dict(bad_group); }, {"malformed state key 'group.x.lr'"});
  Tensor q = param({1.0});
  AdamW adam({q}, {.lr = 0.1});
  set_grad(q, {1.0});
  adam.step();
  expect_error([&] { opt.load_state_dict(adam.state_dict()); }, {"unknown state field", "exp_avg"});
}

TEST(Schedule, ShapesOfSchedules) {
  auto w = linear_warmup(4);
  EXPECT_DOUBLE_EQ(w(0), 0.25);
  EXPECT_DOUBLE_EQ(w(3), 1.0);
  EXPECT_DOUBLE_EQ(w(10), 1.0);
  auto c = cosine_decay(10, 0.1);
  EXPECT_DOUBLE_EQ(c(0), 1.0);
  EXPECT_NEAR(c(5), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(c(10), 0.1);
  auto s = step_decay(3, 0.5);
  EXPECT_DOUBLE_EQ(s(2), 1.0);
  EXPECT_DOUBLE_EQ(s(3), 0.5);
  EXPECT_DOUBLE_EQ(s(7), 0.25);
  auto wc = warmup_cosine(2, 12);
  EXPECT_DOUBLE_EQ(wc(0), 0.5);
  EXPECT_DOUBLE_EQ(wc(2), 1.0);
  EXPECT_NEAR(wc(7), 0.5, 1e-12);
  Tensor p = param({1.0});
  SGD opt({p}, {.lr = 0.2});
  LRScheduler sched(opt, linear_warmup(2));
  EXPECT_DOUBLE_EQ(sched.last_lr(), 0.1);
  sched.step();
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].lr, 0.2);
}

TEST(ClipGradNorm, ScalesToMaxNormAndReturnsTotal) {
  Tensor a = param({0, 0}), b = param({0});
  set_grad(a, {3.0, 0.0});
  set_grad(b, {4.0});
  EXPECT_NEAR(clip_grad_norm({a, b}, 1.0), 5.0, 1e-12);
  EXPECT_NEAR(a.grad().at({0}), 0.6, 1e-6);
  EXPECT_NEAR(b.grad().at({0}), 0.8, 1e-6);
  EXPECT_NEAR(clip_grad_norm({a, b}, 10.0), 1.0, 1e-5);  // under the limit: unchanged
  EXPECT_NEAR(b.grad().at({0}), 0.8, 1e-6);
  set_grad(b, {NAN});
  EXPECT_TRUE(std::isnan(clip_grad_norm({a, b}, 1.0)));
  EXPECT_NEAR(a.grad().at({0}), 0.6, 1e-6);
  set_grad(b, {-7.0});
  EXPECT_NEAR(clip_grad_norm({a, b}, 100.0, INFINITY), 7.0, 1e-12);
}
