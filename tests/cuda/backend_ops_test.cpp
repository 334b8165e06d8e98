// Every op of the public API on the CPU and on CUDA, on the same random inputs, compared with a
// tolerance per dtype; gradients compared the same way; and gradchecks run on CUDA in f64. This
// is ggml's test-backend-ops for lockstep's two devices: the CPU kernels (src/ops/cpu/) are the
// reference, so a CUDA kernel is right when it agrees with them.
//
// Note [Backend op comparison]
// Each case builds its inputs once on the CPU (contiguous, random), copies them to the GPU, and
// applies the same view on both devices (a transpose, a strided slice), so both kernels see the
// same values in the same layout, non-contiguous ones included. Floating inputs are leaves that
// require grad; the first output is back-propagated from the same random gradient on both
// devices and every input's gradient is compared too. A case whose CPU op throws (a dtype the op
// does not take) must throw on CUDA as well. A case that throws on CUDA only (a missing kernel)
// fails with the error's message, and the next case runs. TF32 is off (the default), so f32
// products round as on the CPU.
#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "gpu.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_matches_cpu;
using lockstep::testing::gpu;
using lockstep::testing::Tol;
using lockstep::testing::tol_for;
using lockstep::testing::tol_sum;

namespace {

using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

Generator& rng() {
  static Generator gen(20261203);
  return gen;
}

// Uniform in [lo, hi), drawn in f64 and rounded to `dt` on the CPU (integers: [lo, hi)).
Tensor uniform(const Dims& shape, DType dt, double lo = -2, double hi = 2) {
  if (!is_floating(dt) && dt != DType::b8)
    return randint(static_cast<int64_t>(lo), static_cast<int64_t>(hi), shape, rng(), dt);
  if (dt == DType::b8) return lt(rand(shape, rng(), kFloat64), 0.5);
  return rand(shape, rng(), kFloat64, lo, hi).to(dt);
}

enum class Layout { contiguous, transposed, strided };

// An input: a contiguous CPU tensor and the view each device takes of its own copy.
struct Input {
  Tensor base;
  std::function<Tensor(const Tensor&)> view;
  bool grad = true;  // a floating input whose gradient is compared

  // A fresh leaf on `d` (requiring grad when asked) and the view of it the op receives.
  Tensor on(Device d, bool requires_grad, Tensor* leaf) const {
    Tensor b = d.is_cpu() ? base.clone() : base.to(d);
    if (requires_grad) b.requires_grad_();
    *leaf = b;
    return view ? view(b) : b;
  }
};

// Random values of `shape` seen through `layout`: transposed swaps the first and last dims of
// the stored tensor, strided takes every other element of a last dim twice as long.
Input in(const Dims& shape, DType dt = kFloat32, Layout layout = Layout::contiguous,
         double lo = -2, double hi = 2) {
  const int64_t last = shape.size() - 1;
  if (layout == Layout::transposed && shape.size() >= 2) {
    Dims stored = shape;
    std::swap(stored[0], stored[last]);
    return {uniform(stored, dt, lo, hi), [last](const Tensor& t) { return t.transpose(0, last); }};
  }
  if (layout != Layout::contiguous && shape.size() >= 1) {
    Dims stored = shape;
    const int64_t n = shape[last];
    stored[last] = 2 * n;
    return {uniform(stored, dt, lo, hi),
            [last, n](const Tensor& t) { return t.slice(last, 0, 2 * n, 2); }};
  }
  return {uniform(shape, dt, lo, hi), nullptr};
}

// A fixed tensor (indices, targets, running statistics): compared, never differentiated.
Input fixed(const Tensor& t) { return {t, nullptr, false}; }

std::string layout_name(Layout l) {
  switch (l) {
    case Layout::contiguous: return "contiguous";
    case Layout::transposed: return "transposed";
    case Layout::strided: return "strided";
  }
  return "?";
}

const char* dt_name(DType dt) { return dtype_name(dt).data(); }

// Runs `fn` on both devices and compares outputs and gradients (Note [Backend op comparison]).
void check(const std::string& name, const Fn& fn, const std::vector<Input>& inputs, Tol tol,
           bool grads = true) {
  SCOPED_TRACE(name);
  std::vector<Tensor> cpu_in, gpu_in, cpu_leaf(inputs.size()), gpu_leaf(inputs.size());
  std::vector<Tensor> cpu_out;
  std::vector<bool> diff(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    diff[i] = grads && inputs[i].grad && is_floating(inputs[i].base.dtype());
  try {
    for (size_t i = 0; i < inputs.size(); ++i)
      cpu_in.push_back(inputs[i].on(kCPU, diff[i], &cpu_leaf[i]));
    cpu_out = fn(cpu_in);
  } catch (const Error& e) {
    // Not an op the CPU takes: CUDA must refuse it too. Said in the log, so that a case the CPU
    // refuses by mistake (a wrong shape in the test) shows.
    std::cerr << "[ refused  ] " << name << ": the CPU says: " << e.what() << "\n";
    bool threw = false;
    try {
      for (size_t i = 0; i < inputs.size(); ++i)
        gpu_in.push_back(inputs[i].on(gpu(), diff[i], &gpu_leaf[i]));
      (void)fn(gpu_in);
    } catch (const Error&) {
      threw = true;
    }
    EXPECT_TRUE(threw) << name << ": the CPU refuses it (" << e.what() << ") but CUDA does not";
    return;
  }
  try {
    for (size_t i = 0; i < inputs.size(); ++i)
      gpu_in.push_back(inputs[i].on(gpu(), diff[i], &gpu_leaf[i]));
    std::vector<Tensor> gpu_out = fn(gpu_in);
    ASSERT_EQ(gpu_out.size(), cpu_out.size());
    for (size_t k = 0; k < cpu_out.size(); ++k)
      expect_matches_cpu(cpu_out[k], gpu_out[k], tol, name + ", output " + std::to_string(k));
    // In-place ops change their inputs: compare those as well.
    for (size_t i = 0; i < inputs.size(); ++i)
      if (!diff[i])
        expect_matches_cpu(cpu_in[i], gpu_in[i], tol, name + ", input " + std::to_string(i));
    if (!grads || cpu_out.empty() || !cpu_out[0].requires_grad()) return;
    const Tensor g = uniform(cpu_out[0].shape(), cpu_out[0].dtype(), -1, 1);
    try {
      cpu_out[0].backward(g);
    } catch (const Error& e) {
      // No backward on the CPU for this dtype: none on CUDA either.
      std::cerr << "[ refused  ] " << name << " backward: the CPU says: " << e.what() << "\n";
      bool threw = false;
      try {
        gpu_out[0].backward(g.to(gpu()));
      } catch (const Error&) {
        threw = true;
      }
      EXPECT_TRUE(threw) << name << ": the CPU's backward refuses it (" << e.what()
                         << ") but CUDA's does not";
      return;
    }
    gpu_out[0].backward(g.to(gpu()));
    // A gradient sums over the output: the loose tolerance of the input's dtype.
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!diff[i]) continue;
      const Tensor cg = cpu_leaf[i].grad(), gg = gpu_leaf[i].grad();
      ASSERT_EQ(cg.defined(), gg.defined()) << name << ": gradient of input " << i;
      if (!cg.defined()) continue;
      Tol gt = tol_sum(inputs[i].base.dtype());
      gt.rtol = std::max(gt.rtol, tol.rtol);
      gt.atol = std::max(gt.atol, tol.atol);
      expect_matches_cpu(cg, gg, gt, name + ", gradient of input " + std::to_string(i));
    }
  } catch (const Error& e) {
    ADD_FAILURE() << name << ": CUDA threw: " << e.what();
  }
}

