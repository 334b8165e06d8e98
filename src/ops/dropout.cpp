// dropout: a keep-mask drawn from the counter-based Generator, and its backward; the kernels are
// src/ops/cpu/dropout.cpp.
#include <cstdint>

#include "lockstep/autograd/node.h"
#include "lockstep/ops/nn.h"
#include "ops/common.h"
#include "ops/kernels.h"

namespace lockstep {

using autograd::record;
using autograd::TensorList;
using detail::Kernels;

namespace {
// x * mask * scale in x's dtype.
Tensor masked_scale(const Tensor& x, const Tensor& mask, double scale) {
  const auto kernel = detail::kernel(&Kernels::masked_scale, x.device(), "dropout");
  Tensor out = empty(x.shape(), detail::options_on(x, x.dtype()));
  kernel(out, x.contiguous(), mask, scale);
  return out;
}
}  // namespace

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  detail::check_defined(x, "dropout");
  const auto mask_kernel = detail::kernel(&Kernels::dropout_mask, x.device(), "dropout");
  LS_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability p must be in [0, 1], got ", p);
  LS_CHECK(is_floating(x.dtype()), "dropout: expected a floating-point tensor, got ",
           dtype_name(x.dtype()));
  if (!training || p == 0.0) return x;

  // Element i (in row-major order) keeps when the 32 bits in lane i % 4 of Philox block
  // start + i / 4, read as u in [0, 1), satisfy u >= p: the mask depends on the generator state
  // only, never on the thread count (Note [Random tensors] in src/ops/factory.cpp).
  const uint64_t seed = gen.seed(), start = gen.reserve(x.numel());
  Tensor mask = empty(x.shape(), detail::options_on(x, kUInt8));
  mask_kernel(mask, seed, start, p);
  // p == 1 drops everything; its scale would be infinite, and every kept value is zero anyway.
  const double scale = p < 1.0 ? 1.0 / (1.0 - p) : 0.0;
  Tensor out = masked_scale(x.detach(), mask, scale);
  record("DropoutBackward", {x}, out, [mask, scale](const TensorList& g) {
    return TensorList{masked_scale(g[0], mask, scale)};
  });
  return out;
}

}  // namespace lockstep
