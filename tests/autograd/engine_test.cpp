// The backward engine: accumulation, ordering, hooks DDP relies on, final callbacks, errors.
#include <string>
#include <vector>

#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::values;

TEST(Autograd, LeafUsedSeveralTimesAccumulatesOnce) {
  Tensor x = full({3}, 2.0).requires_grad_();
  // y = x*x + 3x + x  ->  dy/dx = 2x + 4 = 8
  Tensor y = sum(add(add(mul(x, x), mul(x, 3.0)), x));
  y.backward();
  EXPECT_EQ(values(x.grad()), (std::vector<double>{8, 8, 8}));
  EXPECT_TRUE(x.grad().is_leaf());
  EXPECT_FALSE(x.grad().requires_grad());
}

TEST(Autograd, GradientsAccumulateAcrossBackwards) {
  Tensor x = full({2}, 1.0).requires_grad_();
  sum(mul(x, 3.0)).backward();
  sum(mul(x, 4.0)).backward();
  EXPECT_EQ(values(x.grad()), (std::vector<double>{7, 7}));
}

TEST(Autograd, PostAccumulateHookFiresOncePerBackwardWithCompleteGradient) {
  Tensor x = full({2}, 1.0).requires_grad_();
  int calls = 0;
  std::vector<double> seen;
  int id = x.register_post_accumulate_grad_hook([&](Tensor& leaf) {
    ++calls;
    seen = values(leaf.grad());
  });
  // x is used in three places; the hook must see the sum of all three contributions.
  Tensor y = sum(add(add(mul(x, 2.0), mul(x, 5.0)), exp(mul(x, 0.0))));
  y.backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, (std::vector<double>{7, 7}));
  sum(mul(x, 1.0)).backward();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(seen, (std::vector<double>{8, 8}));
  x.remove_post_accumulate_grad_hook(id);
  sum(x).backward();
  EXPECT_EQ(calls, 2);
}

TEST(Autograd, HooksFireInReverseOrderOfUse) {
  // A chain w1 -> w2 -> w3: gradients complete for w3 first, w1 last (what DDP buckets expect).
  Tensor x = full({4}, 1.0);
  std::vector<Tensor> w;
  std::vector<int> order;
  for (int i = 0; i < 3; ++i) {
    w.push_back(full({4}, 1.0 + i).requires_grad_());
    w.back().register_post_accumulate_grad_hook([&order, i](Tensor&) { order.push_back(i); });
  }
  Tensor h = x;
  for (int i = 0; i < 3; ++i) h = tanh(mul(h, w[i]));
  sum(h).backward();
  EXPECT_EQ(order, (std::vector<int>{2, 1, 0}));
}

TEST(Autograd, HookOnLeafNotReachedDoesNotFire) {
  Tensor a = full({1}, 1.0).requires_grad_();
  Tensor b = full({1}, 1.0).requires_grad_();
  int calls = 0;
  b.register_post_accumulate_grad_hook([&](Tensor&) { ++calls; });
  sum(mul(a, 2.0)).backward();
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(b.grad().defined());
}

TEST(Autograd, FinalCallbackRunsOnceAfterEverything) {
  Tensor a = full({2}, 1.0).requires_grad_();
  Tensor b = full({2}, 2.0).requires_grad_();
  std::vector<std::string> events;
  bool queued = false;
  auto hook = [&](const char* name) {
    return [&, name](Tensor&) {
      events.push_back(name);
      if (!queued) {
        queued = true;
        autograd::queue_callback([&] {
          events.push_back("final");
          // A callback can see every gradient already in place.
          EXPECT_TRUE(a.grad().defined());
          EXPECT_TRUE(b.grad().defined());
        });
      }
    };
  };
  a.register_post_accumulate_grad_hook(hook("a"));
  b.register_post_accumulate_grad_hook(hook("b"));
  sum(mul(a, b)).backward();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events.back(), "final");
  EXPECT_FALSE(autograd::in_backward());
  expect_error([] { autograd::queue_callback([] {}); }, {"only callable during a backward"});
}

TEST(Autograd, AccumulatesInPlaceIntoAGradThatIsAView) {
  // DDP makes each .grad a view into one flat bucket; accumulation must write through it.
  Tensor flat = zeros({5});
  Tensor w = full({2, 2}, 1.0).requires_grad_();
  w.set_grad(flat.narrow(0, 1, 4).view({2, 2}));
  sum(mul(w, 3.0)).backward();
  EXPECT_EQ(values(flat), (std::vector<double>{0, 3, 3, 3, 3}));
  EXPECT_EQ(w.grad().storage(), flat.storage());
}

TEST(Autograd, SecondBackwardNeedsRetainGraph) {
  Tensor x = full({2}, 3.0).requires_grad_();
  Tensor y = sum(exp(x));
  y.backward();
  expect_error([&] { y.backward(); }, {"a second time", "retain_graph"});
  Tensor x2 = full({2}, 1.0).requires_grad_();
  Tensor y2 = sum(mul(x2, x2));
  y2.backward(Tensor(), /*retain_graph=*/true);
  y2.backward();
  EXPECT_EQ(values(x2.grad()), (std::vector<double>{4, 4}));
}

TEST(Autograd, NoGradGuardAndDetach) {
  Tensor x = full({2}, 1.0).requires_grad_();
  {
    NoGradGuard g;
    Tensor y = mul(x, 2.0);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(y.is_leaf());
  }
  Tensor y = mul(x, 2.0);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(y.is_leaf());
  EXPECT_EQ(y.grad_fn()->name(), "MulScalarBackward");
  Tensor d = y.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.storage(), y.storage());
  expect_error([&] { sum(d).backward(); }, {"does not require grad"});
}