// Gradients on CUDA in f64 against central differences, every evaluation on the GPU: the
// analytic gradient of sum(fn(x) * w) for a random w, and (f(x + eps) - f(x - eps)) / 2eps with
// one element moved at a time (a fill of a one-element view, so nothing leaves the device but
// the objective). autograd::gradcheck reads and writes elements through at()/set_at(), which
// are CPU-only, so this is its device twin.
// The first mismatch ("" when none), naming the input, the element and both values.
std::string gradcheck_on_gpu_message(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                                     const std::vector<Tensor>& cpu_inputs, double atol,
                                     double rtol, double eps, int64_t* checked) {
  try {
    std::vector<Tensor> xs;
    std::vector<size_t> diff;
    for (size_t i = 0; i < cpu_inputs.size(); ++i) {
      Tensor x = cpu_inputs[i].to(gpu()).contiguous();
      if (x.dtype() == kFloat64) {
        x = x.detach().requires_grad_();
        diff.push_back(i);
      }
      xs.push_back(x);
    }
    const Tensor out = fn(xs);
    if (!(out.device() == gpu())) return "result on " + out.device().str();
    const Tensor w = uniform(out.shape(), kFloat64, -1, 1).to(gpu());
    auto objective = [&]() { return sum(mul(fn(xs), w)).to(kCPU).item(); };
    std::vector<Tensor> wrt;
    for (size_t i : diff) wrt.push_back(xs[i]);
    const std::vector<Tensor> analytic = autograd::grad({sum(mul(out, w))}, wrt);
    autograd::NoGradGuard no_grad;
    for (size_t k = 0; k < diff.size(); ++k) {
      const Tensor& x = xs[diff[k]];
      const std::vector<double> orig = x.to(kCPU).to_vector<double>();
      const std::vector<double> a = analytic[k].defined()
                                        ? analytic[k].to(kCPU).contiguous().to_vector<double>()
                                        : std::vector<double>(orig.size(), 0.0);
      const Tensor flat = x.detach().view({-1});
      for (int64_t j = 0; j < x.numel(); ++j) {
        Tensor e = flat.narrow(0, j, 1);
        e.fill_(orig[j] + eps);
        const double fp = objective();
        e.fill_(orig[j] - eps);
        const double fm = objective();
        e.fill_(orig[j]);
        const double numeric = (fp - fm) / (2 * eps);
        ++*checked;
        if (!(std::abs(a[j] - numeric) <= atol + rtol * std::abs(numeric)))
          return "input " + std::to_string(diff[k]) + " (shape " + x.shape().str() +
                 ") element " + std::to_string(j) + ": analytic " + std::to_string(a[j]) +
                 " vs numeric " + std::to_string(numeric);
      }
    }
  } catch (const Error& e) {
    return std::string("threw: ") + e.what();
  }
  return "";
}

void gradcheck_on_gpu(const std::string& name,
                      const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                      const std::vector<Tensor>& cpu_inputs, double atol = 1e-5,
                      double rtol = 1e-3, double eps = 1e-6) {
  int64_t checked = 0;
  EXPECT_EQ(gradcheck_on_gpu_message(fn, cpu_inputs, atol, rtol, eps, &checked), "")
      << "gradcheck on " << gpu().str() << ": " << name;
  EXPECT_GT(checked, 0) << name << ": no element checked";
}

Tensor f64(const Dims& shape, double lo = -1, double hi = 1) {
  return uniform(shape, kFloat64, lo, hi);
}

class BackendOps : public ::testing::Test {
 protected:
  void SetUp() override {
    LS_REQUIRE_GPU();
    cuda::set_allow_tf32(false);
  }
};

const std::vector<DType> kFloats = {kFloat32, kFloat64, DType::bf16, DType::f16};
const std::vector<Layout> kLayouts = {Layout::contiguous, Layout::transposed, Layout::strided};

// ---- elementwise ----

TEST_F(BackendOps, ElementwiseBinary) {
  struct Op {
    const char* name;
    std::function<Tensor(const Tensor&, const Tensor&)> f;
    bool ints;      // defined for integer dtypes too
    bool positive;  // its first operand must be positive
  };
  const std::vector<Op> ops = {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }, true, false},
      {"add_alpha", [](const Tensor& a, const Tensor& b) { return add(a, b, 0.5); }, true, false},
      {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b, 2.0); }, true, false},
      {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }, true, false},
      {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }, false, false},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }, false, true},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }, true, false},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }, true, false},
  };
  const std::vector<DType> dts = {kFloat32, kFloat64, DType::bf16, DType::f16, DType::i32,
                                  kInt64};
  for (const Op& op : ops) {
    for (DType dt : dts) {
      const bool integer = !is_floating(dt);
      if (integer && !op.ints) continue;
      const double lo = op.positive ? 0.5 : (integer ? -50 : -2);
      const double hi = op.positive ? 2 : (integer ? 50 : 2);
      // div's denominator stays away from 0.
      const double blo = std::string(op.name) == "div" ? 0.5 : lo;
      const Fn fn = [&op](const std::vector<Tensor>& x) { return std::vector{op.f(x[0], x[1])}; };
      const std::string base = std::string(op.name) + " " + dt_name(dt);
      for (Layout l : kLayouts)
        check(base + " " + layout_name(l), fn,
              {in({7, 33}, dt, l, lo, hi), in({7, 33}, dt, Layout::transposed, blo, hi)},
              tol_for(dt));
      check(base + " broadcast", fn, {in({4, 1, 33}, dt, Layout::contiguous, lo, hi),
                                      in({5, 33}, dt, Layout::strided, blo, hi)},
            tol_for(dt));
      check(base + " large", fn, {in({1 << 18}, dt, Layout::contiguous, lo, hi),
                                  in({1 << 18}, dt, Layout::contiguous, blo, hi)},
            tol_for(dt));
      check(base + " 0-dim", fn, {in({}, dt, Layout::contiguous, lo, hi), in({3}, dt, Layout::contiguous, blo, hi)},
            tol_for(dt));
    }
  }
}

