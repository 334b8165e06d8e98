// gradcheck: analytic gradients against central finite differences.
#include "lockstep/autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "lockstep/autograd/engine.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/reduce.h"

namespace lockstep::autograd {

namespace {
constexpr uint64_t kGradcheckSeed = 0x5eed;

// Flat row-major index -> multi-index for `shape`.
Dims unravel(int64_t flat, const Dims& shape) {
  Dims idx = Dims::filled(shape.size(), 0);
  for (int64_t d = shape.size() - 1; d >= 0; --d) {
    idx[d] = flat % shape[d];
    flat /= shape[d];
  }
  return idx;
}
}  // namespace

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, GradcheckOptions opts) {
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!inputs[k].defined() || !inputs[k].requires_grad()) continue;
    LS_CHECK(inputs[k].dtype() == kFloat64, "gradcheck: input ", k, " must be f64, got ",
             dtype_name(inputs[k].dtype()));
    LS_CHECK(inputs[k].is_leaf(), "gradcheck: input ", k, " must be a leaf tensor");
  }

  Tensor out = fn(inputs);
  LS_CHECK(out.dtype() == kFloat64, "gradcheck: output must be f64, got ", dtype_name(out.dtype()));
  Generator gen(kGradcheckSeed);
  Tensor w = randn(out.shape(), gen, kFloat64);
  auto objective = [&](const Tensor& o) { return sum(mul(o, w)); };

  std::vector<Tensor> diff;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) diff.push_back(t);
  if (diff.empty()) return {};
  std::vector<Tensor> analytic = grad({objective(out)}, diff);

  GradcheckResult res;
  size_t k = 0;
  for (size_t input_nr = 0; input_nr < inputs.size(); ++input_nr) {
    Tensor x = inputs[input_nr];
    if (!x.defined() || !x.requires_grad()) continue;
    Tensor a = analytic[k++];
    for (int64_t j = 0; j < x.numel(); ++j) {
      Dims idx = unravel(j, x.shape());
      const double orig = x.at(idx);
      double fp, fm;
      {
        NoGradGuard g;
        x.set_at(idx, orig + opts.eps);
        fp = objective(fn(inputs)).item();
        x.set_at(idx, orig - opts.eps);
        fm = objective(fn(inputs)).item();
        x.set_at(idx, orig);
      }
      const double numeric = (fp - fm) / (2 * opts.eps);
      const double analytic_v = a.defined() ? a.at(idx) : 0.0;
      if (!(std::abs(analytic_v - numeric) <= opts.atol + opts.rtol * std::abs(numeric))) {
        std::ostringstream os;
        os << "gradcheck: input " << input_nr << " (shape " << x.shape().str() << ") element "
           << idx.str() << ": analytic " << analytic_v << " vs numeric " << numeric;
        res.ok = false;
        res.message = os.str();
        return res;
      }
    }
  }
  return res;
}

}  // namespace lockstep::autograd
