// Modules: parameter order and names, state_dict round trips and errors, modes, layers.
#include <cmath>

#include "lockstep/nn/layers.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::nn;
using lockstep::testing::expect_error;
using lockstep::testing::values;

namespace {
std::shared_ptr<Sequential> mlp(uint64_t seed) {
  Generator gen(seed);
  return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Linear>(4, 8, gen), std::make_shared<ReLU>(),
      std::make_shared<Linear>(8, 3, gen)});
}

class Block : public Module {
 public:
  explicit Block(Generator& gen) : Module("Block") {
    scale = register_parameter("scale", ones({2}));
    inner = register_module("inner", std::make_shared<Linear>(2, 2, gen));
    norm = register_module("norm", std::make_shared<BatchNorm1d>(2));
  }
  Tensor forward(const Tensor& x) override { return norm->forward(inner->forward(mul(x, scale))); }
  Tensor scale;
  std::shared_ptr<Linear> inner;
  std::shared_ptr<BatchNorm1d> norm;
};
}  // namespace

TEST(Module, ParameterOrderAndNames) {
  auto m = mlp(0);
  std::vector<std::string> names;
  for (auto& [n, t] : m->named_parameters()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_EQ(m->num_parameters(), 4 * 8 + 8 + 8 * 3 + 3);
  Generator gen(1);
  Sequential outer;
  outer.push_back(std::make_shared<Block>(gen));
  outer.push_back(std::make_shared<Linear>(2, 1, gen, false));
  names.clear();
  for (auto& [n, t] : outer.state_dict()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "0.scale", "0.inner.weight", "0.inner.bias", "0.norm.weight", "0.norm.bias",
                       "1.weight", "0.norm.running_mean", "0.norm.running_var",
                       "0.norm.num_batches_tracked"}));
  EXPECT_EQ(outer.buffers().size(), 3u);
  for (const Tensor& p : outer.parameters()) EXPECT_TRUE(p.requires_grad());
}

TEST(Module, SameSeedSameModelAndPyTorchInitBounds) {
  auto a = mlp(5), b = mlp(5), c = mlp(6);
  auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(equal(pa[i], pb[i]));
  EXPECT_FALSE(equal(pa[0], pc[0]));
  Generator gen(0);
  Linear big(400, 300, gen);
  const double bound = 1.0 / std::sqrt(400.0);
  EXPECT_LE(max(abs(big.weight())).item(), bound);
  EXPECT_GT(max(abs(big.weight())).item(), 0.95 * bound);  // uniform fills the range
  EXPECT_LE(max(abs(big.bias())).item(), bound);
  Conv2d conv(Conv2dConfig{4, 8, 3, 1, 1, 1, 2}, gen);
  EXPECT_EQ(conv.weight().shape(), (Dims{8, 2, 3, 3}));
  EXPECT_LE(max(abs(conv.weight())).item(), 1.0 / std::sqrt(2 * 9.0));
}

TEST(Module, StateDictRoundTripAndErrors) {
  auto a = mlp(1), b = mlp(2);
  Tensor held = b->parameters()[0];  // a handle taken before loading stays valid
  b->load_state_dict(a->state_dict());
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(equal(a->parameters()[i], b->parameters()[i]));
  EXPECT_TRUE(equal(held, a->parameters()[0]));
  auto sd = a->state_dict();
  sd.pop_back();
  expect_error([&] { b->load_state_dict(sd); }, {"missing key '2.bias'", "[3]"});
  b->load_state_dict(sd, /*strict=*/false);
  auto extra = a->state_dict();
  extra.emplace_back("3.weight", zeros({1}));
  expect_error([&] { b->load_state_dict(extra); }, {"unexpected key '3.weight'"});
  auto wrong = a->state_dict();
  wrong[0].second = zeros({8, 5});
  expect_error([&] { b->load_state_dict(wrong); }, {"'0.weight'", "expected [8, 4]", "got [8, 5]"});
}