TEST_F(BackendOps, ElementwiseScalar) {
  struct Op {
    const char* name;
    std::function<Tensor(const Tensor&)> f;
    bool positive;
  };
  const std::vector<Op> ops = {
      {"add_scalar", [](const Tensor& a) { return add(a, 2.5); }, false},
      {"sub_scalar", [](const Tensor& a) { return sub(a, 0.75); }, false},
      {"mul_scalar", [](const Tensor& a) { return mul(a, -3.0); }, false},
      {"div_scalar", [](const Tensor& a) { return div(a, 7.0); }, false},
      {"rsub_scalar", [](const Tensor& a) { return rsub(a, 1.0); }, false},
      {"square", [](const Tensor& a) { return pow(a, 2.0); }, false},
      {"pow_scalar", [](const Tensor& a) { return pow(a, 1.7); }, true},
      {"pow_neg", [](const Tensor& a) { return pow(a, -0.5); }, true},
  };
  for (const Op& op : ops)
    for (DType dt : kFloats)
      for (Layout l : kLayouts)
        check(std::string(op.name) + " " + dt_name(dt) + " " + layout_name(l),
              [&op](const std::vector<Tensor>& x) { return std::vector{op.f(x[0])}; },
              {in({9, 31}, dt, l, op.positive ? 0.25 : -3, 3)}, tol_for(dt));
  for (DType dt : {DType::i32, kInt64}) {
    check(std::string("add_scalar ") + dt_name(dt),
          [](const std::vector<Tensor>& x) { return std::vector{add(x[0], 3.0)}; },
          {in({9, 31}, dt, Layout::transposed, -100, 100)}, tol_for(dt));
    check(std::string("mul_scalar ") + dt_name(dt),
          [](const std::vector<Tensor>& x) { return std::vector{mul(x[0], 2.0)}; },
          {in({9, 31}, dt, Layout::strided, -100, 100)}, tol_for(dt));
  }
}

TEST_F(BackendOps, ElementwiseUnary) {
  struct Op {
    const char* name;
    std::function<Tensor(const Tensor&)> f;
    bool ints;
    double lo, hi;
  };
  const std::vector<Op> ops = {
      {"neg", [](const Tensor& a) { return neg(a); }, true, -3, 3},
      {"abs", [](const Tensor& a) { return abs(a); }, true, -3, 3},
      {"sign", [](const Tensor& a) { return sign(a); }, true, -3, 3},
      {"relu", [](const Tensor& a) { return relu(a); }, true, -3, 3},
      {"clamp", [](const Tensor& a) { return clamp(a, -1.5, 0.75); }, true, -3, 3},
      {"clamp_min", [](const Tensor& a) { return clamp_min(a, 0.25); }, true, -3, 3},
      {"exp", [](const Tensor& a) { return exp(a); }, false, -5, 5},
      {"log", [](const Tensor& a) { return log(a); }, false, 0.01, 10},
      {"sqrt", [](const Tensor& a) { return sqrt(a); }, false, 0.01, 10},
      {"rsqrt", [](const Tensor& a) { return rsqrt(a); }, false, 0.05, 10},
      {"tanh", [](const Tensor& a) { return tanh(a); }, false, -4, 4},
      {"sigmoid", [](const Tensor& a) { return sigmoid(a); }, false, -8, 8},
      {"gelu", [](const Tensor& a) { return gelu(a); }, false, -5, 5},
      {"gelu_tanh", [](const Tensor& a) { return gelu(a, GeluApprox::tanh); }, false, -5, 5},
  };
  for (const Op& op : ops) {
    const Fn fn = [&op](const std::vector<Tensor>& x) { return std::vector{op.f(x[0])}; };
    for (DType dt : kFloats)
      for (Layout l : kLayouts)
        check(std::string(op.name) + " " + dt_name(dt) + " " + layout_name(l), fn,
              {in({5, 7, 11}, dt, l, op.lo, op.hi)}, tol_for(dt));
    check(std::string(op.name) + " f32 large", fn, {in({3, 100003}, kFloat32,
                                                       Layout::contiguous, op.lo, op.hi)},
          tol_for(kFloat32));
    if (op.ints)
      for (DType dt : {DType::i32, kInt64})
        check(std::string(op.name) + " " + dt_name(dt), fn,
              {in({5, 7, 11}, dt, Layout::transposed, -4, 4)}, tol_for(dt));
  }
}

TEST_F(BackendOps, CompareWhereMaskedFill) {
  // Small integers stored as floats, so that ties (eq, le, ge) happen.
  auto ties = [](DType dt, Layout l) {
    Input x = in({6, 13}, kInt64, l, -3, 3);
    x.base = x.base.to(dt);
    return x;
  };
  using C2 = std::function<Tensor(const Tensor&, const Tensor&)>;
  using C1 = std::function<Tensor(const Tensor&, double)>;
  const std::vector<std::pair<const char*, C2>> binary = {
      {"eq", [](const Tensor& a, const Tensor& b) { return eq(a, b); }},
      {"ne", [](const Tensor& a, const Tensor& b) { return ne(a, b); }},
      {"lt", [](const Tensor& a, const Tensor& b) { return lt(a, b); }},
      {"le", [](const Tensor& a, const Tensor& b) { return le(a, b); }},
      {"gt", [](const Tensor& a, const Tensor& b) { return gt(a, b); }},
      {"ge", [](const Tensor& a, const Tensor& b) { return ge(a, b); }}};
  const std::vector<std::pair<const char*, C1>> scalar = {
      {"eq", [](const Tensor& a, double b) { return eq(a, b); }},
      {"ne", [](const Tensor& a, double b) { return ne(a, b); }},
      {"lt", [](const Tensor& a, double b) { return lt(a, b); }},
      {"le", [](const Tensor& a, double b) { return le(a, b); }},
      {"gt", [](const Tensor& a, double b) { return gt(a, b); }},
      {"ge", [](const Tensor& a, double b) { return ge(a, b); }}};
  for (DType dt : {kFloat32, kFloat64, DType::bf16, DType::i32, kInt64}) {
    for (const auto& [name, f] : binary) {
      check(std::string(name) + " " + dt_name(dt),
            [&f](const std::vector<Tensor>& x) { return std::vector{f(x[0], x[1])}; },
            {ties(dt, Layout::transposed), ties(dt, Layout::strided)}, tol_for(DType::b8));
      check(std::string(name) + " " + dt_name(dt) + " broadcast",
            [&f](const std::vector<Tensor>& x) {
              return std::vector{f(x[0], x[1].slice(0, 0, 1))};
            },
            {ties(dt, Layout::contiguous), ties(dt, Layout::contiguous)}, tol_for(DType::b8));
    }
    for (const auto& [name, f] : scalar)
      check(std::string(name) + "_scalar " + dt_name(dt),
            [&f](const std::vector<Tensor>& x) { return std::vector{f(x[0], 1.0)}; },
            {ties(dt, Layout::strided)}, tol_for(DType::b8));
  }
  // NaN and the infinities.
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Tensor special = from_vector<float>({1, nan, -inf, inf, 0, -2, nan, 3}, {2, 4});
  const Fn specials = [](const std::vector<Tensor>& x) {
    return std::vector{isnan(x[0]), isfinite(x[0]), logical_not(isnan(x[0])), eq(x[0], x[0]),
                       ne(x[0], x[0]), lt(x[0], 1.0)};
  };
  check("isnan isfinite logical_not", specials, {fixed(special)}, tol_for(DType::b8));
  check("isnan isfinite transposed", specials, {fixed(special.t().contiguous().t())},
        tol_for(DType::b8));
  check("maximum minimum NaN",
        [](const std::vector<Tensor>& x) {
          return std::vector{maximum(x[0], x[1]), minimum(x[0], x[1])};
        },
        {fixed(special), fixed(zeros({2, 4}))}, tol_for(kFloat32));
  for (DType dt : {kFloat32, kFloat64, DType::bf16, kInt64}) {
    check(std::string("where ") + dt_name(dt),
          [](const std::vector<Tensor>& x) { return std::vector{where(x[0], x[1], x[2])}; },
          {fixed(uniform({4, 1, 9}, DType::b8)), in({5, 9}, dt, Layout::transposed),
           in({4, 5, 9}, dt, Layout::strided)},
          tol_for(dt));
    check(std::string("masked_fill ") + dt_name(dt),
          [](const std::vector<Tensor>& x) { return std::vector{masked_fill(x[0], x[1], -7.0)}; },
          {in({6, 10}, dt, Layout::transposed), fixed(uniform({6, 10}, DType::b8))}, tol_for(dt));
  }
}

