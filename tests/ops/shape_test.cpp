// cat, stack, split, unbind, index_select and gather against naive references on row-major vectors;
// layouts, dtypes, odd sizes; gradients; errors naming the offending tensor or index.
#include <cmath>
#include <vector>

#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::non_contiguous;
using lockstep::testing::unravel;
using lockstep::testing::values;

namespace {

// Row-major position of a multi-index.
int64_t flat(const Dims& idx, const Dims& shape) {
  int64_t f = 0;
  for (int64_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
  return f;
}

// Naive cat of row-major value vectors along d.
std::vector<double> naive_cat(const std::vector<std::vector<double>>& vals,
                              const std::vector<Dims>& shapes, int64_t d, Dims& out_shape) {
  out_shape = shapes[0];
  out_shape[d] = 0;
  for (const Dims& s : shapes) out_shape[d] += s[d];
  std::vector<double> out(out_shape.numel());
  for (int64_t i = 0; i < out_shape.numel(); ++i) {
    Dims idx = unravel(i, out_shape);
    size_t k = 0;
    while (idx[d] >= shapes[k][d]) idx[d] -= shapes[k++][d];
    out[i] = vals[k][flat(idx, shapes[k])];
  }
  return out;
}

std::vector<int64_t> ints(const Tensor& t) {
  std::vector<int64_t> v;
  for (double x : values(t)) v.push_back(static_cast<int64_t>(x));
  return v;
}

}  // namespace

// ---- cat / stack ----

TEST(Cat, MatchesNaiveReference) {
  Generator gen(31);
  struct Case {
    std::vector<Dims> shapes;
    int64_t dim;
  };
  const std::vector<Case> cases = {
      {{{7}, {1}, {1023}}, 0},
      {{{2, 3}, {5, 3}}, 0},
      {{{2, 3}, {2, 1}, {2, 7}}, 1},
      {{{2, 3}, {2, 1}, {2, 7}}, -1},
      {{{3, 1, 4}, {3, 7, 4}, {3, 0, 4}}, 1},
      {{{2, 1023, 3}, {1, 1023, 3}}, 0},
      {{{4, 5}}, 1},
  };
  for (DType dt : {kFloat32, kFloat64, kInt64, kInt32}) {
    for (const Case& cs : cases) {
      for (bool strided : {false, true}) {
        std::vector<Tensor> ts;
        std::vector<std::vector<double>> vals;
        for (const Dims& s : cs.shapes) {
          Tensor t = is_floating(dt) ? randn(s, gen, dt) : randint(-50, 50, s, gen, dt);
          if (strided && t.dim() > 0) t = non_contiguous(t);
          vals.push_back(values(t));
          ts.push_back(t);
        }
        const int64_t d = cs.dim < 0 ? cs.dim + cs.shapes[0].size() : cs.dim;
        Dims want_shape;
        const auto want = naive_cat(vals, cs.shapes, d, want_shape);
        Tensor out = cat(ts, cs.dim);
        ASSERT_EQ(out.shape(), want_shape);
        ASSERT_EQ(out.dtype(), dt);
        EXPECT_EQ(values(out), want) << want_shape;
      }
    }
  }
}

TEST(Cat, BoolAndPermutedInputs) {
  // (from_vector<bool> cannot work: std::vector<bool> has no data())
  Tensor a = from_vector<uint8_t>({1, 0, 1, 1, 0, 0}, {2, 3}).to(kBool);
  Tensor b = from_vector<uint8_t>({0, 1}, {2, 1}).to(kBool);
  Tensor ab = cat({a, b}, 1);
  EXPECT_EQ(ab.dtype(), kBool);
  EXPECT_EQ(values(ab), (std::vector<double>{1, 0, 1, 0, 1, 0, 0, 1}));
  Generator gen(32);
  Tensor p = randn({3, 4, 2}, gen).permute({2, 0, 1});  // (2, 3, 4)
  Tensor q = randn({2, 3, 4}, gen);
  Dims s;
  EXPECT_EQ(values(cat({p, q}, 2)),
            naive_cat({values(p), values(q)}, {p.shape(), q.shape()}, 2, s));
}

TEST(Cat, Gradcheck) {
  Generator gen(33);
  Tensor a = randn({3, 2}, gen, kFloat64).t().detach().requires_grad_();  // (2, 3) strided
  Tensor b = randn({2, 1}, gen, kFloat64).requires_grad_();
  Tensor c = randn({2, 4}, gen, kFloat64);  // needs no gradient
  Tensor e = randn({2, 2}, gen, kFloat64).requires_grad_();
  expect_gradcheck([](const std::vector<Tensor>& in) { return cat(in, 1); }, {a, b, c, e});
  // The same tensor twice: its gradient is the sum of both slices.
  Tensor x = randn({2, 3}, gen, kFloat64).requires_grad_();
  Tensor y = cat({x, x}, 0);
  y.backward(from_vector<double>({1, 2, 3, 4, 5, 6, 10, 20, 30, 40, 50, 60}, {4, 3}));
  EXPECT_EQ(values(x.grad()), (std::vector<double>{11, 22, 33, 44, 55, 66}));
}

TEST(Cat, Errors) {
  expect_error([] { cat({}); }, {"cat: expected a non-empty list"});
  expect_error(
      [] {
        cat({zeros({2, 3}), zeros({2, 3}), zeros({2, 4})}, 0);
      },
      {"cat: tensor 2 has shape [2, 4] but tensor 0 has shape [2, 3]", "except in dimension 0",
       "differ in dimension 1"});
  expect_error(
      [] {
        cat({zeros({2, 3}), zeros({2, 3}, kFloat64)}, 1);
      },
      {"cat: tensor 1 has dtype f64 but tensor 0 has dtype f32"});
  expect_error(
      [] {
        cat({zeros({2, 3}), zeros({6})});
      },
      {"cat: tensor 1 has shape [6] but tensor 0 has shape [2, 3]", "same number of dimensions"});
  expect_error([] { cat({zeros({2, 3})}, 2); }, {"cat: dimension 2 is out of range"});
  expect_error([] { cat({scalar_tensor(1.0)}); }, {"cat: zero-dimensional tensor"});
}

TEST(Stack, MatchesReferenceAndGradcheck) {
  Generator gen(34);
  Tensor a = randn({2, 3}, gen), b = randn({2, 3}, gen), c = non_contiguous(randn({2, 3}, gen));
  const auto av = values(a), bv = values(b), cv = values(c);
  const std::vector<const std::vector<double>*> vs = {&av, &bv, &cv};
  for (int64_t dim : {0, 1, 2, -1, -3}) {
    Tensor s = stack({a, b, c}, dim);
    const int64_t d = dim < 0 ? dim + 3 : dim;
    Dims want = {2, 3};
    want.insert(d, 3);
    ASSERT_EQ(s.shape(), want) << dim;
    for (int64_t i = 0; i < s.numel(); ++i) {
      Dims idx = unravel(i, want);
      const int64_t k = idx[d];
      idx.erase(d);
      ASSERT_EQ(s.at(unravel(i, want)), (*vs[k])[flat(idx, {2, 3})]) << dim;
    }
  }
  Tensor x = randn({1, 7}, gen, kFloat64).requires_grad_();
  Tensor y = randn({7, 1}, gen, kFloat64).t().detach().requires_grad_();
  expect_gradcheck([](const std::vector<Tensor>& in) { return stack(in, 1); }, {x, y});
  expect_error(
      [] {
        stack({zeros({2, 3}), zeros({3, 2})});
      },
      {"stack: tensor 1 has shape [3, 2] but tensor 0 has shape [2, 3]"});
  expect_error([] { stack({zeros({2, 3})}, 3); }, {"stack: dimension 3 is out of range"});
}

// ---- split ----

TEST(Split, PiecesAreViewsWithTheRightValues) {
  Generator gen(35);
  Tensor t = randn({7, 1023}, gen);
  const auto tv = values(t);
  auto pieces = split(t, 3, 0);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].shape(), Dims({3, 1023}));
  EXPECT_EQ(pieces[2].shape(), Dims({1, 1023}));
  for (size_t k = 0; k < pieces.size(); ++k) {
    EXPECT_EQ(pieces[k].data_ptr(),
              static_cast<char*>(t.data_ptr()) + 3 * k * 1023 * t.element_size());
    const auto pv = values(pieces[k]);
    for (size_t i = 0; i < pv.size(); ++i) ASSERT_EQ(pv[i], tv[3 * k * 1023 + i]);
  }
  auto cols = split(t, {1, 1000, 22}, -1);
  ASSERT_EQ(cols.size(), 3u);
  EXPECT_EQ(cols[1].shape(), Dims({7, 1000}));
  for (int64_t r = 0; r < 7; ++r) ASSERT_EQ(cols[2].at({r, 21}), tv[r * 1023 + 1022]);
  // A view: writing through the piece changes the original.
  cols[1].set_at({6, 0}, 42.0);
  EXPECT_EQ(t.at({6, 1}), 42.0);
  // Exact and oversize split sizes, a strided input, empty pieces.
  EXPECT_EQ(split(t, 7, 0).size(), 1u);
  EXPECT_EQ(split(t, 100, 0).size(), 1u);
  Tensor s = non_contiguous(randn({4, 5}, gen));
  auto sp = split(s, {0, 4, 1}, 1);
  EXPECT_EQ(sp[0].shape(), Dims({4, 0}));
  EXPECT_EQ(sp[2].at({3, 0}), s.at({3, 4}));
}

