// scaled_dot_product_attention against the naive composition matmul, mask, softmax, matmul:
// values and gradients for several sequence lengths (one not a multiple of the 64-row tile),
// heads and head dims, causal or not; finite-difference gradients; strided and 16-bit inputs;
// errors.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_close;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::make;
using lockstep::testing::values;

namespace {

// softmax(q k^T * scale, masked above the diagonal when causal) v, from tested ops, holding the
// whole (T, T) matrix.
Tensor naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                       double scale = 0) {
  if (scale == 0) scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  Tensor s = mul(matmul(q, k.transpose(-2, -1)), scale);
  if (causal) {
    const int64_t tq = q.size(-2), tk = k.size(-2);
    Tensor above = ne(make({tq, tk}, [tk](int64_t i) { return i % tk > i / tk ? 1 : 0; }), 0.0);
    s = masked_fill(s, above, -std::numeric_limits<double>::infinity());
  }
  return matmul(softmax(s, -1), v);
}

struct Case {
  int64_t b, h, t, d;
  std::string str() const {
    return "B=" + std::to_string(b) + " H=" + std::to_string(h) + " T=" + std::to_string(t) +
           " D=" + std::to_string(d);
  }
};

// T = 1, 7 (less than a tile), 64 (exactly one), 130 (two and a remainder of 2).
const std::vector<Case> kCases = {{2, 3, 1, 8},    {2, 3, 7, 8},    {1, 2, 64, 32},
                                  {2, 1, 130, 16}, {1, 4, 130, 32}, {3, 2, 65, 5}};

}  // namespace

TEST(Attention, ValuesMatchTheNaiveComposition) {
  Generator gen(31);
  for (DType dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat64 ? 1e-12 : 2e-5;
    for (const Case& c : kCases) {
      Tensor q = randn({c.b, c.h, c.t, c.d}, gen, dt), k = randn({c.b, c.h, c.t, c.d}, gen, dt),
             v = randn({c.b, c.h, c.t, c.d}, gen, dt);
      for (bool causal : {false, true}) {
        const std::string what =
            c.str() + (causal ? " causal" : "") + " " + std::string(dtype_name(dt));
        Tensor y = scaled_dot_product_attention(q, k, v, {.is_causal = causal});
        ASSERT_EQ(y.shape(), q.shape()) << what;
        EXPECT_EQ(y.dtype(), dt);
        expect_close(values(y), values(naive_attention(q, k, v, causal)), tol, what);
      }
    }
  }
}

TEST(Attention, GradientsMatchTheNaiveComposition) {
  Generator gen(32);
  for (const Case& c : kCases) {
    for (bool causal : {false, true}) {
      const std::string what = c.str() + (causal ? " causal" : "");
      const Dims shape{c.b, c.h, c.t, c.d};
      Tensor q0 = randn(shape, gen, kFloat64), k0 = randn(shape, gen, kFloat64),
             v0 = randn(shape, gen, kFloat64), w = randn(shape, gen, kFloat64);
      std::vector<double> want[3], got[3];
      for (bool fused : {false, true}) {
        Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(),
               v = v0.clone().requires_grad_();
        Tensor y = fused ? scaled_dot_product_attention(q, k, v, {.is_causal = causal})
                         : naive_attention(q, k, v, causal);
        sum(mul(y, w)).backward();
        auto& out = fused ? got : want;
        out[0] = values(q.grad());
        out[1] = values(k.grad());
        out[2] = values(v.grad());
      }
      expect_close(got[0], want[0], 1e-10, "dq " + what);
      expect_close(got[1], want[1], 1e-10, "dk " + what);
      expect_close(got[2], want[2], 1e-10, "dv " + what);
    }
  }
}

TEST(Attention, Gradcheck) {
  Generator gen(33);
  auto leaf = [&](const Dims& s) { return randn(s, gen, kFloat64).requires_grad_(); };
  for (bool causal : {false, true}) {
    auto fn = [causal](const std::vector<Tensor>& in) {
      return scaled_dot_product_attention(in[0], in[1], in[2], {.is_causal = causal});
    };
    expect_gradcheck(fn, {leaf({1, 2, 5, 3}), leaf({1, 2, 5, 3}), leaf({1, 2, 5, 3})});
    // Crosses a tile boundary: rows and keys 64..69 sit in a second, partial tile.
    expect_gradcheck(fn, {leaf({1, 1, 70, 2}), leaf({1, 1, 70, 2}), leaf({1, 1, 70, 2})});
  }
  // Cross-attention: fewer queries than keys, a value dim unlike the key dim, a given scale.
  auto cross = [](const std::vector<Tensor>& in) {
    return scaled_dot_product_attention(in[0], in[1], in[2], {.scale = 0.7});
  };
  expect_gradcheck(cross, {leaf({2, 3, 4}), leaf({2, 6, 4}), leaf({2, 6, 5})});
}

TEST(Attention, CrossAttentionAndScale) {
  Generator gen(34);
  Tensor q = randn({2, 3, 9, 4}, gen, kFloat64), k = randn({2, 3, 70, 4}, gen, kFloat64),
         v = randn({2, 3, 70, 6}, gen, kFloat64);
  Tensor y = scaled_dot_product_attention(q, k, v, {.scale = 0.3});
  ASSERT_EQ(y.shape(), Dims({2, 3, 9, 6}));
  expect_close(values(y), values(naive_attention(q, k, v, false, 0.3)), 1e-12, "cross");
}

