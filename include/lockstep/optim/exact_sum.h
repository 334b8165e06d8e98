// ExactSum: a sum of doubles kept exactly (a long fixed-point accumulator), so that the result
// does not depend on the order of the terms nor on how they were split between ranks.
#pragma once

#include <array>
#include <cstdint>

namespace lockstep::optim {

// Note [Exact norm] (src/optim/exact_sum.cpp): every finite double is an integer times a power
// of two between 2^-1074 and 2^971; the accumulator holds the exact sum as a fixed-point integer
// over that whole range, in 32-bit limbs kept in int64 so that many terms add before carries must
// move. value() rounds it once. The gradient norm sums squares this way (a float's square is
// exact in a double; a double's is split exactly in two by an fma), so DDP, ZeRO and FSDP, at any
// world size, clip by the same norm, bitwise.
class ExactSum {
 public:
  static constexpr int kLimbs = 68;  // 2098 bits of range plus room for carries
  using Limbs = std::array<int64_t, kLimbs>;

  // Adds a finite double (an infinity or NaN makes value() return it).
  void add(double v);
  // Adds v * v exactly.
  void add_square(double v);
  // Adds another accumulator (ranks' partial sums: their limbs add as integers).
  void add(const ExactSum& other);
  // The sum, rounded to a double: the same for the same multiset of terms.
  double value() const;

  // The limbs, carried so each is in [0, 2^32) but the top one: what an all-reduce (sum, i64)
  // of several ranks' accumulators adds, then from_limbs() takes back.
  Limbs limbs() const;
  static ExactSum from_limbs(const Limbs& limbs);

 private:
  void carry();
  Limbs limbs_{};
  int64_t pending_ = 0;  // terms added since the last carry
  double special_ = 0;   // inf or NaN seen (0: none)
};

}  // namespace lockstep::optim
