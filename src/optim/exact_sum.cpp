// ExactSum: Note [Exact norm].
#include "lockstep/optim/exact_sum.h"

#include <bit>
#include <cmath>

namespace lockstep::optim {

// Note [Exact norm]
// A finite double is m 2^e with an integer |m| < 2^53 and e >= -1074; bit p = e + 1074 of the
// accumulator is its lowest bit. m shifted by p mod 32 spans at most 85 bits: three 32-bit limbs
// from limb p / 32. Limbs are int64, so 2^30 terms (each < 2^32 per limb) add before carry()
// must bring every limb back into [0, 2^32); negative terms subtract and carry() borrows (an
// arithmetic shift). The exact integer is unique, and value() reads it from its three highest
// limbs the same way whatever the order of the terms: the bitwise-stable gradient norm that
// clipping needs when DDP, ZeRO and FSDP must agree.
namespace {

constexpr int kBias = 1074;
constexpr int64_t kCarryEvery = int64_t{1} << 30;

}  // namespace

void ExactSum::add(double v) {
  if (v == 0) return;
  if (!std::isfinite(v)) {
    special_ = special_ == 0 ? v : special_ + v;  // inf + -inf and anything + NaN give NaN
    return;
  }
  const uint64_t bits = std::bit_cast<uint64_t>(v);
  const bool negative = (bits >> 63) != 0;
  const int biased = static_cast<int>((bits >> 52) & 0x7ff);
  uint64_t m = bits & ((uint64_t{1} << 52) - 1);
  int p = 0;  // bit position of m's lowest bit in the accumulator
  if (biased == 0) {
    p = 0;  // subnormal: m 2^-1074
  } else {
    m |= uint64_t{1} << 52;
    p = biased - 1;  // (m 2^-52) 2^(biased - 1023) = m 2^(biased - 1075) = m 2^(p - 1074)
  }
  const int limb = p / 32, shift = p % 32;
  const unsigned __int128 wide = static_cast<unsigned __int128>(m) << shift;
  const int64_t parts[3] = {static_cast<int64_t>(wide & 0xffffffffu),
                            static_cast<int64_t>((wide >> 32) & 0xffffffffu),
                            static_cast<int64_t>(wide >> 64)};
  for (int k = 0; k < 3; ++k) limbs_[limb + k] += negative ? -parts[k] : parts[k];
  if (++pending_ >= kCarryEvery) carry();
}

void ExactSum::add_square(double v) {
  const double hi = v * v;
  if (!std::isfinite(hi) || hi == 0) {
    add(hi);
    return;
  }
  add(hi);
  add(std::fma(v, v, -hi));  // the rounding error of hi, exactly (0 for a float's square)
}

void ExactSum::add(const ExactSum& other) {
  if (other.special_ != 0) add(other.special_);
  const Limbs theirs = other.limbs();
  carry();
  for (int k = 0; k < kLimbs; ++k) limbs_[k] += theirs[k];
  carry();
}

void ExactSum::carry() {
  int64_t c = 0;
  for (int k = 0; k < kLimbs; ++k) {
    const int64_t x = limbs_[k] + c;
    c = x >> 32;  // arithmetic: a negative limb borrows from the next
    limbs_[k] = k + 1 < kLimbs ? x - (c << 32) : x;
  }
  pending_ = 0;
}

ExactSum::Limbs ExactSum::limbs() const {
  ExactSum copy = *this;
  copy.carry();
  return copy.limbs_;
}

ExactSum ExactSum::from_limbs(const Limbs& limbs) {
  ExactSum s;
  s.limbs_ = limbs;
  s.carry();
  return s;
}

double ExactSum::value() const {
  if (special_ != 0) return special_;
  const Limbs l = limbs();
  int top = kLimbs - 1;
  while (top >= 0 && l[top] == 0) --top;
  if (top < 0) return 0.0;
  // Highest limbs first: each later term is below the rounding of the earlier ones except in
  // the last bits, and the same limbs always give the same double.
  double v = 0;
  for (int k = top; k >= 0 && k >= top - 3; --k)
    v += std::ldexp(static_cast<double>(l[k]), 32 * k - kBias);
  return v;
}

}  // namespace lockstep::optim
