// scaled_dot_product_attention against the naive composition matmul, mask, softmax, matmul:
// values and gradients for several sequence lengths (one not a multiple of the 64-row tile),
// heads and head dims, causal or not; finite-difference gradients; strided and 16-bit inputs;
// errors. The f32 kernels are checked against the f64 composition each: the AVX2 micro-kernel
// with its exps on 8 or on 16 lanes (where the CPU has AVX-512F) and the portable BLAS-tile
// kernels, switched with set_attention_avx2 and set_attention_avx512; 8 and 16 lanes give the
// same bits.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ops/cpu/attention_avx2.h"
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

// The f32 kernels: the portable one (BLAS tiles), the AVX2 micro-kernel, and the same with its
// softmax exps on AVX-512 lanes (Note [Attention exps on AVX-512]).
enum class Kernel { kPortable, kAvx2, kAvx512 };

const char* kernel_name(Kernel k) {
  return k == Kernel::kPortable ? "portable" : k == Kernel::kAvx2 ? "avx2" : "avx512";
}

// The f32 kernels to check on this machine: the portable one always, the others where the CPU
// runs them.
std::vector<Kernel> f32_kernels() {
  std::vector<Kernel> kernels{Kernel::kPortable};
  cpu::set_attention_avx2(true);
  cpu::set_attention_avx512(true);
  if (cpu::attention_avx2_enabled()) kernels.push_back(Kernel::kAvx2);
  if (cpu::attention_avx2_enabled() && cpu::attention_avx512_enabled())
    kernels.push_back(Kernel::kAvx512);
  return kernels;
}

// Selects one f32 kernel for a scope and turns the fastest back on after it.
struct Avx2Kernels {
  explicit Avx2Kernels(Kernel k) {
    cpu::set_attention_avx2(k != Kernel::kPortable);
    cpu::set_attention_avx512(k == Kernel::kAvx512);
  }
  ~Avx2Kernels() {
    cpu::set_attention_avx2(true);
    cpu::set_attention_avx512(true);
  }
};

// t (..., n) placed at columns [before, before + n) of zeros (..., before + n + after).
Tensor pad_last(const Tensor& t, int64_t before, int64_t after) {
  Dims shape = t.shape();
  shape[shape.size() - 1] += before + after;
  Tensor out = zeros(shape, t.dtype());
  out.narrow(-1, before, t.size(-1)).copy_(t);
  return out;
}

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

// Both f32 kernels, values and gradients, against the f64 composition: self-attention for kCases
// and T = 300 (past the forward's 256-key tile), cross-attention with tq != tk and dv != d.
TEST(Attention, Float32KernelsMatchTheFloat64Composition) {
  struct Shape {
    Dims q, k, v;
    bool causal;
  };
  std::vector<Shape> shapes;
  for (const Case& c : kCases)
    for (bool causal : {false, true})
      shapes.push_back({{c.b, c.h, c.t, c.d}, {c.b, c.h, c.t, c.d}, {c.b, c.h, c.t, c.d}, causal});
  shapes.push_back({{1, 2, 300, 16}, {1, 2, 300, 16}, {1, 2, 300, 16}, true});
  shapes.push_back({{1, 1, 300, 8}, {1, 1, 300, 8}, {1, 1, 300, 8}, false});
  shapes.push_back({{2, 3, 9, 4}, {2, 3, 70, 4}, {2, 3, 70, 6}, false});
  shapes.push_back({{1, 2, 130, 12}, {1, 2, 67, 12}, {1, 2, 67, 20}, false});
  for (Kernel avx2 : f32_kernels()) {
    Avx2Kernels kernels(avx2);
    Generator gen(40);
    for (const Shape& s : shapes) {
      const std::string what = std::string(kernel_name(avx2)) + " q" + s.q.str() + " k" +
                               s.k.str() + " v" + s.v.str() + (s.causal ? " causal" : "");
      Tensor q0 = randn(s.q, gen, kFloat64), k0 = randn(s.k, gen, kFloat64),
             v0 = randn(s.v, gen, kFloat64);
      Dims oshape = s.q;
      oshape[oshape.size() - 1] = s.v.back();
      Tensor w = randn(oshape, gen, kFloat64);
      std::vector<double> want[4], got[4];
      for (bool f32 : {false, true}) {
        const DType dt = f32 ? kFloat32 : kFloat64;
        // clone: to() of an f64 tensor to f64 is the tensor itself, which must stay a constant.
        Tensor q = q0.to(dt).clone().requires_grad_(), k = k0.to(dt).clone().requires_grad_(),
               v = v0.to(dt).clone().requires_grad_();
        Tensor y = f32 ? scaled_dot_product_attention(q, k, v, {.is_causal = s.causal})
                       : naive_attention(q, k, v, s.causal);
        sum(mul(y, w.to(dt))).backward();
        auto& out = f32 ? got : want;
        out[0] = values(y);
        out[1] = values(q.grad());
        out[2] = values(k.grad());
        out[3] = values(v.grad());
      }
      expect_close(got[0], want[0], 2e-5, "values " + what);
      expect_close(got[1], want[1], 1e-4, "dq " + what);
      expect_close(got[2], want[2], 1e-4, "dk " + what);
      expect_close(got[3], want[3], 1e-4, "dv " + what);
    }
  }
}