TEST(Module, TrainEvalZeroGradAndTo) {
  auto m = mlp(3);
  EXPECT_TRUE((*m)[0]->is_training());
  m->eval();
  EXPECT_FALSE((*m)[2]->is_training());
  m->train();
  EXPECT_TRUE((*m)[2]->is_training());
  Tensor x = ones({2, 4});
  sum(m->forward(x)).backward();
  for (const Tensor& p : m->parameters()) EXPECT_TRUE(p.grad().defined());
  m->zero_grad(false);
  for (const Tensor& p : m->parameters()) EXPECT_EQ(sum(abs(p.grad())).item(), 0.0);
  m->zero_grad();
  for (const Tensor& p : m->parameters()) EXPECT_FALSE(p.grad().defined());
  auto lin = std::static_pointer_cast<Linear>((*m)[0]);
  m->to(kFloat64);
  EXPECT_EQ(lin->weight().dtype(), kFloat64);  // the layer's own handle sees the change
  EXPECT_EQ(m->forward(ones({1, 4}, kFloat64)).dtype(), kFloat64);
  EXPECT_THAT(m->to_string(), ::testing::HasSubstr("(0): Linear(in_features=4, out_features=8"));
}

TEST(Module, BatchNormMatchesReferenceAndTracksStatistics) {
  BatchNorm2d bn(3);
  Generator gen(4);
  Tensor x = randn({4, 3, 5, 5}, gen);
  Tensor y = bn.forward(x);
  // Per channel: zero mean, unit (biased) variance.
  Tensor m = mean(y, {0, 2, 3}), v = var(y, {0, 2, 3}, 0);
  for (double mv : values(m)) EXPECT_NEAR(mv, 0.0, 1e-5);
  for (double vv : values(v)) EXPECT_NEAR(vv, 1.0, 1e-3);
  Tensor bm = mean(x, {0, 2, 3}), bv = var(x, {0, 2, 3}, 1);
  auto sd = bn.state_dict();
  auto find = [&](const std::string& n) {
    for (auto& [k, t] : sd)
      if (k == n) return t;
    return Tensor();
  };
  for (int c = 0; c < 3; ++c) {
    EXPECT_NEAR(find("running_mean").at({c}), 0.1 * bm.at({c}), 1e-6);
    EXPECT_NEAR(find("running_var").at({c}), 0.9 + 0.1 * bv.at({c}), 1e-5);
  }
  EXPECT_EQ(find("num_batches_tracked").item(), 1);
  bn.eval();
  Tensor ye = bn.forward(x);
  const double want = (x.at({0, 1, 2, 3}) - find("running_mean").at({1})) /
                      std::sqrt(find("running_var").at({1}) + 1e-5);
  EXPECT_NEAR(ye.at({0, 1, 2, 3}), want, 1e-5);
  expect_error([&] { (void)bn.forward(zeros({2, 4, 3, 3})); }, {"C=3", "[2, 4, 3, 3]"});
}

namespace {
// BatchNorm as the module composed it before the batch_norm op: mean/var ops and elementwise
// arithmetic, the running statistics updated with in-place ops. The reference for the op.
struct ComposedBatchNorm {
  Tensor weight, bias, running_mean, running_var;
  double eps = 1e-5, momentum = 0.1;

  Tensor forward(const Tensor& x, bool training) {
    const int64_t c = x.size(1);
    Dims reduce_dims{0};
    for (int64_t d = 2; d < x.dim(); ++d) reduce_dims.push_back(d);
    Dims bshape = Dims::filled(x.dim(), 1);
    bshape[1] = c;
    Tensor mean_b, var_b;
    if (training) {
      const int64_t count = x.numel() / c;
      mean_b = mean(x, reduce_dims, true);
      var_b = var(x, reduce_dims, 0, true);
      NoGradGuard no_grad;
      const double unbias = static_cast<double>(count) / static_cast<double>(count - 1);
      running_mean.mul_(1.0 - momentum).add_(mean_b.detach().reshape({c}), momentum);
      running_var.mul_(1.0 - momentum).add_(var_b.detach().reshape({c}), momentum * unbias);
    } else {
      mean_b = running_mean.reshape(bshape);
      var_b = running_var.reshape(bshape);
    }
    Tensor y = mul(sub(x, mean_b), rsqrt(add(var_b, eps)));
    return add(mul(y, weight.reshape(bshape)), bias.reshape(bshape));
  }
};

Tensor state(Module& m, const std::string& name) {
  for (auto& [k, t] : m.state_dict())
    if (k == name) return t;
  return Tensor();
}
}  // namespace