TEST(Split, Gradcheck) {
  Generator gen(36);
  Tensor x = randn({5, 3}, gen, kFloat64).t().detach().requires_grad_();  // (3, 5) strided
  expect_gradcheck(
      [](const std::vector<Tensor>& in) {
        auto p = split(in[0], 2, 1);  // widths 2, 2, 1
        return add(mul(p[0], 3.0), p[1]);
      },
      {x});
  expect_gradcheck(
      [](const std::vector<Tensor>& in) {
        auto p = split(in[0], std::vector<int64_t>{1, 2}, 0);
        return mul(p[1], 2.0);
      },
      {x});
}

TEST(Split, Errors) {
  expect_error(
      [] {
        split(zeros({4, 5}), std::vector<int64_t>{1, 2}, 1);
      },
      {"split: sizes [1, 2] add up to 3 but dimension 1 of [4, 5] has size 5"});
  expect_error([] { split(zeros({4, 5}), 0, 0); }, {"split: split_size must be positive, got 0"});
  expect_error(
      [] {
        split(zeros({4, 5}), std::vector<int64_t>{6, -1}, 1);
      },
      {"split: size 1 is -1"});
  expect_error([] { split(zeros({4, 5}), 2, 2); }, {"split: dimension 2 is out of range"});
}

// ---- unbind ----