TEST_F(BackendOps, InPlace) {
  for (DType dt : {kFloat32, kFloat64, DType::bf16, DType::f16, kInt64}) {
    const std::string n = dt_name(dt);
    check("add_ " + n,
          [](const std::vector<Tensor>& x) {
            Tensor s = x[0];
            s.add_(x[1], 2.0);
            return std::vector{s};
          },
          {in({8, 12}, dt, Layout::transposed, -9, 9), in({12}, dt, Layout::strided, -9, 9)},
          tol_for(dt), /*grads=*/false);
    check("mul_ " + n,
          [](const std::vector<Tensor>& x) {
            Tensor s = x[0];
            s.mul_(x[1]);
            return std::vector{s};
          },
          {in({8, 12}, dt, Layout::strided, -9, 9), in({8, 12}, dt, Layout::transposed, -9, 9)},
          tol_for(dt), false);
    check("add_ scalar, mul_ scalar, fill_, zero_ " + n,
          [](const std::vector<Tensor>& x) {
            Tensor a = x[0], b = x[1], c = x[2];
            a.add_(3.0);
            a.mul_(2.0);
            b.fill_(-1.25);
            c.zero_();
            return std::vector{a, b, c};
          },
          {in({8, 12}, dt, Layout::transposed, -9, 9), in({5, 3}, dt, Layout::strided),
           in({7}, dt, Layout::strided)},
          tol_for(dt), false);
  }
}

// ---- reductions ----

TEST_F(BackendOps, Reductions) {
  const std::vector<std::pair<std::string, Fn>> float_ops = {
      {"sum", [](const auto& x) { return std::vector{sum(x[0])}; }},
      {"sum dim 1", [](const auto& x) { return std::vector{sum(x[0], {1})}; }},
      {"sum dims 0,2 keepdim", [](const auto& x) { return std::vector{sum(x[0], {0, 2}, true)}; }},
      {"mean", [](const auto& x) { return std::vector{mean(x[0])}; }},
      {"mean dim -1", [](const auto& x) { return std::vector{mean(x[0], {-1})}; }},
      {"var", [](const auto& x) { return std::vector{var(x[0])}; }},
      {"var dim 1 correction 0", [](const auto& x) { return std::vector{var(x[0], {1}, 0)}; }},
      {"var dims 0,2 keepdim",
       [](const auto& x) { return std::vector{var(x[0], {0, 2}, 1, true)}; }},
  };
  const std::vector<std::pair<std::string, Fn>> any_ops = {
      {"max", [](const auto& x) { return std::vector{lockstep::max(x[0])}; }},
      {"min", [](const auto& x) { return std::vector{lockstep::min(x[0])}; }},
      {"max dim 1",
       [](const auto& x) {
         auto [v, i] = lockstep::max(x[0], 1);
         return std::vector{v, i};
       }},
      {"min dim 2 keepdim",
       [](const auto& x) {
         auto [v, i] = lockstep::min(x[0], 2, true);
         return std::vector{v, i};
       }},
      {"argmax dim 0", [](const auto& x) { return std::vector{argmax(x[0], 0)}; }},
      {"argmin dim -1", [](const auto& x) { return std::vector{argmin(x[0], -1)}; }},
      {"argmax flat", [](const auto& x) { return std::vector{argmax(x[0])}; }},
      {"sum int", [](const auto& x) { return std::vector{sum(x[0], {1})}; }},
  };
  for (DType dt : {kFloat32, kFloat64, DType::bf16, DType::f16}) {
    for (const auto& [name, fn] : float_ops) {
      for (Layout l : kLayouts)
        check(name + " " + dt_name(dt) + " " + layout_name(l), fn, {in({6, 37, 5}, dt, l)},
              tol_sum(dt));
    }
  }
  for (const auto& [name, fn] : float_ops) {
    // Long rows and many outputs: the block and grid reductions.
    check(name + " f32 long rows", fn, {in({3, 70001, 2}, kFloat32)}, tol_sum(kFloat32));
    check(name + " f64 many rows", fn, {in({4096, 3, 33}, kFloat64, Layout::transposed)},
          tol_sum(kFloat64));
  }
  for (DType dt : {kFloat32, kFloat64, DType::bf16, DType::i32, kInt64})
    for (const auto& [name, fn] : any_ops)
      for (Layout l : kLayouts) {
        // Integers in a small range, so max and min meet ties (the first index wins).
        Input x = is_floating(dt) ? in({6, 37, 5}, dt, l) : in({6, 37, 5}, dt, l, -5, 5);
        check(name + " " + dt_name(dt) + " " + layout_name(l), fn, {x}, tol_for(dt));
      }
  for (const auto& [name, fn] : any_ops)
    check(name + " f32 large", fn, {in({5, 50021, 3}, kFloat32)}, tol_for(kFloat32));
  // NaN wins max and min, and its index is reported.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor with_nan = uniform({4, 9, 3}, kFloat32);
  with_nan.set_at({1, 4, 2}, nan);
  with_nan.set_at({3, 0, 0}, nan);
  for (const auto& [name, fn] : any_ops) check(name + " NaN", fn, {fixed(with_nan)}, {0, 0});
}

// ---- indexing, embedding ----

TEST_F(BackendOps, IndexSelectGatherEmbedding) {
  for (DType idt : {kInt64, DType::i32}) {
    const std::string in_name = dt_name(idt);
    const Tensor rows = randint(0, 11, {17}, rng(), idt);  // repeats: index_add accumulates
    check("index_select dim 0 index " + in_name,
          [](const auto& x) { return std::vector{index_select(x[0], 0, x[1])}; },
          {in({11, 6, 3}, kFloat32, Layout::transposed), fixed(rows)}, tol_for(kFloat32));
    check("index_select dim 1 index " + in_name,
          [](const auto& x) { return std::vector{index_select(x[0], 1, x[1])}; },
          {in({4, 11, 5}, kFloat64, Layout::strided), fixed(rows)}, tol_for(kFloat64));
    check("index_select i64 values index " + in_name,
          [](const auto& x) { return std::vector{index_select(x[0], 0, x[1])}; },
          {in({11, 4}, kInt64, Layout::contiguous, -100, 100), fixed(rows)}, tol_for(kInt64));
    check("embedding index " + in_name,
          [](const auto& x) { return std::vector{embedding(x[0], x[1])}; },
          {in({11, 16}), fixed(randint(0, 11, {4, 6}, rng(), idt))}, tol_sum(kFloat32));
    check("embedding bf16 index " + in_name,
          [](const auto& x) { return std::vector{embedding(x[0], x[1])}; },
          {in({11, 16}, DType::bf16), fixed(randint(0, 11, {30}, rng(), idt))},
          tol_sum(DType::bf16));
  }
  for (int64_t dim : {0, 1, 2}) {
    Dims src_shape{5, 6, 7}, idx_shape{5, 6, 7};
    idx_shape[dim] = 9;  // gathers more than the source holds along dim: repeats
    for (int64_t d = 0; d < 3; ++d)
      if (d != dim) idx_shape[d] -= 1;  // smaller than the source elsewhere, as torch allows
    const Tensor idx = randint(0, src_shape[dim], idx_shape, rng(), kInt64);
    for (DType dt : {kFloat32, kFloat64})
      check("gather dim " + std::to_string(dim) + " " + dt_name(dt),
            [dim](const auto& x) { return std::vector{gather(x[0], dim, x[1])}; },
            {in(src_shape, dt, Layout::transposed), fixed(idx)}, tol_sum(dt));
  }
  check("cat stack split",
        [](const auto& x) {
          std::vector<Tensor> parts = split(x[2], std::vector<int64_t>{1, 3, 2}, 1);
          return std::vector{cat({x[0], x[1]}, 0), stack({x[0], x[1]}, 2), parts[1] * 2.0,
                             cat({x[0], x[1]}, 1)};
        },
        {in({4, 6}, kFloat32, Layout::transposed), in({4, 6}, kFloat32, Layout::strided),
         in({3, 6, 2}, kFloat32, Layout::transposed)},
        tol_for(kFloat32));
}

