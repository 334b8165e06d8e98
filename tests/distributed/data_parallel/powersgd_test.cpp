// PowerSGD (powersgd.h) with ranks as threads: the hook driven bucket by bucket against a
// reference in plain loops (P, Q, the approximation, the error; warm start and without), error
// feedback's sum over steps, exactness on a rank-1 gradient, and under DDP the reducer's own
// elements (unused-parameter status, compute times) coming back as the plain average.
#include <cmath>

#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/powersgd.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace lockstep::testing::ddp;

namespace {

using Matrix = std::vector<double>;  // row-major

// A bucket's parameters: the test's gradients are given per parameter, flat.
struct Param {
  std::string name;
  Dims shape;
};

// The reducer's elements after `numel` in bucket 0: the unused-parameter status and one time
// slot per rank.
int64_t own_elements(int world) { return 1 + world; }

GradBucket make_bucket(const std::vector<Param>& params, int world) {
  GradBucket b;
  for (const Param& p : params) {
    b.parameter_names.push_back(p.name);
    b.parameters.push_back(zeros(p.shape));
    b.numel += p.shape.numel();
  }
  b.buffer = zeros({b.numel + own_elements(world)});
  b.contributors = world;
  return b;
}

void set_grads(GradBucket& b, const std::vector<Matrix>& grads) {
  int64_t at = 0;
  for (const Matrix& g : grads) {
    b.buffer.narrow(0, at, static_cast<int64_t>(g.size()))
        .copy_(
            from_vector(std::vector<float>(g.begin(), g.end()), {static_cast<int64_t>(g.size())}));
    at += static_cast<int64_t>(g.size());
  }
}

std::vector<Matrix> get_grads(const GradBucket& b, const std::vector<Param>& params) {
  std::vector<Matrix> out;
  int64_t at = 0;
  for (const Param& p : params) {
    out.push_back(b.buffer.narrow(0, at, p.shape.numel()).to_vector<double>());
    at += p.shape.numel();
  }
  return out;
}

// --- the reference, in plain loops ---

// Gram-Schmidt on the columns of an (n, r) matrix.
void orthogonalize(Matrix& a, int64_t n, int64_t r) {
  for (int64_t i = 0; i < r; ++i) {
    double norm = 0;
    for (int64_t k = 0; k < n; ++k) norm += a[k * r + i] * a[k * r + i];
    norm = std::sqrt(norm);
    for (int64_t k = 0; k < n; ++k) a[k * r + i] = norm > 0 ? a[k * r + i] / norm : 0;
    for (int64_t j = i + 1; j < r; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < n; ++k) dot += a[k * r + i] * a[k * r + j];
      for (int64_t k = 0; k < n; ++k) a[k * r + j] -= dot * a[k * r + i];
    }
  }
}

bool compressed(const Dims& shape, int64_t rank, int64_t& n, int64_t& m, int64_t& r) {
  if (shape.size() < 2) return false;
  n = shape[0];
  m = shape.numel() / n;
  r = std::min({n, m, rank});
  return (n + m) * r * 2 < n * m;  // min_compression_rate 2
}

// What every rank should hold after each step: out[step][param] (the same on every rank),
// error[step][rank][param], q[step][param] (empty for an uncompressed one).
struct Expected {
  std::vector<std::vector<Matrix>> out;
  std::vector<std::vector<std::vector<Matrix>>> error;
  std::vector<std::vector<Matrix>> q;
};