TEST(Unbind, SlicesAreViewsWithTheRightValues) {
  Generator gen(61);
  Tensor t = randn({3, 5, 7}, gen);
  for (int64_t d = 0; d < 3; ++d) {
    auto parts = unbind(t, d - 3 * (d == 2));  // dim 2 given as -1
    ASSERT_EQ(parts.size(), static_cast<size_t>(t.size(d)));
    for (int64_t i = 0; i < t.size(d); ++i) {
      Tensor ref = t.select(d, i);
      EXPECT_EQ(parts[i].shape(), ref.shape());
      EXPECT_EQ(parts[i].data_ptr(), ref.data_ptr());
      EXPECT_EQ(values(parts[i]), values(ref));
    }
  }
  // A view: writing through a slice changes the original.
  unbind(t, 1)[4].set_at({2, 6}, 42.0);
  EXPECT_EQ(t.at({2, 4, 6}), 42.0);
}

// The one backward node gives select()'s gradients: every slice's gradient in its place, zeros
// where a slice got none, on a strided input, the GPT's q, k, v layout among them.
TEST(Unbind, GradientsMatchSelectsIncludingUnusedSlices) {
  Generator gen(62);
  Tensor base = randn({2, 4, 3, 2, 5}, gen);  // (B,T,3,H,D)
  Tensor w = randn({2, 2, 4, 5}, gen);        // (B,H,T,D)
  for (int used = 1; used <= 3; ++used) {
    Tensor a = base.detach().requires_grad_(), b = base.detach().requires_grad_();
    auto parts = unbind(a, 2);
    Tensor la = zeros({}), lb = zeros({});
    for (int64_t i = 0; i < used; ++i) {
      la = add(la, sum(mul(parts[i].transpose(1, 2), mul(w, double(i + 1)))));
      lb = add(lb, sum(mul(b.select(2, i).transpose(1, 2), mul(w, double(i + 1)))));
    }
    la.backward();
    lb.backward();
    EXPECT_EQ(values(a.grad()), values(b.grad())) << used << " slices used";
  }
  Tensor x = randn({5, 3}, gen, kFloat64).t().detach().requires_grad_();  // (3, 5) strided
  expect_gradcheck(
      [](const std::vector<Tensor>& in) {
        auto p = unbind(in[0], 1);
        return add(mul(p[0], 3.0), mul(p[4], p[2]));
      },
      {x});
}

