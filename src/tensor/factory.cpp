// Tensor creation: empty/zeros/ones/full/arange, from memory, and random tensors.
#include <cmath>
#include <cstring>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/tensor/tensor.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep {

namespace {

Allocator* allocator_for(Device d) {
  LS_CHECK(d.is_cpu(), "cannot allocate on ", d.str(),
           ": this build of lockstep has no CUDA support (configure on a machine with the CUDA "
           "toolkit to enable it)");
  return &cpu_allocator();
}

// Validates a shape and returns its size in bytes for `dtype`, refusing overflow.
size_t checked_nbytes(const Dims& shape, DType dtype, const char* op) {
  for (int64_t s : shape)
    LS_CHECK(s >= 0, op, ": negative dimension in shape ", shape.str());
  int64_t bytes = 0;
  LS_CHECK(!__builtin_mul_overflow(shape.numel(), dtype_size(dtype), &bytes), op, ": shape ",
           shape.str(), " of ", dtype_name(dtype), " needs more bytes than fit in 64 bits");
  return static_cast<size_t>(bytes);
}

// Fills `t` (contiguous) with f(i) for flat index i, in parallel.
template <typename T, typename F>
void fill_indexed(Tensor& t, const F& f) {
  T* p = static_cast<T*>(t.data_ptr());
  cpu::parallel_for(0, t.numel(), cpu::kElementwiseGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] = f(i);
  });
}

}  // namespace

Tensor empty(const Dims& shape, TensorOptions opts) {
  const size_t nbytes = checked_nbytes(shape, opts.dtype, "empty");
  auto storage = std::make_shared<StorageImpl>(nbytes, allocator_for(opts.device));
  Tensor t(std::make_shared<TensorImpl>(std::move(storage), shape, contiguous_strides(shape), 0,
                                        opts.dtype));
  if (opts.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor empty_strided(const Dims& shape, const Dims& strides, TensorOptions opts) {
  checked_nbytes(shape, opts.dtype, "empty_strided");
  LS_CHECK(shape.size() == strides.size(), "empty_strided: shape ", shape.str(), " and strides ",
           strides.str(), " differ in length");
  for (int64_t st : strides) LS_CHECK(st >= 0, "empty_strided: negative stride in ", strides.str());
  int64_t extent = shape.numel() == 0 ? 0 : 1;
  for (int64_t d = 0; d < shape.size() && extent; ++d) extent += (shape[d] - 1) * strides[d];
  auto storage = std::make_shared<StorageImpl>(static_cast<size_t>(extent * dtype_size(opts.dtype)),
                                               allocator_for(opts.device));
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), shape, strides, 0, opts.dtype));
}

Tensor zeros(const Dims& shape, TensorOptions opts) {
  bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  std::memset(t.data_ptr(), 0, static_cast<size_t>(t.nbytes()));
  if (rg) t.requires_grad_(true);
  return t;
}

Tensor full(const Dims& shape, double value, TensorOptions opts) {
  bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  t.fill_(value);
  if (rg) t.requires_grad_(true);
  return t;
}

Tensor ones(const Dims& shape, TensorOptions opts) { return full(shape, 1.0, opts); }

Tensor scalar_tensor(double value, TensorOptions opts) { return full(Dims{}, value, opts); }

Tensor empty_like(const Tensor& t) { return empty(t.shape(), TensorOptions(t.dtype()).with_device(t.device())); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), TensorOptions(t.dtype()).with_device(t.device())); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), TensorOptions(t.dtype()).with_device(t.device())); }

Tensor arange(double start, double end, double step, TensorOptions opts) {
  LS_CHECK(step != 0, "arange: step must be nonzero");
  LS_CHECK(std::isfinite(start) && std::isfinite(end), "arange: bounds must be finite");
  const double n_real = std::ceil((end - start) / step);
  const int64_t n = n_real > 0 ? static_cast<int64_t>(n_real) : 0;
  bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty({n}, opts);
  cpu::dispatch_all(opts.dtype, "arange", [&]<typename T>() {
    fill_indexed<T>(t, [&](int64_t i) { return cpu::convert<T>(start + static_cast<double>(i) * step); });
  });
  if (rg) t.requires_grad_(true);
  return t;
}

Tensor arange(int64_t end, TensorOptions opts) {
  return arange(0.0, static_cast<double>(end), 1.0, opts);
}