// A NaN in q, k or v is not hidden by the softmax's max, clamps or masks, in both f32 kernels:
// a NaN in query 10 makes output row 10 NaN; one in key 10 makes the rows that see it (10 and
// later, causal) NaN and no other; one in value 10's channel 3 makes channel 3 of those rows NaN
// and no other channel. (Channel 3 of an earlier row in the same tile may be NaN too: its masked
// probability 0 times NaN, as in the naive composition.)
TEST(Attention, NaNPropagates) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (Kernel avx2 : f32_kernels()) {
    Avx2Kernels kernels(avx2);
    for (int which = 0; which < 3; ++which) {
      Generator gen(41);
      Tensor in[3] = {randn({1, 1, 20, 8}, gen), randn({1, 1, 20, 8}, gen),
                      randn({1, 1, 20, 8}, gen)};
      in[which].set_at({0, 0, 10, 3}, nan);
      const std::string what = std::string(kernel_name(avx2)) + " NaN in " + "qkv"[which];
      Tensor y = scaled_dot_product_attention(in[0], in[1], in[2], {.is_causal = true});
      const int64_t c = which == 2 ? 3 : 0;
      for (int64_t row = 0; row < 20; ++row) {
        const bool sees = which == 0 ? row == 10 : row >= 10;
        if (which == 2) {
          if (sees) EXPECT_TRUE(std::isnan(y.at({0, 0, row, c}))) << what << " row " << row;
          EXPECT_TRUE(std::isfinite(y.at({0, 0, row, 0}))) << what << " row " << row;
        } else {
          EXPECT_EQ(std::isnan(y.at({0, 0, row, c})), sees) << what << " row " << row;
        }
      }
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

// Note [Strided attention inputs]: q, k, v as unbind's views of one (B, T, 3, H, D) projection
// are read in place, by both f32 kernels and in f64: the output and the gradients are the same
// bits as for contiguous copies of the same values (the kernels do the same arithmetic), and
// the output lies in memory as (B, T, H, D), so transposing it back to (B, T, H * D) needs no
// copy. Odd sizes: T = 67 (not a multiple of 8, 6 or 64), D = 12 (not a multiple of 8).
TEST(Attention, UnbindViewsAreReadInPlaceWithTheSameResults) {
  const int64_t b = 2, t = 67, h = 3, d = 12;
  std::vector<std::pair<DType, Kernel>> runs = {{kFloat64, Kernel::kPortable}};
  for (Kernel avx2 : f32_kernels()) runs.push_back({kFloat32, avx2});
  for (auto [dt, avx2] : runs) {
    Avx2Kernels kernels(avx2);
    const std::string what = std::string(dtype_name(dt)) + " " + kernel_name(avx2);
    Generator gen(37);
    const Tensor qkv0 = randn({b, t, 3 * h * d}, gen, dt), gy = randn({b, h, t, d}, gen, dt);
    Tensor qkv = qkv0.clone().requires_grad_(true);
    std::vector<Tensor> parts = unbind(qkv.view({b, t, 3, h, d}), 2);  // 3 x (B,T,H,D)
    Tensor q = parts[0].transpose(1, 2), k = parts[1].transpose(1, 2), v = parts[2].transpose(1, 2);
    ASSERT_FALSE(q.is_contiguous()) << what;
    Tensor y = scaled_dot_product_attention(q, k, v, {.is_causal = true});
    EXPECT_TRUE(y.transpose(1, 2).is_contiguous()) << what << ": the output is (B,T,H,D) memory";
    sum(mul(y, gy)).backward();

    // The same values, copied contiguous, each its own leaf.
    Tensor qc = q.detach().contiguous().requires_grad_(true),
           kc = k.detach().contiguous().requires_grad_(true),
           vc = v.detach().contiguous().requires_grad_(true);
    Tensor yc = scaled_dot_product_attention(qc, kc, vc, {.is_causal = true});
    EXPECT_TRUE(yc.is_contiguous()) << what << ": contiguous inputs give a contiguous output";
    sum(mul(yc, gy)).backward();

    EXPECT_EQ(values(y), values(yc)) << what;
    std::vector<Tensor> gparts = unbind(qkv.grad().view({b, t, 3, h, d}), 2);
    EXPECT_EQ(values(gparts[0].transpose(1, 2)), values(qc.grad())) << what << " dq";
    EXPECT_EQ(values(gparts[1].transpose(1, 2)), values(kc.grad())) << what << " dk";
    EXPECT_EQ(values(gparts[2].transpose(1, 2)), values(vc.grad())) << what << " dv";
    // And against the f64 composition, so that "the same" is also right.
    expect_close(values(y), values(naive_attention(q.detach(), k.detach(), v.detach(), true)),
                 dt == kFloat64 ? 1e-12 : 2e-5, what);
  }
}

// Sibling views that overlap (k and v one element past q in the same rows) must not get their
// gradients in one shared buffer: each view's gradient is its own, as for contiguous copies.
TEST(Attention, OverlappingSiblingViewsGetTheirOwnGradients) {
  Generator gen(38);
  const int64_t b = 2, h = 2, t = 19, d = 8;
  const Tensor x0 = randn({b, h, t, d + 2}, gen), gy = randn({b, h, t, d}, gen);
  Tensor x = x0.clone().requires_grad_(true);
  Tensor q = x.narrow(-1, 0, d), k = x.narrow(-1, 1, d), v = x.narrow(-1, 2, d);
  sum(mul(scaled_dot_product_attention(q, k, v, {.is_causal = true}), gy)).backward();

  Tensor qc = x0.narrow(-1, 0, d).contiguous().requires_grad_(true),
         kc = x0.narrow(-1, 1, d).contiguous().requires_grad_(true),
         vc = x0.narrow(-1, 2, d).contiguous().requires_grad_(true);
  sum(mul(scaled_dot_product_attention(qc, kc, vc, {.is_causal = true}), gy)).backward();
  // x's gradient is the three shifted gradients added up.
  const Tensor want = add(add(pad_last(qc.grad(), 0, 2), pad_last(kc.grad(), 1, 1)),
                          pad_last(vc.grad(), 2, 0));
  expect_close(values(x.grad()), values(want), 1e-6, "overlapping views");
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

// A later key tile that raises a row's max by far more than exp's range (here by 200, past the
// f32 forward's 256-key tile and the portable one's 64) must discard what the earlier keys added:
// the output is the last value, in both f32 kernels, and the gradients match the f64 composition.
TEST(Attention, ALateLargeScoreWins) {
  for (Kernel avx2 : f32_kernels()) {
    Avx2Kernels kernels(avx2);
    const int64_t tk = 257;
    Tensor q = full({1, 1, 1, 1}, 1.0, kFloat32);
    Tensor k = zeros({1, 1, tk, 1});
    k.set_at({0, 0, tk - 1, 0}, 200.0);
    Tensor v = add(arange(0.0, static_cast<double>(tk), 1.0, kFloat32).view({1, 1, tk, 1}), 1.0);
    Tensor y = scaled_dot_product_attention(q, k, v, {.scale = 1.0});
    EXPECT_NEAR(y.at({0, 0, 0, 0}), static_cast<double>(tk), 1e-3) << kernel_name(avx2);
    Generator gen(42);
    Tensor w = randn({1, 1, 1, 1}, gen, kFloat64);
    std::vector<double> got[3], want[3];
    for (bool f32 : {false, true}) {
      const DType dt = f32 ? kFloat32 : kFloat64;
      Tensor qq = q.to(dt).clone().requires_grad_(), kk = k.to(dt).clone().requires_grad_(),
             vv = v.to(dt).clone().requires_grad_();
      Tensor out = f32 ? scaled_dot_product_attention(qq, kk, vv, {.scale = 1.0})
                       : naive_attention(qq, kk, vv, false, 1.0);
      sum(mul(out, w.to(dt))).backward();
      auto& r = f32 ? got : want;
      r[0] = values(qq.grad());
      r[1] = values(kk.grad());
      r[2] = values(vv.grad());
    }
    expect_close(got[0], want[0], 1e-4, "dq");
    expect_close(got[1], want[1], 1e-4, "dk");
    expect_close(got[2], want[2], 1e-4, "dv");
  }
}

// Note [Attention exps on AVX-512]: exp16 computes each lane as exp8 does and the row sums add
// in row_exp's order, so values and gradients are the same bits, at the model's head shape
// (T = 128, D = 32, causal), at sizes whose rows end in partial vectors (T = 67; T = 300 past the
// forward's key tile) and for cross-attention. Skipped only where the CPU lacks AVX-512F.
TEST(Attention, Avx512ExpsGiveTheAvx2Bits) {
  const std::vector<Kernel> kernels = f32_kernels();
  if (kernels.back() != Kernel::kAvx512) GTEST_SKIP() << "this CPU has no AVX-512F";
  struct Shape {
    Dims q, k, v;
    bool causal;
  };
  const std::vector<Shape> shapes = {
      {{2, 4, 128, 32}, {2, 4, 128, 32}, {2, 4, 128, 32}, true},
      {{1, 3, 67, 12}, {1, 3, 67, 12}, {1, 3, 67, 12}, true},
      {{1, 2, 300, 16}, {1, 2, 300, 16}, {1, 2, 300, 16}, false},
      {{1, 2, 300, 20}, {1, 2, 300, 20}, {1, 2, 300, 20}, true},
      {{2, 1, 9, 4}, {2, 1, 70, 4}, {2, 1, 70, 6}, false}};
  for (const Shape& s : shapes) {
    Generator gen(43);
    const Tensor q0 = randn(s.q, gen), k0 = randn(s.k, gen), v0 = randn(s.v, gen);
    Dims oshape = s.q;
    oshape[oshape.size() - 1] = s.v.back();
    const Tensor w = randn(oshape, gen);
    std::vector<double> out[2][4];
    for (int zmm = 0; zmm < 2; ++zmm) {
      Avx2Kernels use(zmm ? Kernel::kAvx512 : Kernel::kAvx2);
      Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(),
             v = v0.clone().requires_grad_();
      Tensor y = scaled_dot_product_attention(q, k, v, {.is_causal = s.causal});
      sum(mul(y, w)).backward();
      out[zmm][0] = values(y);
      out[zmm][1] = values(q.grad());
      out[zmm][2] = values(k.grad());
      out[zmm][3] = values(v.grad());
    }
    const char* names[] = {"values", "dq", "dk", "dv"};
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(out[1][i], out[0][i]) << names[i] << " q" << s.q.str() << " k" << s.k.str();
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
