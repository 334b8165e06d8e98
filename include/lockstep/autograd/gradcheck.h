// gradcheck: compares autograd gradients with central finite differences in f64.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "lockstep/tensor/tensor.h"

namespace lockstep::autograd {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
};

struct GradcheckResult {
  bool ok = true;
  std::string message;  // the first mismatch: input, element, analytic vs numeric
};

// `fn` maps the inputs (f64 tensors; those with requires_grad are checked) to one output.
// The analytic gradient of sum(output * w) for a fixed random w is compared element by element
// with (f(x + eps) - f(x - eps)) / 2eps.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, GradcheckOptions opts = {});

}  // namespace lockstep::autograd