// grads[step][rank][param]; compression from step 0, error feedback on.
Expected reference(const std::vector<Param>& params,
                   const std::vector<std::vector<std::vector<Matrix>>>& grads, int64_t rank,
                   bool warm_start, uint64_t seed) {
  const size_t world = grads[0].size();
  Generator gen(seed);
  Expected want;
  std::vector<std::vector<Matrix>> err(world);
  std::vector<Matrix> last_q(params.size());
  for (size_t s = 0; s < grads.size(); ++s) {
    std::vector<std::vector<Matrix>> in = grads[s];  // M = gradient + error
    for (size_t w = 0; w < world; ++w)
      for (size_t k = 0; k < params.size() && s > 0; ++k)
        for (size_t i = 0; i < in[w][k].size(); ++i) in[w][k][i] += err[w][k][i];
    std::vector<Matrix> out(params.size()), qs(params.size());
    for (size_t k = 0; k < params.size(); ++k) {
      const size_t len = in[0][k].size();
      int64_t n = 0, m = 0, r = 0;
      if (!compressed(params[k].shape, rank, n, m, r)) {
        out[k].assign(len, 0.0);
        for (size_t w = 0; w < world; ++w)
          for (size_t i = 0; i < len; ++i) out[k][i] += in[w][k][i] / static_cast<double>(world);
        continue;
      }
      Matrix q = last_q[k];
      if (!warm_start || q.empty()) q = randn({m, r}, gen).to_vector<double>();
      orthogonalize(q, m, r);
      Matrix p(n * r, 0.0);  // average of M_w Q
      for (size_t w = 0; w < world; ++w)
        for (int64_t a = 0; a < n; ++a)
          for (int64_t c = 0; c < r; ++c)
            for (int64_t b = 0; b < m; ++b)
              p[a * r + c] += in[w][k][a * m + b] * q[b * r + c] / static_cast<double>(world);
      orthogonalize(p, n, r);
      Matrix q2(m * r, 0.0);  // average of M_w^T P
      for (size_t w = 0; w < world; ++w)
        for (int64_t b = 0; b < m; ++b)
          for (int64_t c = 0; c < r; ++c)
            for (int64_t a = 0; a < n; ++a)
              q2[b * r + c] += in[w][k][a * m + b] * p[a * r + c] / static_cast<double>(world);
      out[k].assign(n * m, 0.0);
      for (int64_t a = 0; a < n; ++a)
        for (int64_t b = 0; b < m; ++b)
          for (int64_t c = 0; c < r; ++c) out[k][a * m + b] += p[a * r + c] * q2[b * r + c];
      last_q[k] = qs[k] = q2;
    }
    for (size_t w = 0; w < world; ++w) {
      err[w] = in[w];
      for (size_t k = 0; k < params.size(); ++k)
        for (size_t i = 0; i < err[w][k].size(); ++i) err[w][k][i] -= out[k][i];
    }
    want.out.push_back(out);
    want.error.push_back(err);
    want.q.push_back(qs);
  }
  return want;
}

// grads[step][rank][param] from a seeded generator.
std::vector<std::vector<std::vector<Matrix>>> random_grads(const std::vector<Param>& params,
                                                           int steps, int world, uint64_t seed) {
  Generator gen(seed);
  std::vector<std::vector<std::vector<Matrix>>> g(steps);
  for (auto& step : g) {
    step.resize(world);
    for (auto& rank : step)
      for (const Param& p : params)
        rank.push_back(randn({p.shape.numel()}, gen).to_vector<double>());
  }
  return g;
}

double max_abs(const Matrix& a) {
  double m = 0;
  for (double v : a) m = std::max(m, std::abs(v));
  return m;
}

void expect_near(const Matrix& got, const Matrix& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double scale = std::max(1.0, max_abs(want));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * scale) << what << " element " << i;
}

// What each rank's hook produced, per step: the bucket's gradients, the state's errors and Qs.
struct Observed {
  std::vector<std::vector<Matrix>> out, error, q;  // [step][param]
  std::vector<std::vector<double>> own;            // [step]: the reducer's elements
  std::vector<std::vector<double>> own_avg;        // [step]: the same through allreduce_hook
  int64_t wire_bytes = 0;
};