// ---- softmax, dropout ----

TEST_F(BackendOps, SoftmaxLogSoftmax) {
  for (DType dt : {kFloat32, kFloat64, DType::bf16})
    for (int64_t dim : {-1, 0, 1})
      for (const Dims& shape : {Dims{8, 50, 3}, Dims{3, 1500, 2}, Dims{2, 3, 5000}})
        for (Layout l : {Layout::contiguous, Layout::transposed}) {
          const std::string name = std::string(dt_name(dt)) + " dim " + std::to_string(dim) +
                                   " shape " + shape.str() + " " + layout_name(l);
          check("softmax " + name,
                [dim](const auto& x) { return std::vector{softmax(x[0], dim)}; },
                {in(shape, dt, l, -8, 8)}, tol_sum(dt));
          check("log_softmax " + name,
                [dim](const auto& x) { return std::vector{log_softmax(x[0], dim)}; },
                {in(shape, dt, l, -8, 8)}, tol_sum(dt));
        }
}

TEST_F(BackendOps, DropoutSameMaskAsCpu) {
  for (DType dt : {kFloat32, kFloat64, DType::bf16, DType::f16})
    for (double p : {0.1, 0.5, 0.9})
      for (const Dims& shape : {Dims{64, 100}, Dims{7, 3}, Dims{1001}})
        check("dropout p " + std::to_string(p) + " " + dt_name(dt) + " " + shape.str(),
              [p](const auto& x) {
                Generator gen(777);  // the same seed on both devices: the same mask
                Tensor first = dropout(x[0], p, true, gen);
                Tensor second = dropout(x[0], p, true, gen);  // the offset advanced alike
                return std::vector{first, second, ne(first, 0.0),
                                   scalar_tensor(static_cast<double>(gen.offset()),
                                                 TensorOptions(kFloat64).with_device(x[0].device()))};
              },
              {in(shape, dt, Layout::transposed, 0.5, 2)}, tol_for(dt));
}

// ---- linalg ----

TEST_F(BackendOps, MatmulLinear) {
  struct Case {
    std::string name;
    Dims a, b;
    Layout la, lb;
  };
  const std::vector<Case> cases = {
      {"2-D", {64, 128}, {128, 96}, Layout::contiguous, Layout::contiguous},
      {"2-D a transposed", {37, 65}, {65, 23}, Layout::transposed, Layout::contiguous},
      {"2-D b transposed", {37, 65}, {65, 23}, Layout::contiguous, Layout::transposed},
      {"2-D both transposed", {37, 65}, {65, 23}, Layout::transposed, Layout::transposed},
      {"2-D strided", {19, 21}, {21, 17}, Layout::strided, Layout::strided},
      {"batched", {3, 17, 33}, {3, 33, 19}, Layout::contiguous, Layout::contiguous},
      {"batched transposed", {3, 17, 33}, {3, 33, 19}, Layout::transposed, Layout::transposed},
      {"batch broadcast", {2, 3, 17, 33}, {33, 19}, Layout::contiguous, Layout::transposed},
      {"batch broadcast b", {17, 33}, {4, 33, 19}, Layout::contiguous, Layout::contiguous},
      {"vector @ matrix", {33}, {33, 19}, Layout::contiguous, Layout::transposed},
      {"matrix @ vector", {17, 33}, {33}, Layout::transposed, Layout::strided},
      {"dot", {65}, {65}, Layout::strided, Layout::contiguous},
      {"k 1024", {31, 1024}, {1024, 47}, Layout::contiguous, Layout::contiguous},
  };
  for (DType dt : {kFloat32, kFloat64, DType::bf16, DType::f16})
    for (const Case& c : cases)
      check("matmul " + std::string(dt_name(dt)) + " " + c.name,
            [](const auto& x) { return std::vector{matmul(x[0], x[1])}; },
            {in(c.a, dt, c.la, -1, 1), in(c.b, dt, c.lb, -1, 1)}, tol_sum(dt));
  for (DType dt : {kFloat32, DType::bf16, DType::f16}) {
    const std::string n = dt_name(dt);
    check("linear with bias " + n,
          [](const auto& x) { return std::vector{linear(x[0], x[1], x[2])}; },
          {in({64, 784}, dt, Layout::contiguous, -1, 1), in({96, 784}, dt, Layout::contiguous, -0.1, 0.1),
           in({96}, dt)},
          tol_sum(dt));
    check("linear no bias 3-D input " + n,
          [](const auto& x) { return std::vector{linear(x[0], x[1])}; },
          {in({4, 5, 32}, dt, Layout::transposed, -1, 1), in({10, 32}, dt, Layout::contiguous, -1, 1)},
          tol_sum(dt));
    check("linear transposed weight " + n,
          [](const auto& x) { return std::vector{linear(x[0], x[1], x[2])}; },
          {in({8, 32}, dt, Layout::strided, -1, 1), in({10, 32}, dt, Layout::transposed, -1, 1),
           in({10}, dt, Layout::strided)},
          tol_sum(dt));
  }
}

// ---- convolution, pooling ----