TEST(Autograd, BackwardOfNonScalarNeedsGradient) {
  Tensor x = full({3}, 1.0).requires_grad_();
  Tensor y = mul(x, 2.0);
  expect_error([&] { y.backward(); }, {"one-element output", "[3]"});
  y.backward(full({3}, 0.5));
  EXPECT_EQ(values(x.grad()), (std::vector<double>{1, 1, 1}));
  expect_error([&] { mul(x, 2.0).backward(ones({2})); }, {"gradient of shape [2]", "[3]"});
}

TEST(Autograd, InPlaceOnTrackedTensorIsAnError) {
  Tensor w = full({2}, 1.0).requires_grad_();
  expect_error([&] { w.add_(ones({2})); }, {"add_", "requires grad", "NoGradGuard"});
  {
    NoGradGuard g;
    w.add_(ones({2}), -0.5);  // an optimizer step
  }
  EXPECT_EQ(values(w), (std::vector<double>{0.5, 0.5}));
  expect_error([] { (void)zeros({2}, kInt64).requires_grad_(); }, {"floating-point"});
}

TEST(Autograd, GradFunctionDoesNotTouchDotGrad) {
  Tensor x = full({2}, 2.0).requires_grad_();
  Tensor h = mul(x, x);
  Tensor y = sum(mul(h, 3.0));
  auto g = autograd::grad({y}, {x, h});
  EXPECT_EQ(values(g[0]), (std::vector<double>{12, 12}));
  EXPECT_EQ(values(g[1]), (std::vector<double>{3, 3}));
  EXPECT_FALSE(x.grad().defined());
}

TEST(Autograd, ViewsPropagateGradients) {
  Tensor x = arange(0.0, 6.0, 1.0, kFloat64).requires_grad_();
  Tensor v = x.view({2, 3}).t().narrow(0, 1, 2).unsqueeze(0).expand({4, 2, 2});
  sum(v).backward();
  // Columns 1 and 2 of the 2x3 view, each counted 4 times by the expand.
  EXPECT_EQ(values(x.grad()), (std::vector<double>{0, 4, 4, 0, 4, 4}));
}

TEST(Autograd, GradcheckCatchesAWrongGradient) {
  // A deliberately wrong backward must be reported, or gradcheck proves nothing.
  Generator gen(0);
  Tensor x = randn({3}, gen, kFloat64).requires_grad_();
  auto wrong = [](const std::vector<Tensor>& in) {
    Tensor out = in[0].detach().clone();
    Tensor xin = in[0];
    autograd::record("WrongBackward", {xin}, out, [](const autograd::TensorList& g) {
      return autograd::TensorList{mul(g[0], 2.0)};
    });
    return out;
  };
  auto r = autograd::gradcheck(wrong, {x});
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.message, ::testing::HasSubstr("analytic"));
}

TEST(Autograd, ViewOpsGradcheck) {
  Generator gen(9);
  Tensor x = randn({3, 4, 5}, gen, kFloat64).requires_grad_();
  Tensor nc = randn({5, 4}, gen, kFloat64).t().detach().requires_grad_();
  using V = const std::vector<Tensor>&;
  using lockstep::testing::expect_gradcheck;
  expect_gradcheck([](V v) { return v[0].view({12, 5}); }, {x});
  expect_gradcheck([](V v) { return v[0].reshape({-1}); }, {nc});  // a copy: not viewable
  expect_gradcheck([](V v) { return v[0].flatten(1); }, {x});
  expect_gradcheck([](V v) { return v[0].transpose(0, 2); }, {x});
  expect_gradcheck([](V v) { return v[0].permute({2, 0, 1}); }, {x});
  expect_gradcheck([](V v) { return v[0].narrow(1, 1, 2); }, {x});
  expect_gradcheck([](V v) { return v[0].slice(2, 0, 5, 2); }, {x});
  expect_gradcheck([](V v) { return v[0].select(1, -1); }, {x});
  expect_gradcheck([](V v) { return v[0].unsqueeze(1).expand({4, 3, 5}); }, {nc});
  expect_gradcheck([](V v) { return v[0].narrow(0, 0, 1).squeeze(); }, {x});
  expect_gradcheck([](V v) { return v[0].unsqueeze(-1).squeeze(-1); }, {nc});
  expect_gradcheck([](V v) { return v[0].contiguous(); }, {nc});
  expect_gradcheck([](V v) { return v[0].clone(); }, {x});
  expect_gradcheck([](V v) { return v[0].t(); }, {nc});
}

TEST(Autograd, GraphHoldsOnlyWhatBackwardNeedsAndFreesIt) {
  const int64_t n = 1 << 20;  // 4 MiB of f32
  Tensor x = ones({n}).requires_grad_();
  auto held = [] { return cpu_allocator_stats().allocated_bytes; };
  const int64_t base = held();
  // Neither scalar op reads a value in backward: no intermediate may stay alive.
  Tensor y = sum(add(mul(x, 2.0), 1.0));
  EXPECT_LT(held() - base, n);  // well under one 4 MiB intermediate
  // exp saves its output for backward; backward without retain_graph frees it.
  Tensor z = sum(exp(x));
  EXPECT_GE(held() - base, n * 4);
  z.backward();
  const int64_t after = held() - base;
  EXPECT_LT(after, n * 4 + n);  // only x.grad (4 MiB) remains
  EXPECT_GE(after, n * 4);
}
