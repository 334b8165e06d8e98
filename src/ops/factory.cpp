// Creation that runs a kernel: full, ones, arange and the random tensors (rand, randn, randint).
#include <cmath>

#include "lockstep/tensor/tensor.h"
#include "ops/kernels.h"

namespace lockstep {

using detail::Kernels;

namespace {
// `opts` without requires_grad: the fill must not be refused as an in-place write to a tensor
// that needs grad; the flag is set on the filled tensor.
TensorOptions without_grad(TensorOptions opts) {
  opts.requires_grad = false;
  return opts;
}

Tensor& finish(Tensor& t, const TensorOptions& opts) {
  if (opts.requires_grad) t.requires_grad_(true);
  return t;
}
}  // namespace

Tensor full(const Dims& shape, double value, TensorOptions opts) {
  Tensor t = empty(shape, without_grad(opts));
  detail::kernel(&Kernels::fill, opts.device, "full")(t, value);
  return finish(t, opts);
}

Tensor ones(const Dims& shape, TensorOptions opts) { return full(shape, 1.0, opts); }

Tensor scalar_tensor(double value, TensorOptions opts) { return full(Dims{}, value, opts); }

Tensor ones_like(const Tensor& t) {
  return ones(t.shape(), TensorOptions(t.dtype()).with_device(t.device()));
}

Tensor arange(double start, double end, double step, TensorOptions opts) {
  LS_CHECK(step != 0, "arange: step must be nonzero");
  LS_CHECK(std::isfinite(start) && std::isfinite(end), "arange: bounds must be finite");
  const double n_real = std::ceil((end - start) / step);
  const int64_t n = n_real > 0 ? static_cast<int64_t>(n_real) : 0;
  Tensor t = empty({n}, without_grad(opts));
  detail::kernel(&Kernels::arange, opts.device, "arange")(t, start, step);
  return finish(t, opts);
}

Tensor arange(int64_t end, TensorOptions opts) {
  return arange(0.0, static_cast<double>(end), 1.0, opts);
}

// Note [Random tensors]
// A 32-bit draw (f32/f16/bf16 rand, randn's halves) gives element i lane i % 4 of Philox block
// start + i / 4; a 64-bit draw (f64 rand, randint) gives element i its own two lanes, 2 (i % 2)
// and 2 (i % 2) + 1, of block start + i / 2, so neighbours share no bits. Either way the values
// depend only on the generator state, never on how the fill was split across threads (or
// devices: every device's kernel draws the same values).

Tensor rand(const Dims& shape, Generator& gen, TensorOptions opts, double low, double high) {
  LS_CHECK(is_floating(opts.dtype), "rand: dtype must be floating, got ", dtype_name(opts.dtype));
  LS_CHECK(low < high, "rand: expected low < high, got [", low, ", ", high, ")");
  Tensor t = empty(shape, without_grad(opts));
  const auto kernel = detail::kernel(&Kernels::rand_uniform, opts.device, "rand");
  const bool wide = opts.dtype == kFloat64;
  const uint64_t seed = gen.seed(), start = gen.reserve(wide ? 2 * t.numel() : t.numel());
  kernel(t, seed, start, low, high);
  return finish(t, opts);
}

Tensor randn(const Dims& shape, Generator& gen, TensorOptions opts, double mean, double std) {
  LS_CHECK(is_floating(opts.dtype), "randn: dtype must be floating, got ", dtype_name(opts.dtype));
  Tensor t = empty(shape, without_grad(opts));
  const auto kernel = detail::kernel(&Kernels::rand_normal, opts.device, "randn");
  const uint64_t seed = gen.seed(), start = gen.reserve(t.numel());
  kernel(t, seed, start, mean, std);
  return finish(t, opts);
}

Tensor randint(int64_t low, int64_t high, const Dims& shape, Generator& gen, TensorOptions opts) {
  LS_CHECK(low < high, "randint: expected low < high, got [", low, ", ", high, ")");
  Tensor t = empty(shape, opts);
  const auto kernel = detail::kernel(&Kernels::randint, opts.device, "randint");
  const uint64_t seed = gen.seed(), start = gen.reserve(2 * t.numel());
  kernel(t, seed, start, low, high);
  return t;
}

}  // namespace lockstep