TEST_F(BackendOps, Conv2d) {
  struct Case {
    std::string name;
    Dims x, w;
    Conv2dOptions opts;
    bool bias;
  };
  const std::vector<Case> cases = {
      {"3x3", {2, 3, 9, 9}, {4, 3, 3, 3}, {}, true},
      {"no bias", {2, 3, 9, 9}, {4, 3, 3, 3}, {}, false},
      {"stride 2 pad 1", {2, 3, 10, 11}, {5, 3, 3, 3}, Conv2dOptions::square(2, 1), true},
      {"dilation 2", {1, 2, 12, 12}, {3, 2, 3, 3}, Conv2dOptions::square(1, 2, 2), true},
      {"groups 2", {2, 4, 8, 8}, {6, 2, 3, 3}, Conv2dOptions::square(1, 1, 1, 2), true},
      {"depthwise", {2, 4, 7, 7}, {4, 1, 3, 3}, Conv2dOptions::square(1, 1, 1, 4), false},
      {"1x1", {3, 8, 5, 5}, {16, 8, 1, 1}, {}, true},
      {"rect kernel, stride (2,1), pad (0,2)", {2, 3, 9, 8}, {4, 3, 2, 5}, {2, 1, 0, 2, 1, 1, 1},
       true},
      {"fashion-mnist conv1", {8, 1, 28, 28}, {32, 1, 3, 3}, {}, true},
      {"fashion-mnist conv2", {4, 32, 13, 13}, {64, 32, 3, 3}, {}, true},
  };
  for (DType dt : {kFloat32, kFloat64, DType::bf16})
    for (const Case& c : cases) {
      std::vector<Input> ins = {in(c.x, dt, Layout::contiguous, -1, 1),
                                in(c.w, dt, Layout::contiguous, -0.5, 0.5)};
      if (c.bias) ins.push_back(in({c.w[0]}, dt));
      const Conv2dOptions opts = c.opts;
      check("conv2d " + std::string(dt_name(dt)) + " " + c.name,
            [opts](const auto& x) {
              return std::vector{conv2d(x[0], x[1], x.size() > 2 ? x[2] : Tensor(), opts)};
            },
            ins, tol_sum(dt));
    }
  check("conv2d f32 non-contiguous input",
        [](const auto& x) { return std::vector{conv2d(x[0], x[1], x[2])}; },
        {in({2, 3, 9, 9}, kFloat32, Layout::transposed), in({4, 3, 3, 3}, kFloat32, Layout::strided),
         in({4})},
        tol_sum(kFloat32));
}

TEST_F(BackendOps, Pooling) {
  const std::vector<std::pair<std::string, Pool2dOptions>> cases = {
      {"2x2", {}},
      {"3x3 stride 2 pad 1", Pool2dOptions::square(3, 2, 1)},
      {"3x2 stride 1", {3, 2, 1, 1, 0, 0}},
      {"2x2 stride 1 pad (1,0)", {2, 2, 1, 1, 1, 0}},
  };
  for (DType dt : {kFloat32, kFloat64})
    for (const auto& [name, opts] : cases)
      for (const Dims& shape : {Dims{2, 3, 9, 10}, Dims{3, 8, 8}, Dims{8, 32, 26, 26}}) {
        const std::string n = std::string(dt_name(dt)) + " " + name + " " + shape.str();
        const Pool2dOptions o = opts;
        check("max_pool2d " + n, [o](const auto& x) { return std::vector{max_pool2d(x[0], o)}; },
              {in(shape, dt, Layout::transposed)}, tol_for(dt));
        check("avg_pool2d " + n, [o](const auto& x) { return std::vector{avg_pool2d(x[0], o)}; },
              {in(shape, dt, Layout::strided)}, tol_sum(dt));
      }
}

// ---- losses ----

TEST_F(BackendOps, CrossEntropy) {
  struct Case {
    std::string name;
    Dims logits, targets;
    int64_t classes;
  };
  const std::vector<Case> cases = {
      {"(64, 10)", {64, 10}, {64}, 10},
      {"(5, 1000)", {5, 1000}, {5}, 1000},
      {"(4, 5, 3, 2)", {4, 5, 3, 2}, {4, 3, 2}, 5},
  };
  for (DType dt : {kFloat32, kFloat64, DType::bf16})
    for (const Case& c : cases)
      for (Reduction r : {Reduction::mean, Reduction::sum, Reduction::none})
        for (double smoothing : {0.0, 0.1})
          for (bool ignore : {false, true}) {
            Tensor targets = randint(0, c.classes, c.targets, rng(), kInt64);
            CrossEntropyOptions opts;
            opts.reduction = r;
            opts.label_smoothing = smoothing;
            if (ignore) {  // every third row ignored, through a custom ignore_index
              opts.ignore_index = 3;
              Tensor flat = targets.view({-1});
              for (int64_t i = 0; i < flat.numel(); i += 3) flat.set_at({i}, 3);
            }
            const std::string rn = r == Reduction::mean ? "mean" : r == Reduction::sum ? "sum"
                                                                                       : "none";
            check("cross_entropy " + std::string(dt_name(dt)) + " " + c.name + " " + rn +
                      " smoothing " + std::to_string(smoothing) + (ignore ? " ignore_index" : ""),
                  [opts](const auto& x) { return std::vector{cross_entropy(x[0], x[1], opts)}; },
                  {in(c.logits, dt, Layout::transposed, -4, 4), fixed(targets)}, tol_sum(dt));
          }
  // Every row ignored: the mean is NaN (0 / 0) on both.
  CrossEntropyOptions all_ignored;
  all_ignored.ignore_index = 1;
  check("cross_entropy all ignored",
        [all_ignored](const auto& x) { return std::vector{cross_entropy(x[0], x[1], all_ignored)}; },
        {in({4, 3}), fixed(ones({4}, kInt64))}, tol_sum(kFloat32));
}

TEST_F(BackendOps, MseLoss) {
  for (DType dt : {kFloat32, kFloat64, DType::bf16})
    for (Reduction r : {Reduction::mean, Reduction::sum, Reduction::none})
      for (const Dims& shape : {Dims{64, 10}, Dims{3, 100001}})
        check("mse_loss " + std::string(dt_name(dt)) + " " + shape.str() + " reduction " +
                  std::to_string(static_cast<int>(r)),
              [r](const auto& x) { return std::vector{mse_loss(x[0], x[1], r)}; },
              {in(shape, dt, Layout::transposed), in(shape, dt, Layout::contiguous)},
              tol_sum(dt));
}

// ---- norms ----

TEST_F(BackendOps, LayerNorm) {
  for (DType dt : {kFloat32, kFloat64, DType::bf16}) {
    const std::string n = dt_name(dt);
    check("layer_norm (8, 64) affine " + n,
          [](const auto& x) { return std::vector{layer_norm(x[0], {64}, x[1], x[2])}; },
          {in({8, 64}, dt, Layout::transposed), in({64}, dt), in({64}, dt)}, tol_sum(dt));
    check("layer_norm (2, 3, 16) over (3, 16) " + n,
          [](const auto& x) { return std::vector{layer_norm(x[0], {3, 16}, x[1], x[2], 1e-3)}; },
          {in({2, 3, 16}, dt, Layout::strided), in({3, 16}, dt), in({3, 16}, dt)}, tol_sum(dt));
    check("layer_norm no affine long rows " + n,
          [](const auto& x) { return std::vector{layer_norm(x[0], {4099})}; },
          {in({6, 4099}, dt)}, tol_sum(dt));
    check("layer_norm many rows " + n,
          [](const auto& x) { return std::vector{layer_norm(x[0], {32}, x[1])}; },
          {in({5000, 32}, dt, Layout::contiguous, 3, 5), in({32}, dt)}, tol_sum(dt));
  }
}

