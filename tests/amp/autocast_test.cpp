// Autocast: the policy table op by op, f32 gradients for f32 parameters, the per-scope cast
// cache, and bf16/f16 results within their precision of the f32 run.
#include <cmath>
#include <thread>

#include "lockstep/ops/autocast.h"
#include "testing.h"

using namespace lockstep;

namespace {

Tensor rand_f32(const Dims& shape, uint64_t seed) {
  Generator gen(seed);
  return randn(shape, gen);
}

class AutocastDtypes : public ::testing::TestWithParam<DType> {};

TEST_P(AutocastDtypes, MatrixProductsRunInLowPrecision) {
  const DType low = GetParam();
  const Tensor a = rand_f32({4, 8}, 1), b = rand_f32({8, 3}, 2), w = rand_f32({5, 8}, 3),
               bias = rand_f32({5}, 4), img = rand_f32({2, 3, 6, 6}, 5),
               filt = rand_f32({4, 3, 3, 3}, 6), batched = rand_f32({2, 4, 8}, 7);
  amp::autocast ac(low);
  EXPECT_EQ(matmul(a, b).dtype(), low);
  EXPECT_EQ(matmul(batched, b).dtype(), low);  // batched matmul
  EXPECT_EQ(linear(a, w, bias).dtype(), low);
  EXPECT_EQ(conv2d(img, filt).dtype(), low);
}

TEST_P(AutocastDtypes, PrecisionSensitiveOpsRunInFloat32) {
  const DType low = GetParam();
  const Tensor x = rand_f32({4, 6}, 8).to(low);
  const Tensor targets = full({4}, 2.0, kInt64);
  amp::autocast ac(low);
  EXPECT_EQ(softmax(x, 1).dtype(), kFloat32);
  EXPECT_EQ(log_softmax(x, 1).dtype(), kFloat32);
  EXPECT_EQ(cross_entropy(x, targets).dtype(), kFloat32);
  EXPECT_EQ(mse_loss(x, x).dtype(), kFloat32);
  EXPECT_EQ(layer_norm(x, {6}).dtype(), kFloat32);
  EXPECT_EQ(sum(x).dtype(), kFloat32);
  EXPECT_EQ(mean(x, {1}).dtype(), kFloat32);
  EXPECT_EQ(var(x, {1}).dtype(), kFloat32);
  nn::BatchNorm1d bn(6);
  EXPECT_EQ(bn.forward(x).dtype(), kFloat32);
}

TEST_P(AutocastDtypes, ElementwiseOpsFollowTheWidestInput) {
  const DType low = GetParam();
  const Tensor lo = rand_f32({3, 4}, 9).to(low), hi = rand_f32({3, 4}, 10);
  amp::autocast ac(low);
  EXPECT_EQ(add(lo, hi).dtype(), kFloat32);
  EXPECT_EQ(mul(lo, lo).dtype(), low);
  EXPECT_EQ(relu(lo).dtype(), low);
  EXPECT_EQ(max_pool2d(rand_f32({1, 1, 4, 4}, 11).to(low)).dtype(), low);
}

INSTANTIATE_TEST_SUITE_P(LowDtypes, AutocastDtypes, ::testing::Values(kBFloat16, kFloat16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(Autocast, PolicyTableNamesEachOp) {
  for (const char* op : {"matmul", "linear", "conv2d"}) {
    EXPECT_EQ(amp::cast_policy(op), amp::CastPolicy::kLowPrecision) << op;
  }
  for (const char* op : {"softmax", "log_softmax", "cross_entropy", "mse_loss", "layer_norm",
                         "batch_norm", "sum", "mean", "var"}) {
    EXPECT_EQ(amp::cast_policy(op), amp::CastPolicy::kFloat32) << op;
  }
  for (const char* op : {"add", "mul", "relu", "max_pool2d"}) {
    EXPECT_EQ(amp::cast_policy(op), amp::CastPolicy::kPromote) << op;
  }
}

TEST(Autocast, OffOutsideTheScopeAndInADisabledInnerScope) {
  const Tensor a = rand_f32({4, 8}, 1), b = rand_f32({8, 3}, 2);
  EXPECT_FALSE(amp::is_autocast_enabled());
  EXPECT_EQ(matmul(a, b).dtype(), kFloat32);
  {
    amp::autocast ac;  // bf16 by default
    EXPECT_TRUE(amp::is_autocast_enabled());
    EXPECT_EQ(amp::autocast_dtype(), kBFloat16);
    {
      amp::autocast off(kBFloat16, false);
      EXPECT_EQ(matmul(a, b).dtype(), kFloat32);
    }
    EXPECT_EQ(matmul(a, b).dtype(), kBFloat16);
  }
  EXPECT_FALSE(amp::is_autocast_enabled());
  EXPECT_EQ(matmul(a, b).dtype(), kFloat32);
  // f64 is left alone (only f32 is lowered).
  amp::autocast ac;
  EXPECT_EQ(matmul(a.to(kFloat64), b.to(kFloat64)).dtype(), kFloat64);
}

TEST(Autocast, RejectsADtypeThatIsNotLowPrecision) {
  lockstep::testing::expect_error([] { amp::autocast ac(kFloat32); }, {"bf16 or f16", "f32"});
}

TEST(Autocast, ScopeIsPerThread) {
  amp::autocast ac;
  bool other_thread_enabled = true;
  std::thread t([&] { other_thread_enabled = amp::is_autocast_enabled(); });
  t.join();
  EXPECT_FALSE(other_thread_enabled);
}

std::shared_ptr<nn::Module> small_mlp(uint64_t seed) {
  Generator gen(seed);
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(16, 32, gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(32, 32, gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(32, 4, gen)});
}

TEST(Autocast, WeightsAreCastOncePerScopeAndTheCacheEndsWithIt) {
  auto m = small_mlp(1);
  const Tensor x = rand_f32({8, 16}, 2);
  {
    amp::autocast ac;
    m->forward(x);
    EXPECT_EQ(amp::autocast_cache_size(), 6);  // 3 weights + 3 biases
    m->forward(x);
    EXPECT_EQ(amp::autocast_cache_size(), 6);  // reused, not cast again
  }
  EXPECT_EQ(amp::autocast_cache_size(), 0);
  {
    autograd::NoGradGuard no_grad;  // copies made without a graph are not cached
    amp::autocast ac;
    m->forward(x);
    EXPECT_EQ(amp::autocast_cache_size(), 0);
  }
}

class AutocastAccuracy : public ::testing::TestWithParam<DType> {};

TEST_P(AutocastAccuracy, MlpLossAndGradientsWithinLowPrecisionOfFloat32) {
  const DType low = GetParam();
  auto ref = small_mlp(3), amp_model = small_mlp(3);
  Generator gen(4);
  const Tensor x = randn({64, 16}, gen), y = randint(0, 4, {64}, gen);
  Tensor ref_loss = cross_entropy(ref->forward(x), y);
  ref_loss.backward();
  Tensor amp_loss;
  {
    amp::autocast ac(low);
    amp_loss = cross_entropy(amp_model->forward(x), y);
  }
  EXPECT_EQ(amp_loss.dtype(), kFloat32);
  amp_loss.backward();
  const double rl = ref_loss.item(), al = amp_loss.item();
  EXPECT_LT(std::abs(al - rl) / std::abs(rl), 1e-2) << al << " vs " << rl;
  const auto rp = ref->parameters(), ap = amp_model->parameters();
  for (size_t i = 0; i < rp.size(); ++i) {
    ASSERT_EQ(ap[i].grad().dtype(), kFloat32) << "parameter " << i;
    const Tensor diff = sub(ap[i].grad(), rp[i].grad());
    const double rel = std::sqrt(sum(mul(diff, diff)).item()) /
                       std::sqrt(sum(mul(rp[i].grad(), rp[i].grad())).item());
    EXPECT_LT(rel, 1e-2) << "parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(LowDtypes, AutocastAccuracy, ::testing::Values(kBFloat16, kFloat16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(Autocast, BackwardInsideTheScopeKeepsGradientDtypes) {
  auto m = small_mlp(5);
  const Tensor x = rand_f32({8, 16}, 6);
  amp::autocast ac;
  Tensor loss = sum(m->forward(x));
  loss.backward();
  for (const auto& p : m->parameters()) EXPECT_EQ(p.grad().dtype(), kFloat32);
}

}  // namespace

namespace {

// Several forwards and backwards in one scope (gradient accumulation written naturally): the
// copies cached before a backward are not reused after it, whose cast nodes it released. Three
// identical micro-batches accumulate three times the gradient of one.
TEST(Autocast, BackwardPerMicroBatchInsideOneScope) {
  auto once = small_mlp(7), thrice = small_mlp(7);
  Generator gen(8);
  const Tensor x = randn({16, 16}, gen), y = randint(0, 4, {16}, gen);
  {
    amp::autocast ac;
    cross_entropy(once->forward(x), y).backward();
  }
  {
    amp::autocast ac;
    for (int k = 0; k < 3; ++k) cross_entropy(thrice->forward(x), y).backward();
  }
  const auto p1 = once->parameters(), p3 = thrice->parameters();
  for (size_t i = 0; i < p1.size(); ++i) {
    const auto g1 = p1[i].grad().to_vector<double>(), g3 = p3[i].grad().to_vector<double>();
    for (size_t j = 0; j < g1.size(); ++j) {
      ASSERT_NEAR(g3[j], 3 * g1[j], 1e-6 * (1 + std::abs(g1[j]))) << "parameter " << i;
    }
  }
}

// An f32 output gradient for a bf16 output is converted to bf16 before the backward kernels.
TEST(Autocast, RootGradientOfAnotherDtypeIsConverted) {
  Generator gen(9);
  Tensor w = randn({8, 5}, gen).requires_grad_();
  const Tensor x = randn({3, 5}, gen);
  Tensor out;
  {
    amp::autocast ac;
    out = linear(x, w);
  }
  ASSERT_EQ(out.dtype(), kBFloat16);
  out.backward(full({3, 8}, 1.0, kFloat32));
  ASSERT_EQ(w.grad().dtype(), kFloat32);
  Tensor w32 = w.detach().requires_grad_();
  linear(x, w32).backward(full({3, 8}, 1.0, kFloat32));
  const auto g = w.grad().to_vector<double>(), want = w32.grad().to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], want[i], 0.02 + 0.01 * std::abs(want[i]));
}

}  // namespace