// Runs the hook on bucket 0 of `params` for every step of `grads` on world thread ranks.
std::vector<Observed> run_hook(const std::vector<Param>& params,
                               const std::vector<std::vector<std::vector<Matrix>>>& grads,
                               const PowerSGDOptions& opts) {
  const int world = static_cast<int>(grads[0].size());
  std::vector<Observed> seen(world);
  const auto errors = lockstep::testing::run_ranks(world, [&](int r, ProcessGroupPtr pg) {
    auto state = std::make_shared<PowerSGDState>(opts);
    const CommHook hook = powersgd_hook(state);
    GradBucket b = make_bucket(params, world);
    for (size_t s = 0; s < grads.size(); ++s) {
      set_grads(b, grads[s][r]);
      // Status and times as the reducer writes them: a count, and this rank's time in its slot.
      Tensor own = b.buffer.narrow(0, b.numel, own_elements(world));
      own.zero_();
      own.narrow(0, 0, 1).fill_(r == 1 ? 2.0 : 0.0);
      own.narrow(0, 1 + r, 1).fill_(10.5 * (r + 1) + static_cast<double>(s) / 3);
      Tensor plain = own.clone();
      pg->all_reduce(plain, {.op = ReduceOp::avg})->wait();
      hook.start(*pg, b)->wait();
      hook.finish(b);
      seen[r].out.push_back(get_grads(b, params));
      seen[r].own.push_back(own.to_vector<double>());
      seen[r].own_avg.push_back(plain.to_vector<double>());
      std::vector<Matrix> e, q;
      for (const Param& p : params) {
        const Tensor et = state->error(p.name), qt = state->q(p.name);
        e.push_back(et.defined() ? et.to_vector<double>() : Matrix());
        q.push_back(qt.defined() ? qt.to_vector<double>() : Matrix());
      }
      seen[r].error.push_back(e);
      seen[r].q.push_back(q);
      seen[r].wire_bytes = b.wire_bytes;
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  return seen;
}

// Two matrices compressed at rank 2 (one 3-D), a bias and a small matrix that are not.
const std::vector<Param> kParams = {
    {"w", {12, 10}}, {"b", {12}}, {"small", {3, 2}}, {"conv", {8, 3, 4}}};

void check_against_reference(int world, bool warm_start) {
  constexpr int kSteps = 3;
  constexpr uint64_t kSeed = 42;
  const auto grads = random_grads(kParams, kSteps, world, 7);
  const Expected want = reference(kParams, grads, 2, warm_start, kSeed);
  const auto seen = run_hook(kParams, grads,
                             {.matrix_approximation_rank = 2,
                              .start_powersgd_iter = 0,
                              .warm_start = warm_start,
                              .seed = kSeed});
  ASSERT_EQ(seen.size(), static_cast<size_t>(world));
  constexpr double kTol = 1e-4;  // f32 against double
  for (int r = 0; r < world; ++r) {
    for (int s = 0; s < kSteps; ++s) {
      for (size_t k = 0; k < kParams.size(); ++k) {
        const std::string what =
            "rank " + std::to_string(r) + " step " + std::to_string(s) + " " + kParams[k].name;
        expect_near(seen[r].out[s][k], want.out[s][k], kTol, what + " output");
        expect_near(seen[r].error[s][k], want.error[s][r][k], kTol, what + " error");
        expect_near(seen[r].q[s][k], want.q[s][k], kTol, what + " Q");
      }
      // The reducer's elements: bitwise what the plain average returns.
      EXPECT_EQ(seen[r].own[s], seen[r].own_avg[s]) << "rank " << r << " step " << s;
    }
    EXPECT_EQ(seen[r].out, seen[0].out) << "rank " << r << " ends elsewhere than rank 0";
  }
  // On the wire: the uncompressed 12 + 6 elements, the reducer's, and P and Q of both matrices.
  const int64_t wire = 12 + 6 + own_elements(world) + (12 + 8) * 2 + (10 + 12) * 2;
  EXPECT_EQ(seen[0].wire_bytes, wire * 4);
}

TEST(PowerSGD, ThreeRanksMatchTheReferenceInPlainLoops) { check_against_reference(3, true); }

TEST(PowerSGD, WithoutWarmStartEachStepDrawsANewQ) {
  check_against_reference(2, false);
  // The two references differ from step 1 on, so each test tells warm start from a new draw.
  const auto grads = random_grads(kParams, 2, 2, 7);
  const Expected warm = reference(kParams, grads, 2, true, 42);
  const Expected cold = reference(kParams, grads, 2, false, 42);
  EXPECT_GT(max_abs(warm.q[1][0]), 0);
  double diff = 0;
  for (size_t i = 0; i < warm.out[1][0].size(); ++i)
    diff = std::max(diff, std::abs(warm.out[1][0][i] - cold.out[1][0][i]));
  EXPECT_GT(diff, 1e-2);
}

TEST(PowerSGD, WarmStartConvergesOnAGradientThatDoesNotChange) {
  // Warm start runs one step of power iteration per training step from the last Q: on the same
  // gradient (a strong rank-1 part plus noise) the output settles on the best rank-1
  // approximation and stops moving, which a new random Q at every step does not.
  const std::vector<Param> params = {{"w", {16, 12}}};
  Generator gen(3);
  const Matrix u = randn({16}, gen).to_vector<double>(), v = randn({12}, gen).to_vector<double>();
  Matrix g = randn({16 * 12}, gen).to_vector<double>();
  for (int a = 0; a < 16; ++a)
    for (int b = 0; b < 12; ++b) g[a * 12 + b] += 3 * u[a] * v[b];
  const std::vector<std::vector<std::vector<Matrix>>> same(8, {{g}});
  PowerSGDOptions o{.start_powersgd_iter = 0, .use_error_feedback = false};
  const auto warm = run_hook(params, same, o);
  o.warm_start = false;
  const auto cold = run_hook(params, same, o);
  double warm_move = 0, cold_move = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    warm_move = std::max(warm_move, std::abs(warm[0].out[7][0][i] - warm[0].out[6][0][i]));
    cold_move = std::max(cold_move, std::abs(cold[0].out[7][0][i] - cold[0].out[6][0][i]));
  }
  EXPECT_LT(warm_move, 1e-2 * cold_move) << "warm " << warm_move << ", cold " << cold_move;
}

TEST(PowerSGD, ErrorFeedbackLosesNothingOverSteps) {
  // Sum over steps of the applied update, plus the ranks' mean final error, is the sum of the
  // true averages; every step alone is lossy.
  constexpr int kWorld = 2, kSteps = 6;
  const std::vector<Param> params = {{"w", {16, 12}}, {"b", {16}}};
  const auto grads = random_grads(params, kSteps, kWorld, 11);
  const auto seen = run_hook(params, grads, {.start_powersgd_iter = 0});
  for (size_t k = 0; k < params.size(); ++k) {
    const size_t len = static_cast<size_t>(params[k].shape.numel());
    Matrix applied(len, 0.0), truth(len, 0.0);
    for (int s = 0; s < kSteps; ++s) {
      double step_gap = 0;
      for (size_t i = 0; i < len; ++i) {
        double avg = 0;
        for (int w = 0; w < kWorld; ++w) avg += grads[s][w][k][i] / kWorld;
        truth[i] += avg;
        applied[i] += seen[0].out[s][k][i];
        step_gap = std::max(step_gap, std::abs(seen[0].out[s][k][i] - avg));
      }
      if (k == 0) EXPECT_GT(step_gap, 0.1) << "step " << s << " was not compressed";
    }
    for (int w = 0; w < kWorld; ++w)
      for (size_t i = 0; i < len; ++i) applied[i] += seen[w].error[kSteps - 1][k][i] / kWorld;
    expect_near(applied, truth, 1e-4, params[k].name);
  }
}

TEST(PowerSGD, RankOneOnARankOneGradientIsExact) {
  // Every rank's gradient is a multiple of the same u v^T: their average is rank 1.
  constexpr int kWorld = 3;
  const std::vector<Param> params = {{"w", {10, 7}}};
  Generator gen(5);
  const Matrix u = randn({10}, gen).to_vector<double>(), v = randn({7}, gen).to_vector<double>();
  std::vector<std::vector<std::vector<Matrix>>> grads(1, std::vector<std::vector<Matrix>>(kWorld));
  Matrix avg(70, 0.0);
  for (int w = 0; w < kWorld; ++w) {
    const double c = w == 1 ? -0.5 : 1.0 + w;
    Matrix g(70);
    for (int a = 0; a < 10; ++a)
      for (int b = 0; b < 7; ++b) g[a * 7 + b] = c * u[a] * v[b];
    for (int i = 0; i < 70; ++i) avg[i] += g[i] / kWorld;
    grads[0][w] = {g};
  }
  const auto seen = run_hook(params, grads, {.start_powersgd_iter = 0});
  for (int w = 0; w < kWorld; ++w) expect_near(seen[w].out[0][0], avg, 1e-5, "rank-1 average");
}

TEST(PowerSGD, PlainAllReduceBeforeTheStartIteration) {
  const std::vector<Param> params = {{"w", {16, 12}}};
  const auto grads = random_grads(params, 3, 2, 13);
  const auto seen = run_hook(params, grads, {.start_powersgd_iter = 2});
  for (int s = 0; s < 3; ++s) {
    Matrix avg(grads[s][0][0].size());
    for (size_t i = 0; i < avg.size(); ++i) avg[i] = (grads[s][0][0][i] + grads[s][1][0][i]) / 2;
    double gap = 0;
    for (size_t i = 0; i < avg.size(); ++i)
      gap = std::max(gap, std::abs(seen[0].out[s][0][i] - avg[i]));
    if (s < 2) {
      EXPECT_LT(gap, 1e-6) << "step " << s;
      EXPECT_TRUE(seen[0].q[s][0].empty()) << "step " << s << " compressed";
    } else {
      EXPECT_GT(gap, 0.1) << "step 2 was not compressed";
    }
  }
  EXPECT_EQ(seen[0].wire_bytes, (16 * 1 + 12 * 1 + own_elements(2)) * 4);
}

TEST(PowerSGD, BadOptionsAreRefused) {
  lockstep::testing::expect_error([] { PowerSGDState s({.matrix_approximation_rank = 0}); },
                                  {"matrix_approximation_rank must be at least 1, got 0"});
}

TEST(PowerSGD, AStateServesOneProcessGroupAtATime) {
  // Ranks on threads given one hook would count their steps together and mix their errors: a
  // second group is refused while the first lives, and may take the state over once it is gone.
  const CommHook hook = powersgd_hook({.start_powersgd_iter = 0});
  auto use = [&](ProcessGroupPtr pg) {
    GradBucket b = make_bucket(kParams, 1);
    hook.start(*pg, b)->wait();
    hook.finish(b);
  };
  std::string inner;
  const auto outer = lockstep::testing::run_ranks(
      1,
      [&](int, ProcessGroupPtr pg) {
        use(pg);
        inner = lockstep::testing::run_ranks(
            1, [&](int, ProcessGroupPtr other) { use(other); }, std::chrono::seconds(60),
            /*via_registry=*/true)[0];
        use(pg);  // still its own
      },
      std::chrono::seconds(60), /*via_registry=*/true);
  EXPECT_EQ(outer[0], "");
  EXPECT_THAT(inner, ::testing::HasSubstr("already serves another process group (rank 0 of 1)"));
  EXPECT_THAT(inner, ::testing::HasSubstr("give each DDP model its own powersgd_hook()"));
  const auto later = lockstep::testing::run_ranks(
      1, [&](int, ProcessGroupPtr pg) { use(pg); }, std::chrono::seconds(60),
      /*via_registry=*/true);
  EXPECT_EQ(later[0], "");
}

TEST(PowerSGD, AStepWithFewerContributorsThanRanksIsRefusedOnEveryRank) {
  // Inside a dist::Join after a rank ran out of data, error feedback would be wrong: every rank
  // refuses before any collective, so none waits for the others.
  const auto errors = lockstep::testing::run_ranks(2, [&](int, ProcessGroupPtr pg) {
    const CommHook hook = powersgd_hook({.start_powersgd_iter = 0});
    GradBucket b = make_bucket(kParams, 2);
    b.contributors = 1;
    hook.start(*pg, b)->wait();
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("1 of 2 ranks contribute"));
    EXPECT_THAT(e, ::testing::HasSubstr("use allreduce_hook() with Join"));
  }
}

// --- under DDP: the reducer's own elements ---

TEST(PowerSGDDDP, AParameterUnusedOnOneRankStillFailsBothRanks) {
  // The unused count rides in the status element, which PowerSGD sends beside P.
  const Data data = make_data(4, 9);
  const auto errors = lockstep::testing::run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    DDPOptions o;
    o.comm_hook = powersgd_hook({.start_powersgd_iter = 0});
    auto ddp = std::make_shared<DistributedDataParallel>(mlp(1), pg, o);
    Data d = shard(data, r, 2);
    if (r == 0) {
      cross_entropy(ddp->forward(d.x), d.y).backward();
    } else {
      ddp->forward(d.x);
      sum(mul(ddp->module()->parameters()[0], 0.0)).backward();
    }
  });
  for (const auto& e : errors) EXPECT_THAT(e, ::testing::HasSubstr("received no gradient"));
  EXPECT_THAT(errors[0], ::testing::HasSubstr("rank 1: "));
}