TEST(Unbind, Errors) {
  expect_error([] { unbind(zeros({}), 0); }, {"unbind: cannot unbind a zero-dimensional tensor"});
  expect_error([] { unbind(zeros({4, 5}), 2); }, {"unbind: dimension 2 is out of range"});
}

// ---- index_select ----

TEST(IndexSelect, MatchesNaiveReference) {
  Generator gen(37);
  const std::vector<Dims> shapes = {{7}, {5, 1023}, {3, 4, 5}, {1, 1, 1}, {2, 7, 3}};
  for (const Dims& shape : shapes) {
    for (int64_t dim = -1; dim < shape.size(); ++dim) {
      const int64_t d = dim < 0 ? dim + shape.size() : dim;
      for (DType it : {kInt64, kInt32}) {
        for (DType dt : {kFloat32, kInt64}) {
          Tensor t = dt == kFloat32 ? randn(shape, gen, dt) : randint(-9, 9, shape, gen, dt);
          Tensor in = shape.size() > 1 ? non_contiguous(t) : t;
          // Repeats and any order; 7 picks from the dim.
          Tensor index = randint(0, shape[d], {7}, gen, it);
          const auto tv = values(t);
          const auto iv = ints(index);
          for (const Tensor& src : {t, in}) {
            Tensor out = index_select(src, dim, index);
            Dims want = shape;
            want[d] = 7;
            ASSERT_EQ(out.shape(), want);
            ASSERT_EQ(out.dtype(), dt);
            const auto ov = values(out);
            for (int64_t i = 0; i < out.numel(); ++i) {
              Dims idx = unravel(i, want);
              idx[d] = iv[idx[d]];
              ASSERT_EQ(ov[i], tv[flat(idx, shape)]) << shape << " dim " << dim;
            }
          }
        }
      }
    }
  }
  // A strided index and an empty one.
  Tensor t = arange(0.0, 10.0, 1.0, kFloat32);
  Tensor idx = from_vector<int64_t>({9, 0, 4, 1, 7, 2}, {6}).slice(0, 0, 6, 2);  // 9, 4, 7
  EXPECT_EQ(values(index_select(t, 0, idx)), (std::vector<double>{9, 4, 7}));
  EXPECT_EQ(index_select(t, 0, zeros({0}, kInt64)).shape(), Dims({0}));
}

TEST(IndexSelect, Gradcheck) {
  Generator gen(38);
  Tensor x = randn({4, 3, 5}, gen, kFloat64).permute({1, 0, 2}).detach().requires_grad_();
  Tensor idx = from_vector<int64_t>({3, 0, 3, 3, 1}, {5});  // repeats accumulate
  for (int64_t dim : {0, 1}) {
    expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          return index_select(in[0], dim, dim == 0 ? from_vector<int32_t>({2, 2, 0}, {3}) : idx);
        },
        {x});
  }
  expect_gradcheck([&](const std::vector<Tensor>& in) { return index_select(in[0], 2, idx); }, {x});
  // Repeated index gradient by value.
  Tensor v = zeros({3}, kFloat64).requires_grad_();
  index_select(v, 0, from_vector<int64_t>({2, 2, 0, 2}, {4}))
      .backward(from_vector<double>({1, 2, 3, 4}, {4}));
  EXPECT_EQ(values(v.grad()), (std::vector<double>{3, 0, 7}));
}