// The fused attention (src/ops/cuda/attention.cu) against the CPU's: full and causal, head dims
// that fill the kernel's register rows (64) and that do not (16, 80, 200), fewer queries than
// keys, and the GPT's q, k, v: sibling views of one (B, T, 3, H, D) projection (Note [Strided
// attention inputs]), whose gradients land in one buffer. bf16 inputs compute in f32.
TEST_F(BackendOps, Attention) {
  struct Case {
    int64_t b, h, tq, tk, d, dv;
    bool causal;
  };
  const std::vector<Case> cases = {{2, 3, 70, 70, 64, 64, true},  {1, 2, 33, 150, 16, 16, false},
                                   {2, 1, 129, 129, 80, 80, true}, {1, 2, 40, 40, 24, 200, false},
                                   {1, 1, 1, 1, 64, 64, true}};
  for (DType dt : {kFloat32, kFloat64, DType::bf16})
    for (const Case& c : cases) {
      const std::string name = std::string(dt_name(dt)) + " (" + std::to_string(c.b) + ", " +
                               std::to_string(c.h) + ", " + std::to_string(c.tq) + "/" +
                               std::to_string(c.tk) + ", " + std::to_string(c.d) + "/" +
                               std::to_string(c.dv) + ")" + (c.causal ? " causal" : "");
      check("attention " + name,
            [c](const auto& x) {
              return std::vector{scaled_dot_product_attention(x[0], x[1], x[2],
                                                              {.is_causal = c.causal})};
            },
            {in({c.b, c.h, c.tq, c.d}, dt), in({c.b, c.h, c.tk, c.d}, dt, Layout::strided),
             in({c.b, c.h, c.tk, c.dv}, dt, Layout::transposed)},
            tol_sum(dt));
    }
  for (DType dt : {kFloat32, DType::bf16}) {
    // GPT-2's layout at a small T: one (B, T, 3C) projection viewed as q, k, v (B, H, T, D).
    const int64_t B = 2, T = 96, H = 4, D = 64;
    check(std::string("attention of a GPT's qkv views ") + dt_name(dt),
          [](const auto& x) {
            std::vector<Tensor> qkv = unbind(x[0].view({B, T, 3, H, D}), 2);
            return std::vector{scaled_dot_product_attention(
                qkv[0].transpose(1, 2), qkv[1].transpose(1, 2), qkv[2].transpose(1, 2),
                {.is_causal = true})};
          },
          {in({B, T, 3 * H * D}, dt)}, tol_sum(dt));
  }
}

TEST_F(BackendOps, BatchNorm) {
  for (DType dt : {kFloat32, kFloat64})
    for (const Dims& shape : {Dims{8, 6, 5, 5}, Dims{16, 6}, Dims{4, 6, 33}}) {
      const std::string n = std::string(dt_name(dt)) + " " + shape.str();
      // Training: the batch's statistics, and the running ones updated in place (compared as
      // inputs after the call).
      check("batch_norm train " + n,
            [](const auto& x) {
              return std::vector{batch_norm(x[0], x[1], x[2], x[3], x[4], true, 0.1, 1e-5)};
            },
            {in(shape, dt, Layout::contiguous, 1, 3), fixed(uniform({6}, dt, -1, 1)),
             fixed(uniform({6}, dt, 0.5, 2)), in({6}, dt), in({6}, dt)},
            tol_sum(dt));
      check("batch_norm train no affine no running " + n,
            [](const auto& x) {
              return std::vector{batch_norm(x[0], Tensor(), Tensor(), Tensor(), Tensor(), true)};
            },
            {in(shape, dt, Layout::contiguous, -2, 2)}, tol_sum(dt));
      check("batch_norm eval " + n,
            [](const auto& x) {
              return std::vector{batch_norm(x[0], x[1], x[2], x[3], x[4], false, 0.1, 1e-3)};
            },
            {in(shape, dt), fixed(uniform({6}, dt, -1, 1)), fixed(uniform({6}, dt, 0.5, 2)),
             in({6}, dt), in({6}, dt)},
            tol_sum(dt));
    }
}

// ---- copies, conversions, factories ----

TEST_F(BackendOps, CopiesBetweenDevicesAndDtypes) {
  const std::vector<DType> all = {kFloat32, kFloat64, DType::bf16, DType::f16,
                                  DType::i32, kInt64,  DType::u8,   DType::b8};
  for (DType from : all)
    for (DType to : all)
      for (Layout l : kLayouts) {
        // Values every dtype holds (0 .. 100), some fractional for the floating ones.
        Input x = in({6, 35}, kFloat64, l, 0, 100);
        x.base = x.base.to(from);
        x.grad = false;
        check(std::string("to ") + dt_name(from) + " -> " + dt_name(to) + " " + layout_name(l),
              [to](const auto& v) { return std::vector{v[0].to(to), v[0].contiguous()}; }, {x},
              tol_for(to), false);
      }
  // Device to host of a strided device view, host to device into a strided destination with a
  // broadcast source, clone, and a round trip that keeps gradients flowing.
  check("strided copies",
        [](const auto& v) {
          Tensor dst = zeros({5, 8}, TensorOptions(kFloat32).with_device(v[0].device()));
          Tensor view = dst.slice(1, 0, 8, 2);
          view.copy_(v[1]);  // (4) broadcast over (5, 4)
          return std::vector{dst, v[0].clone(), v[0].to(kCPU).to(v[0].device()) * 2.0};
        },
        {in({7, 9}, kFloat32, Layout::transposed), in({4}, kFloat64, Layout::strided)},
        tol_for(kFloat32), false);
  // The gradient of to(device) returns to the source's device.
  Tensor x = uniform({3, 4}, kFloat32).requires_grad_();
  Tensor y = sum(x.to(gpu()) * 3.0).to(kCPU);
  y.backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(x.grad().device().is_cpu());
  lockstep::testing::expect_near_all(x.grad(), std::vector<double>(12, 3.0), 0, "to() backward");
}

TEST_F(BackendOps, FactoriesMatchCpu) {
  for (DType dt : {kFloat32, kFloat64, kInt64, DType::i32, DType::bf16}) {
    const std::string n = dt_name(dt);
    auto on_both = [&](const std::string& name, const std::function<Tensor(Device)>& make) {
      SCOPED_TRACE(name);
      try {
        expect_matches_cpu(make(kCPU), make(gpu()), tol_for(dt), name);
      } catch (const Error& e) {
        ADD_FAILURE() << name << ": " << e.what();
      }
    };
    on_both("arange " + n, [dt](Device d) {
      return arange(-3, 40, is_floating(dt) ? 0.75 : 2, TensorOptions(dt).with_device(d));
    });
    on_both("zeros ones full " + n, [dt](Device d) {
      const TensorOptions o = TensorOptions(dt).with_device(d);
      return cat({zeros({3, 4}, o), ones({3, 4}, o), full({3, 4}, 5, o)});
    });
    if (is_floating(dt)) {
      // The generator's offset advances by the same blocks on both, so two draws in a row
      // agree as well.
      on_both("rand " + n, [dt](Device d) {
        Generator gen(99);
        const TensorOptions o = TensorOptions(dt).with_device(d);
        return cat({rand({1001}, gen, o, -2, 3), rand({7}, gen, o),
                    full({1}, static_cast<double>(gen.offset()), o)});
      });
      on_both("randn " + n, [dt](Device d) {
        Generator gen(123);
        const TensorOptions o = TensorOptions(dt).with_device(d);
        return cat({randn({1001}, gen, o, 1, 2), randn({7}, gen, o),
                    full({1}, static_cast<double>(gen.offset()), o)});
      });
    } else {
      on_both("randint " + n, [dt](Device d) {
        Generator gen(5);
        const TensorOptions o = TensorOptions(dt).with_device(d);
        return cat({randint(-7, 1000, {1001}, gen, o), randint(0, 3, {9}, gen, o),
                    full({1}, static_cast<double>(gen.offset()), o)});
      });
    }
  }
}

