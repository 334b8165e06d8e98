// Reduction of one chunk over every rank's slot, in rank order, for the shm backend.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "lockstep/base/error.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/half.h"

namespace lockstep::dist::shm {

// Note [Fixed sum order]
// Each element is reduced by exactly one rank, as src[0] op src[1] op ... op src[n-1] (rank
// order), and every rank copies that one result; so the value is the same on every rank and from
// run to run, whatever the timing. Halves accumulate in f32 and round once at the end (one
// rounding, not n-1); integers add and multiply as unsigned (wrapping, never undefined).

namespace detail {

struct Sum {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
struct Product {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
    } else {
      return a * b;
    }
  }
};
struct Min {
  template <typename T>
  static T apply(T a, T b) {
    return std::min(a, b);
  }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    return std::max(a, b);
  }
};

// How a stored element becomes the accumulator's type and back.
template <typename T>
struct Native {
  using Stored = T;
  using Acc = T;
  static Acc load(T v) { return v; }
  static T store(Acc v) { return v; }
};
struct BF16 {
  using Stored = uint16_t;
  using Acc = float;
  static Acc load(uint16_t v) { return bf16_bits_to_float(v); }
  static uint16_t store(Acc v) { return float_to_bf16_bits(v); }
};
struct F16 {
  using Stored = uint16_t;
  using Acc = float;
  static Acc load(uint16_t v) { return f16_bits_to_float(v); }
  static uint16_t store(Acc v) { return float_to_f16_bits(v); }
};

// Elements per block: the accumulators stay in L1 and the inner loops vectorize.
inline constexpr size_t kBlock = 512;

template <typename Conv, typename Op>
void reduce_blocks(void* out, const void* const* srcs, int nsrc, size_t count, int divisor) {
  using S = typename Conv::Stored;
  using A = typename Conv::Acc;
  auto* o = static_cast<S*>(out);
  if (nsrc == 2) {
    // Two sources (every all_reduce of two ranks): one fused pass. Staging through `acc` made the
    // compiler copy each block in from the first source and out again (rep movsq), two thirds
    // of this function's time in a profile. Element i is read before it is written, so `out`
    // may still be one of the sources; the operations and their order are those below.
    const S* s0 = static_cast<const S*>(srcs[0]);
    const S* s1 = static_cast<const S*>(srcs[1]);
    if constexpr (std::is_floating_point_v<A>) {
      if (divisor > 0) {
        const A d = static_cast<A>(divisor);
        for (size_t i = 0; i < count; ++i) {
          o[i] = Conv::store(Op::apply(Conv::load(s0[i]), Conv::load(s1[i])) / d);
        }
        return;
      }
    }
    for (size_t i = 0; i < count; ++i) {
      o[i] = Conv::store(Op::apply(Conv::load(s0[i]), Conv::load(s1[i])));
    }
    return;
  }
  A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const S* s0 = static_cast<const S*>(srcs[0]) + base;
    for (size_t i = 0; i < n; ++i) acc[i] = Conv::load(s0[i]);
    for (int r = 1; r < nsrc; ++r) {
      const S* s = static_cast<const S*>(srcs[r]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] = Op::apply(acc[i], Conv::load(s[i]));
    }
    if constexpr (std::is_floating_point_v<A>) {
      if (divisor > 0) {
        const A d = static_cast<A>(divisor);
        for (size_t i = 0; i < n; ++i) acc[i] /= d;
      }
    }
    // Stored only now: `out` may be one of the sources (the reducing rank's own slot).
    for (size_t i = 0; i < n; ++i) o[base + i] = Conv::store(acc[i]);
  }
}

template <typename Op>
void reduce_dtype(DType t, void* out, const void* const* srcs, int nsrc, size_t count,
                  int divisor) {
  switch (t) {
    case DType::f32:
      return reduce_blocks<Native<float>, Op>(out, srcs, nsrc, count, divisor);
    case DType::f64:
      return reduce_blocks<Native<double>, Op>(out, srcs, nsrc, count, divisor);
    case DType::i32:
      return reduce_blocks<Native<int32_t>, Op>(out, srcs, nsrc, count, 0);
    case DType::i64:
      return reduce_blocks<Native<int64_t>, Op>(out, srcs, nsrc, count, 0);
    case DType::bf16:
      return reduce_blocks<BF16, Op>(out, srcs, nsrc, count, divisor);
    case DType::f16:
      return reduce_blocks<F16, Op>(out, srcs, nsrc, count, divisor);
    default:
      LS_THROW("shm: no reduction kernel for ", dtype_name(t), " tensors");
  }
}

}  // namespace detail

// out[i] = srcs[0][i] op ... op srcs[nsrc-1][i] for `count` elements of dtype t (Note [Fixed sum
// order]); avg is the sum divided by nsrc. `out` may be one of the sources.
inline void reduce(DType t, ReduceOp op, void* out, const void* const* srcs, int nsrc,
                   size_t count) {
  switch (op) {
    case ReduceOp::sum:
      return detail::reduce_dtype<detail::Sum>(t, out, srcs, nsrc, count, 0);
    case ReduceOp::avg:
      return detail::reduce_dtype<detail::Sum>(t, out, srcs, nsrc, count, nsrc);
    case ReduceOp::product:
      return detail::reduce_dtype<detail::Product>(t, out, srcs, nsrc, count, 0);
    case ReduceOp::min:
      return detail::reduce_dtype<detail::Min>(t, out, srcs, nsrc, count, 0);
    case ReduceOp::max:
      return detail::reduce_dtype<detail::Max>(t, out, srcs, nsrc, count, 0);
  }
  LS_THROW("shm: unknown reduce op ", static_cast<int>(op));
}

}  // namespace lockstep::dist::shm