// The module runs the batch_norm op; its outputs, gradients and running statistics match the
// composed version it replaced, over training steps and in evaluation.
TEST(Module, BatchNormOpMatchesTheComposedModule) {
  Generator gen(9);
  struct Case {
    std::shared_ptr<BatchNorm> bn;
    Dims shape;
  };
  const std::vector<Case> cases = {{std::make_shared<BatchNorm1d>(5), {8, 5}},
                                   {std::make_shared<BatchNorm1d>(3, 1e-3, 0.2), {4, 3, 6}},
                                   {std::make_shared<BatchNorm2d>(4), {3, 4, 5, 5}}};
  for (const Case& c : cases) {
    BatchNorm& bn = *c.bn;
    const std::string what = bn.to_string() + " " + c.shape.str();
    const int64_t ch = c.shape[1];
    // Non-trivial affine parameters, shared with the reference by value.
    {
      NoGradGuard no_grad;
      state(bn, "weight").copy_(randn({ch}, gen));
      state(bn, "bias").copy_(randn({ch}, gen));
    }
    ComposedBatchNorm ref{state(bn, "weight").detach().clone().requires_grad_(),
                          state(bn, "bias").detach().clone().requires_grad_(), zeros({ch}),
                          ones({ch})};
    if (what.find("eps=0.001") != std::string::npos) {
      ref.eps = 1e-3;
      ref.momentum = 0.2;
    }
    for (int step = 0; step < 3; ++step) {
      const Tensor x0 = randn(c.shape, gen, kFloat32, 1.0, 3.0);
      Tensor x = x0.detach().requires_grad_(), xr = x0.detach().requires_grad_();
      const Tensor g = randn(c.shape, gen);
      Tensor y = bn.forward(x), yr = ref.forward(xr, true);
      EXPECT_TRUE(allclose(y, yr, 1e-5, 1e-5)) << what << " step " << step;
      sum(mul(y, g)).backward();
      sum(mul(yr, g)).backward();
      EXPECT_TRUE(allclose(x.grad(), xr.grad(), 1e-4, 1e-4)) << what << " input gradient";
      EXPECT_TRUE(allclose(state(bn, "weight").grad(), ref.weight.grad(), 1e-4, 1e-4)) << what;
      EXPECT_TRUE(allclose(state(bn, "bias").grad(), ref.bias.grad(), 1e-4, 1e-4)) << what;
      bn.zero_grad();
      ref.weight.set_grad(Tensor());
      ref.bias.set_grad(Tensor());
      EXPECT_TRUE(allclose(state(bn, "running_mean"), ref.running_mean, 1e-6, 1e-5)) << what;
      EXPECT_TRUE(allclose(state(bn, "running_var"), ref.running_var, 1e-6, 1e-5)) << what;
    }
    EXPECT_EQ(state(bn, "num_batches_tracked").item(), 3);
    bn.eval();
    const Tensor x = randn(c.shape, gen);
    EXPECT_TRUE(allclose(bn.forward(x), ref.forward(x, false), 1e-5, 1e-5)) << what << " eval";
    EXPECT_EQ(state(bn, "num_batches_tracked").item(), 3);
  }
}

TEST(Module, DropoutOnlyInTraining) {
  Dropout d(0.5, 7);
  Tensor x = ones({1000});
  Tensor y = d.forward(x);
  const double kept = sum(ne(y, 0.0)).item();
  EXPECT_GT(kept, 400);
  EXPECT_LT(kept, 600);
  EXPECT_NEAR(sum(y).item(), kept * 2.0, 1e-3);
  d.eval();
  EXPECT_TRUE(equal(d.forward(x), x));
}

TEST(Module, RegistrationErrors) {
  class Bad : public Module {
   public:
    Bad() : Module("Bad") {
      register_parameter("w", ones({1}));
      register_parameter("w", ones({1}));
    }
  };
  expect_error([] { Bad b; }, {"'w' is already registered"});
  expect_error([] { (void)Module().forward(ones({1})); }, {"no single-tensor forward"});
}