TEST(Attention, StridedInputsAsAModelMakesThem) {
  // A GPT block splits (B, T, C) into heads as view(B, T, H, D).transpose(1, 2).
  Generator gen(35);
  const int64_t b = 2, t = 67, h = 3, d = 8;
  Tensor qkv = randn({b, t, 3 * h * d}, gen);
  auto head = [&](int64_t i) {
    return qkv.slice(2, i * h * d, (i + 1) * h * d).view({b, t, h, d}).transpose(1, 2);
  };
  Tensor q = head(0), k = head(1), v = head(2);
  ASSERT_FALSE(q.is_contiguous());
  Tensor y = scaled_dot_product_attention(q, k, v, {.is_causal = true});
  expect_close(values(y), values(naive_attention(q, k, v, true)), 2e-5, "strided");
}

TEST(Attention, LargeScoresStayFinite) {
  // Scores of order 1e4: without the running max, exp would overflow.
  Generator gen(36);
  Tensor q = mul(randn({1, 2, 80, 4}, gen), 100.0), k = mul(randn({1, 2, 80, 4}, gen), 100.0),
         v = randn({1, 2, 80, 4}, gen);
  for (bool causal : {false, true}) {
    Tensor y = scaled_dot_product_attention(q, k, v, {.is_causal = causal});
    for (double x : values(y)) ASSERT_TRUE(std::isfinite(x));
    expect_close(values(y), values(naive_attention(q, k, v, causal)), 1e-4, "large scores");
  }
}

TEST(Attention, CausalFirstRowIsItsValue) {
  // Query 0 sees key 0 only, whatever the scores.
  Generator gen(37);
  Tensor q = randn({1, 1, 5, 4}, gen), k = randn({1, 1, 5, 4}, gen), v = randn({1, 1, 5, 4}, gen);
  Tensor y = scaled_dot_product_attention(q, k, v, {.is_causal = true});
  for (int64_t c = 0; c < 4; ++c) EXPECT_FLOAT_EQ(y.at({0, 0, 0, c}), v.at({0, 0, 0, c}));
}

TEST(Attention, HalfTypesComputeInFloat32) {
  Generator gen(38);
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor q = randn({1, 2, 70, 16}, gen).to(dt), k = randn({1, 2, 70, 16}, gen).to(dt),
           v = randn({1, 2, 70, 16}, gen).to(dt);
    Tensor y = scaled_dot_product_attention(q, k, v, {.is_causal = true});
    EXPECT_EQ(y.dtype(), dt);
    Tensor want = naive_attention(q.to(kFloat32), k.to(kFloat32), v.to(kFloat32), true);
    expect_close(values(y), values(want), 2e-2, std::string(dtype_name(dt)));
    Tensor qg = q.detach().requires_grad_();
    sum(scaled_dot_product_attention(qg, k, v)).backward();
    EXPECT_EQ(qg.grad().dtype(), dt);
  }
}

TEST(Attention, OnlyInputsThatRequireGradGetOne) {
  Generator gen(39);
  Tensor q = randn({1, 1, 6, 3}, gen), k = randn({1, 1, 6, 3}, gen),
         v = randn({1, 1, 6, 3}, gen).requires_grad_();
  sum(scaled_dot_product_attention(q, k, v, {.is_causal = true})).backward();
  EXPECT_FALSE(q.grad().defined());
  EXPECT_FALSE(k.grad().defined());
  ASSERT_TRUE(v.grad().defined());
  // Each output row's weights sum to 1, so d sum(y) / dv sums to the number of queries.
  EXPECT_NEAR(sum(v.grad()).item(), 6.0 * 3.0, 1e-4);
}

TEST(Attention, Errors) {
  Tensor x = zeros({1, 2, 4, 3});
  expect_error(
      [&] {
        scaled_dot_product_attention(zeros({4, 3}), zeros({4, 3}), zeros({4, 3}));
      },
      {"scaled_dot_product_attention", ">= 3"});
  expect_error(
      [&] {
        scaled_dot_product_attention(x, zeros({1, 2, 4, 5}), x);
      },
      {"k's last dim", "3", "5"});
  expect_error(
      [&] {
        scaled_dot_product_attention(x, x, zeros({1, 2, 5, 3}));
      },
      {"as many values as keys", "4", "5"});
  expect_error(
      [&] {
        scaled_dot_product_attention(x, zeros({1, 3, 4, 3}), x);
      },
      {"leading", "[1, 3, 4, 3]"});
  expect_error([&] { scaled_dot_product_attention(x, x, x.to(kFloat64)); }, {"one dtype", "f64"});
  expect_error([&] { scaled_dot_product_attention(x.to(kInt64), x.to(kInt64), x.to(kInt64)); },
               {"floating-point", "i64"});
  expect_error(
      [&] {
        scaled_dot_product_attention(zeros({1, 2, 3, 3}), x, x, {.is_causal = true});
      },
      {"is_causal", "3", "4"});
}