TEST(IndexSelect, Errors) {
  expect_error(
      [] {
        index_select(zeros({5, 2}), 0, from_vector<int64_t>({0, 4, 5}, {3}));
      },
      {"index_select: index 5 at position 2 is out of range for dimension 0 of size 5"});
  expect_error(
      [] {
        index_select(zeros({5, 2}), 1, from_vector<int32_t>({-1}, {1}));
      },
      {"index_select: index -1 at position 0 is out of range for dimension 1 of size 2"});
  expect_error(
      [] {
        index_select(zeros({5, 2}), 0, zeros({2, 2}, kInt64));
      },
      {"index_select: index must be 1-D, got shape [2, 2]"});
  expect_error(
      [] {
        index_select(zeros({5, 2}), 0, zeros({2}));
      },
      {"index_select: index must be i64 or i32, got f32"});
  expect_error(
      [] {
        index_select(zeros({5, 2}), 2, zeros({2}, kInt64));
      },
      {"index_select: dimension 2 is out of range"});
}

// ---- gather ----

TEST(Gather, MatchesNaiveReference) {
  Generator gen(39);
  struct Case {
    Dims in, index;
  };
  const std::vector<Case> cases = {
      {{7}, {7}},       {{7}, {1023}},          {{3, 5}, {3, 5}},
      {{3, 5}, {2, 9}}, {{4, 6, 5}, {4, 6, 5}}, {{4, 6, 5}, {2, 1, 3}},
      {{1, 1}, {1, 1}}, {{2, 1023}, {2, 1023}},
  };
  for (const Case& cs : cases) {
    for (int64_t dim = 0; dim < cs.in.size(); ++dim) {
      Dims ishape = cs.index;
      for (int64_t k = 0; k < ishape.size(); ++k)  // only `dim` may exceed the input
        if (k != dim) ishape[k] = std::min(ishape[k], cs.in[k]);
      for (DType it : {kInt64, kInt32}) {
        Tensor t = randn(cs.in, gen, kFloat64);
        Tensor index = randint(0, cs.in[dim], ishape, gen, it);
        const auto tv = values(t);
        const auto iv = ints(index);
        for (bool strided : {false, true}) {
          Tensor src = strided && t.dim() > 1 ? non_contiguous(t) : t;
          Tensor idx = strided && index.dim() > 1 ? non_contiguous(index) : index;
          Tensor out = gather(src, dim, idx);
          ASSERT_EQ(out.shape(), ishape);
          const auto ov = values(out);
          for (int64_t i = 0; i < out.numel(); ++i) {
            Dims pos = unravel(i, ishape);
            pos[dim] = iv[i];
            ASSERT_EQ(ov[i], tv[flat(pos, cs.in)]) << cs.in << " dim " << dim;
          }
        }
      }
    }
  }
  // Non-float dtypes gather too.
  Tensor ti = from_vector<int32_t>({10, 11, 12, 20, 21, 22}, {2, 3});
  EXPECT_EQ(values(gather(ti, 1, from_vector<int64_t>({2, 0, 1, 1}, {2, 2}))),
            (std::vector<double>{12, 10, 21, 21}));
}

TEST(Gather, Gradcheck) {
  Generator gen(40);
  Tensor x =
      randn({5, 3, 4}, gen, kFloat64).permute({1, 2, 0}).detach().requires_grad_();  // (3,4,5)
  for (int64_t dim : {0, 1, 2}) {
    Dims ishape = {3, 4, 5};
    ishape[dim] = 6;  // more picks than entries: repeats are certain
    Tensor idx = randint(0, x.shape()[dim], ishape, gen);
    expect_gradcheck([&](const std::vector<Tensor>& in) { return gather(in[0], dim, idx); }, {x});
  }
  Tensor small = randint(0, 3, {2, 2, 2}, gen, kInt32);
  expect_gradcheck([&](const std::vector<Tensor>& in) { return gather(in[0], 0, small); }, {x});
  Tensor v = zeros({2, 3}, kFloat64).requires_grad_();
  gather(v, 1, from_vector<int64_t>({1, 1, 2, 0}, {2, 2}))
      .backward(from_vector<double>({1, 2, 3, 4}, {2, 2}));
  EXPECT_EQ(values(v.grad()), (std::vector<double>{0, 3, 0, 4, 0, 3}));
}