// Two heads of 32 x 32 behind a shared layer; forward uses the first only.
class TwoHeads : public nn::Module {
 public:
  explicit TwoHeads(uint64_t seed) : nn::Module("TwoHeads") {
    Generator gen(seed);
    body_ = register_module("body", std::make_shared<nn::Linear>(kIn, kHidden, gen));
    used_ = register_module("used", std::make_shared<nn::Linear>(kHidden, kClasses, gen));
    unused_ = register_module("unused", std::make_shared<nn::Linear>(kHidden, kHidden, gen));
  }
  Tensor forward(const Tensor& x) override { return used_->forward(relu(body_->forward(x))); }

 private:
  std::shared_ptr<nn::Linear> body_, used_, unused_;
};

TEST(PowerSGDDDP, UnusedParametersGetAZeroGradientNotNaN) {
  // find_unused_parameters: the unused head's zero gradient compresses to P = 0, whose
  // orthogonalization must leave it 0; the trained parameters stay the same on both ranks.
  const Data data = make_data(8, 9);
  std::vector<std::vector<std::vector<double>>> params(2);
  std::vector<std::vector<double>> unused_grad(2);
  std::vector<int64_t> wire(2), gradient_bytes(2);
  const auto errors = lockstep::testing::run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    DDPOptions o;
    o.find_unused_parameters = true;
    o.comm_hook = powersgd_hook({.start_powersgd_iter = 0});
    auto ddp = std::make_shared<DistributedDataParallel>(std::make_shared<TwoHeads>(1), pg, o);
    optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    Data d = shard(data, r, 2);
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      cross_entropy(ddp->forward(d.x), d.y).backward();
      opt.step();
    }
    for (const auto& [name, p] : ddp->module()->named_parameters())
      if (name == "unused.weight") unused_grad[r] = p.grad().to_vector<double>();
    params[r] = param_values(*ddp->module());
    wire[r] = ddp->stats().bytes_reduced_last_step;
    for (const Tensor& p : ddp->module()->parameters()) gradient_bytes[r] += p.nbytes();
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < 2; ++r)
    for (double v : unused_grad[r]) ASSERT_EQ(v, 0.0);
  // DDPStats counts what the hook sent (P, Q, the 1-D tensors), not the gradients' bytes.
  for (int r = 0; r < 2; ++r) {
    EXPECT_GT(wire[r], 0);
    EXPECT_LT(wire[r], gradient_bytes[r] / 2) << "rank " << r;
  }
  for (const auto& p : params[0])
    for (double v : p) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(params[1], params[0]);
}

}  // namespace