// ---- gradchecks on CUDA (f64) ----

// The device gradcheck catches a wrong gradient (detach() hides half of x * x's).
TEST_F(BackendOps, GradcheckOnCudaCatchesAWrongGradient) {
  int64_t checked = 0;
  const std::string msg = gradcheck_on_gpu_message(
      [](const std::vector<Tensor>& x) { return mul(x[0], x[0].detach()); }, {f64({3}, 0.5, 1)},
      1e-5, 1e-3, 1e-6, &checked);
  EXPECT_THAT(msg, ::testing::HasSubstr("analytic"));
  EXPECT_EQ(checked, 1);
}

TEST_F(BackendOps, GradcheckOnCuda) {
  using V = const std::vector<Tensor>&;
  gradcheck_on_gpu("add mul div broadcast",
                   [](V x) { return div(mul(add(x[0], x[1]), x[1]), add(x[2], 3.0)); },
                   {f64({3, 4}), f64({4}), f64({3, 1})});
  gradcheck_on_gpu("pow maximum minimum", [](V x) {
    return add(pow(x[0], x[1]), minimum(maximum(x[0], x[1]), x[1] * 0.5));
  }, {f64({3, 4}, 0.5, 2), f64({3, 4}, 0.5, 2)});
  gradcheck_on_gpu("unary chain", [](V x) {
    return add(add(tanh(x[0]), sigmoid(x[0])),
               add(add(gelu(x[0]), gelu(x[0], GeluApprox::tanh)),
                   add(exp(x[0] * 0.5), add(log(abs(x[0]) + 1.0), sqrt(x[0] * x[0] + 1.0)))));
  }, {f64({5, 3})});
  gradcheck_on_gpu("relu clamp rsqrt", [](V x) {
    return add(relu(x[0]), add(clamp(x[0], -0.5, 0.5), rsqrt(x[0] * x[0] + 2.0)));
  }, {f64({4, 4})});
  gradcheck_on_gpu("where masked_fill", [](V x) {
    return where(gt(x[0], 0.0), x[0] * 2.0, masked_fill(x[1], lt(x[1], 0.0), 1.0));
  }, {f64({3, 5}), f64({3, 5})});
  gradcheck_on_gpu("sum mean var", [](V x) {
    return add(add(sum(x[0], {1}), mean(x[0], {1})), var(x[0], {1}));
  }, {f64({4, 6})});
  gradcheck_on_gpu("max min dim", [](V x) {
    return add(lockstep::max(x[0], 1).first, sum(lockstep::min(x[0], 0).first));
  }, {f64({4, 6})});
  gradcheck_on_gpu("matmul batched transposed",
                   [](V x) { return matmul(x[0].transpose(1, 2), x[1]); },
                   {f64({2, 5, 3}), f64({2, 5, 4})});
  gradcheck_on_gpu("linear", [](V x) { return linear(x[0], x[1], x[2]); },
                   {f64({3, 5}), f64({4, 5}), f64({4})});
  gradcheck_on_gpu("softmax log_softmax", [](V x) {
    return add(softmax(x[0], 1), log_softmax(x[0], 0));
  }, {f64({3, 5}, -3, 3)});
  gradcheck_on_gpu("index_select gather embedding", [](V x) {
    const Tensor idx = from_vector<int64_t>({2, 0, 2, 1}, {4}).to(x[0].device());
    const Tensor gidx = from_vector<int64_t>({0, 2, 2, 1, 1, 0}, {3, 2}).to(x[0].device());
    return add(sum(index_select(x[0], 0, idx)),
               add(sum(gather(x[0], 0, gidx)), sum(embedding(x[0], gidx))));
  }, {f64({3, 2})});
  gradcheck_on_gpu("conv2d stride pad dilation groups", [](V x) {
    return conv2d(x[0], x[1], x[2], {2, 1, 1, 1, 1, 2, 2});
  }, {f64({1, 4, 6, 7}), f64({2, 2, 3, 3}), f64({2})}, 1e-5, 1e-3);
  gradcheck_on_gpu("scaled_dot_product_attention causal", [](V x) {
    return scaled_dot_product_attention(x[0], x[1], x[2], {.is_causal = true});
  }, {f64({1, 2, 5, 3}), f64({1, 2, 5, 3}), f64({1, 2, 5, 4})});
  gradcheck_on_gpu("scaled_dot_product_attention full", [](V x) {
    return scaled_dot_product_attention(x[0], x[1], x[2]);
  }, {f64({2, 3, 3}), f64({2, 4, 3}), f64({2, 4, 2})});
  gradcheck_on_gpu("max_pool2d avg_pool2d", [](V x) {
    return add(sum(max_pool2d(x[0], Pool2dOptions::square(2, 1))),
               sum(avg_pool2d(x[0], Pool2dOptions::square(3, 2, 1))));
  }, {f64({1, 2, 5, 5})});
  gradcheck_on_gpu("cross_entropy smoothing ignore_index", [](V x) {
    const Tensor t = from_vector<int64_t>({0, 2, -100, 1}, {4}).to(x[0].device());
    CrossEntropyOptions o;
    o.label_smoothing = 0.2;
    return cross_entropy(x[0], t, o);
  }, {f64({4, 3}, -2, 2)});
  gradcheck_on_gpu("cross_entropy none (N, C, d)", [](V x) {
    const Tensor t = from_vector<int64_t>({0, 2, 1, 1, 0, 2}, {2, 3}).to(x[0].device());
    CrossEntropyOptions o;
    o.reduction = Reduction::none;
    return cross_entropy(x[0], t, o);
  }, {f64({2, 3, 3}, -2, 2)});
  gradcheck_on_gpu("mse_loss", [](V x) { return mse_loss(x[0], x[1], Reduction::sum); },
                   {f64({3, 4}), f64({3, 4})});
  gradcheck_on_gpu("layer_norm", [](V x) { return layer_norm(x[0], {5}, x[1], x[2]); },
                   {f64({3, 5}), f64({5}), f64({5})});
  gradcheck_on_gpu("batch_norm train", [](V x) {
    return batch_norm(x[0], Tensor(), Tensor(), x[1], x[2], true);
  }, {f64({4, 3, 2}), f64({3}), f64({3})});
  gradcheck_on_gpu("batch_norm eval", [](V x) {
    const Tensor rm = from_vector<double>({0.1, -0.2, 0.3}, {3}).to(x[0].device());
    const Tensor rv = from_vector<double>({1.5, 0.5, 2.0}, {3}).to(x[0].device());
    return batch_norm(x[0], rm, rv, x[1], x[2], false);
  }, {f64({4, 3, 2}), f64({3}), f64({3})});
  gradcheck_on_gpu("dropout (fixed mask)", [](V x) {
    Generator gen(4);
    return dropout(x[0], 0.3, true, gen);
  }, {f64({6, 5})});
  gradcheck_on_gpu("views cat stack", [](V x) {
    return cat({x[0].t(), sum(stack({x[1], x[1]}, 0), {0}).slice(0, 0, 3)}, 1);
  }, {f64({2, 3}), f64({4, 2})});
}

}  // namespace