TEST(Gather, Errors) {
  expect_error(
      [] {
        gather(zeros({2, 3}), 1, from_vector<int64_t>({0, 3, 1, 1}, {2, 2}));
      },
      {"gather: index 3 at position 1 is out of range for dimension 1 of size 3"});
  expect_error(
      [] {
        gather(zeros({2, 3}), 1, zeros({2}, kInt64));
      },
      {"gather: index [2] must have as many dimensions as the input [2, 3]"});
  expect_error(
      [] {
        gather(zeros({2, 3}), 1, zeros({3, 1}, kInt64));
      },
      {"gather: index [3, 1] is larger than the input [2, 3] in dimension 0"});
  expect_error(
      [] {
        gather(zeros({2, 3}), 0, zeros({2, 3}));
      },
      {"gather: index must be i64 or i32, got f32"});
}

// ---- sizes large enough for the kernels' thread-parallel paths ----

namespace {
// Runs the enclosing test with 4 kernel threads (even on fewer cores) and restores the count.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : prev_(get_num_threads()) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(prev_); }

 private:
  int prev_;
};
}  // namespace

TEST(IndexOps, ParallelPathsMatchReference) {
  ThreadCount threads(4);
  Generator gen(41);
  // index_select along the last dim (many short rows) and dim 0 (one outer slice, long rows).
  Tensor t = randn({64, 1023}, gen, kFloat64).requires_grad_();
  Tensor idx = randint(0, 1023, {700}, gen);
  Tensor y = index_select(t, 1, idx);
  const auto tv = values(t), yv = values(y);
  const auto iv = ints(idx);
  for (int64_t r = 0; r < 64; ++r)
    for (int64_t i = 0; i < 700; ++i) ASSERT_EQ(yv[r * 700 + i], tv[r * 1023 + iv[i]]);
  Tensor gy = randn(y.shape(), gen, kFloat64);
  y.backward(gy);
  std::vector<double> want(tv.size(), 0.0);
  const auto gv = values(gy);
  for (int64_t r = 0; r < 64; ++r)
    for (int64_t i = 0; i < 700; ++i) want[r * 1023 + iv[i]] += gv[r * 700 + i];
  const auto got = values(t.grad());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-12) << i;

  Tensor u = randn({7, 8192}, gen, kFloat64).requires_grad_();
  Tensor rows = from_vector<int64_t>({6, 0, 6, 3, 6, 1, 2}, {7});
  Tensor z = index_select(u, 0, rows);
  z.backward(ones_like(z));
  EXPECT_EQ(z.at({4, 8000}), u.at({6, 8000}));
  EXPECT_EQ(u.grad().at({6, 8191}), 3.0);
  EXPECT_EQ(u.grad().at({4, 5}), 0.0);

  // gather over 64 lines of 1023 and its scatter-add.
  Tensor gi = randint(0, 1023, {64, 1023}, gen);
  Tensor gt = randn({64, 1023}, gen, kFloat64).requires_grad_();
  Tensor go = gather(gt, 1, gi);
  go.backward(ones_like(go));
  const auto giv = ints(gi);
  const auto gtv = values(gt), gov = values(go);
  std::vector<double> counts(gtv.size(), 0.0);
  for (int64_t r = 0; r < 64; ++r)
    for (int64_t j = 0; j < 1023; ++j) {
      ASSERT_EQ(gov[r * 1023 + j], gtv[r * 1023 + giv[r * 1023 + j]]);
      counts[r * 1023 + giv[r * 1023 + j]] += 1;
    }
  EXPECT_EQ(values(gt.grad()), counts);

  // cat of pieces bigger than the elementwise grain.
  Tensor a = randn({300, 129}, gen), b = randn({300, 1023}, gen);
  Dims s;
  EXPECT_EQ(values(cat({a, b}, 1)),
            naive_cat({values(a), values(b)}, {a.shape(), b.shape()}, 1, s));
}