Tensor from_buffer(const void* data, const Dims& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  if (t.nbytes() > 0) std::memcpy(t.data_ptr(), data, static_cast<size_t>(t.nbytes()));
  return t;
}

Tensor borrow(void* data, const Dims& shape, DType dtype, Device device) {
  const size_t nbytes = checked_nbytes(shape, dtype, "borrow");
  LS_CHECK(data != nullptr || shape.numel() == 0, "borrow: null data for shape ", shape.str());
  auto storage = std::make_shared<StorageImpl>(data, nbytes, device);
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), shape, contiguous_strides(shape),
                                             0, dtype));
}

// Note [Random tensors]
// A 32-bit draw (f32/f16/bf16 rand, randn's halves) gives element i lane i % 4 of Philox block
// start + i / 4; a 64-bit draw (f64 rand, randint) gives element i its own two lanes, 2 (i % 2)
// and 2 (i % 2) + 1, of block start + i / 2, so neighbours share no bits. Either way the values
// depend only on the generator state, never on how the fill was split across threads.

Tensor rand(const Dims& shape, Generator& gen, TensorOptions opts, double low, double high) {
  LS_CHECK(is_floating(opts.dtype), "rand: dtype must be floating, got ", dtype_name(opts.dtype));
  LS_CHECK(low < high, "rand: expected low < high, got [", low, ", ", high, ")");
  bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  const bool wide = opts.dtype == kFloat64;
  const uint64_t seed = gen.seed(), start = gen.reserve(wide ? 2 * t.numel() : t.numel());
  const double span = high - low;
  cpu::dispatch_all(opts.dtype, "rand", [&]<typename T>() {
    fill_indexed<T>(t, [&](int64_t i) {
      double u;
      if constexpr (std::is_same_v<T, double>) {
        auto b = Generator::philox(seed, start + static_cast<uint64_t>(i / 2));
        const int lane = 2 * static_cast<int>(i % 2);
        u = Generator::to_unit_double(b[lane], b[lane + 1]);
      } else {
        auto b = Generator::philox(seed, start + static_cast<uint64_t>(i / 4));
        u = Generator::to_unit_float(b[i % 4]);
      }
      double v = low + span * u;
      return cpu::convert<T>(v < high ? v : low);
    });
  });
  if (rg) t.requires_grad_(true);
  return t;
}

Tensor randn(const Dims& shape, Generator& gen, TensorOptions opts, double mean, double std) {
  LS_CHECK(is_floating(opts.dtype), "randn: dtype must be floating, got ", dtype_name(opts.dtype));
  bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  const uint64_t seed = gen.seed(), start = gen.reserve(t.numel());
  cpu::dispatch_all(opts.dtype, "randn", [&]<typename T>() {
    fill_indexed<T>(t, [&](int64_t i) {
      // Box-Muller on the lane pair (0,1) or (2,3) of this element's block.
      auto b = Generator::philox(seed, start + static_cast<uint64_t>(i / 4));
      const int lane = static_cast<int>(i % 4);
      const int pair = lane & ~1;
      double u1 = (static_cast<double>(b[pair]) + 1.0) * 0x1.0p-32;  // (0, 1]
      double u2 = static_cast<double>(b[pair + 1]) * 0x1.0p-32;
      double r = std::sqrt(-2.0 * std::log(u1));
      double z = (lane & 1) ? r * std::sin(2.0 * M_PI * u2) : r * std::cos(2.0 * M_PI * u2);
      return cpu::convert<T>(mean + std * z);
    });
  });
  if (rg) t.requires_grad_(true);
  return t;
}

Tensor randint(int64_t low, int64_t high, const Dims& shape, Generator& gen, TensorOptions opts) {
  LS_CHECK(low < high, "randint: expected low < high, got [", low, ", ", high, ")");
  Tensor t = empty(shape, opts);
  const uint64_t seed = gen.seed(), start = gen.reserve(2 * t.numel());
  const uint64_t span = static_cast<uint64_t>(high - low);
  cpu::dispatch_all(opts.dtype, "randint", [&]<typename T>() {
    fill_indexed<T>(t, [&](int64_t i) {
      auto b = Generator::philox(seed, start + static_cast<uint64_t>(i / 2));
      const int lane = 2 * static_cast<int>(i % 2);
      uint64_t r = static_cast<uint64_t>(b[lane]) << 32 | b[lane + 1];
      return cpu::convert<T>(low + static_cast<int64_t>(r % span));
    });
  });
  return t;
}

}  // namespace lockstep
