// bf16 / f16 conversions, checked exhaustively over all 65,536 bit patterns.
#include <cmath>
#include <cstring>

#include "testing.h"

using namespace lockstep;

namespace {
float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Independent reference: the value of an IEEE binary16 pattern, computed with ldexp.
double f16_reference(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0x1f)
    v = mant ? NAN : INFINITY;
  else if (exp == 0)
    v = std::ldexp(mant, -24);
  else
    v = std::ldexp(1024 + mant, exp - 25);
  return sign ? -v : v;
}

double bf16_reference(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 7) & 0xff, mant = h & 0x7f;
  double v;
  if (exp == 0xff)
    v = mant ? NAN : INFINITY;
  else if (exp == 0)
    v = std::ldexp(mant, -133);
  else
    v = std::ldexp(128 + mant, exp - 134);
  return sign ? -v : v;
}

// Checks rounding between every pair of adjacent finite 16-bit values of one sign: the exact
// midpoint goes to the even pattern, anything just off it to the nearer one.
template <typename ToBits, typename Ref>
void check_midpoints(ToBits to_bits, Ref ref, uint16_t max_finite, uint16_t sign) {
  for (uint32_t h = 0; h < max_finite; ++h) {
    const uint16_t lo = static_cast<uint16_t>(h | sign), hi = static_cast<uint16_t>((h + 1) | sign);
    const double a = ref(lo), b = ref(hi);
    const float mid = static_cast<float>((a + b) / 2);
    ASSERT_EQ(static_cast<double>(mid), (a + b) / 2) << "midpoint not exact in f32 at " << h;
    const uint16_t even = (lo & 1) ? hi : lo;
    ASSERT_EQ(to_bits(mid), even) << "tie at pattern " << h;
    const float toward_lo = std::nextafter(mid, static_cast<float>(a));
    const float toward_hi = std::nextafter(mid, static_cast<float>(b));
    ASSERT_EQ(to_bits(toward_lo), lo) << "below midpoint at " << h;
    ASSERT_EQ(to_bits(toward_hi), hi) << "above midpoint at " << h;
  }
}
}  // namespace

TEST(Half, BFloat16AllPatternsDecodeAndRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_bits_to_float(static_cast<uint16_t>(h));
    const double r = bf16_reference(static_cast<uint16_t>(h));
    if (std::isnan(r)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(f)))) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), r) << h;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
    ASSERT_EQ(float_to_bf16_bits(f), h) << h;
  }
}

TEST(Half, Float16AllPatternsDecodeAndRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_bits_to_float(static_cast<uint16_t>(h));
    const double r = f16_reference(static_cast<uint16_t>(h));
    if (std::isnan(r)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(std::isnan(f16_bits_to_float(float_to_f16_bits(f)))) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), r) << h;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
    ASSERT_EQ(float_to_f16_bits(f), h) << h;
  }
}

TEST(Half, BFloat16RoundsToNearestEven) {
  check_midpoints(float_to_bf16_bits, bf16_reference, 0x7f7f, 0);
  check_midpoints(float_to_bf16_bits, bf16_reference, 0x7f7f, 0x8000);
}

TEST(Half, Float16RoundsToNearestEvenIncludingSubnormals) {
  check_midpoints(float_to_f16_bits, f16_reference, 0x7bff, 0);
  check_midpoints(float_to_f16_bits, f16_reference, 0x7bff, 0x8000);
}

TEST(Half, Float16OverflowUnderflowAndSpecials) {
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7c00);  // tie with odd 65504 rounds up to infinity
  EXPECT_EQ(float_to_f16_bits(1e10f), 0x7c00);
  EXPECT_EQ(float_to_f16_bits(-1e10f), 0xfc00);
  EXPECT_EQ(float_to_f16_bits(INFINITY), 0x7c00);
  EXPECT_EQ(float_to_f16_bits(-INFINITY), 0xfc00);
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even (zero)
  EXPECT_EQ(float_to_f16_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16_bits(1e-30f), 0x0000);
  const uint16_t qnan = float_to_f16_bits(NAN);
  EXPECT_EQ(qnan & 0x7c00, 0x7c00);
  EXPECT_NE(qnan & 0x03ff, 0);
  // A signalling f32 NaN whose payload sits only in low bits must not become infinity.
  EXPECT_TRUE(std::isnan(f16_bits_to_float(float_to_f16_bits(bits_to_float(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(bits_to_float(0x7f800001u)))));
  EXPECT_EQ(float_to_bf16_bits(INFINITY), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(3.4e38f), 0x7f80);  // above bf16 max rounds to infinity
}

TEST(Half, TensorConversionAllPatterns) {
  std::vector<uint16_t> bits(65536);
  for (uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
  for (DType dt : {kBFloat16, kFloat16}) {
    Tensor h = from_buffer(bits.data(), {65536}, dt);
    Tensor f = h.to(kFloat32);
    Tensor back = f.to(dt);
    const uint16_t* p = static_cast<const uint16_t*>(back.data_ptr());
    const float* fp = f.data<float>();
    for (uint32_t i = 0; i < 65536; ++i) {
      const double r = dt == kBFloat16 ? bf16_reference(bits[i]) : f16_reference(bits[i]);
      if (std::isnan(r)) {
        ASSERT_TRUE(std::isnan(fp[i]));
      } else {
        ASSERT_EQ(static_cast<double>(fp[i]), r) << i;
        ASSERT_EQ(p[i], bits[i]) << i;
      }
    }
    // f64 goes through the same rounding.
    Tensor d = h.to(kFloat64).to(dt);
    const uint16_t* q = static_cast<const uint16_t*>(d.data_ptr());
    for (uint32_t i = 0; i < 65536; ++i)
      if (!std::isnan(fp[i])) ASSERT_EQ(q[i], bits[i]) << i;
  }
}

namespace {

// The bulk conversions (F16C where the CPU has it) give the scalar conversions' bits: every f16
// value to f32, and f32 bit patterns swept over all exponents (normals, subnormals, overflow,
// ties, NaN payloads) to f16. Odd lengths exercise the scalar tail.
TEST(HalfBulk, MatchesTheScalarConversionsBitForBit) {
  std::vector<uint16_t> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> wide(all.size());
  lockstep::f16_bits_to_float_n(all.data(), wide.data(), static_cast<int64_t>(all.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = lockstep::f16_bits_to_float(all[i]);
    ASSERT_EQ(std::memcmp(&wide[i], &want, 4), 0) << "f16 bits " << all[i];
  }
  std::vector<float> src;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 0x1003) {  // every exponent, many mantissas
    uint32_t v = static_cast<uint32_t>(u);
    float f;
    std::memcpy(&f, &v, 4);
    src.push_back(f);
  }
  for (uint32_t v : {0x477ff000u, 0x477fefffu, 0x38800000u, 0x337fffffu, 0x33000001u, 0x7fc00001u,
                     0xffbfffffu, 0x7f800000u}) {  // edges: overflow, min normal, ties, NaNs
    float f;
    std::memcpy(&f, &v, 4);
    src.push_back(f);
  }
  std::vector<uint16_t> narrow(src.size());
  lockstep::float_to_f16_bits_n(src.data(), narrow.data(), static_cast<int64_t>(src.size()));
  for (size_t i = 0; i < src.size(); ++i) {
    uint32_t v;
    std::memcpy(&v, &src[i], 4);
    ASSERT_EQ(narrow[i], lockstep::float_to_f16_bits(src[i])) << "f32 bits " << std::hex << v;
  }
}

// The bf16 bulk conversions (AVX2 where the CPU has it) likewise: every bf16 pattern to f32, and
// f32 patterns over all exponents plus the rounding edges (ties to even both ways, the carry into
// the exponent, the largest finite, NaN payloads that rounding would turn into inf) to bf16.
TEST(HalfBulk, BFloat16MatchesTheScalarConversionsBitForBit) {
  std::vector<uint16_t> all(65536 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> wide(all.size());
  lockstep::bf16_bits_to_float_n(all.data(), wide.data(), static_cast<int64_t>(all.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = lockstep::bf16_bits_to_float(all[i]);
    ASSERT_EQ(std::memcmp(&wide[i], &want, 4), 0) << "bf16 bits " << all[i];
  }
  std::vector<uint32_t> bits;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 0x1003) bits.push_back(static_cast<uint32_t>(u));
  for (uint32_t v : {0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f7fffffu, 0x7f7fffffu, 0x7f7f8000u,
                     0x7f800001u, 0x7fffffffu, 0xff800001u, 0xffffffffu, 0x7f800000u, 0x80000000u,
                     0x00008000u, 0x00018000u}) {
    bits.push_back(v);
  }
  std::vector<float> src(bits.size());
  std::memcpy(src.data(), bits.data(), bits.size() * 4);
  std::vector<uint16_t> narrow(src.size());
  lockstep::float_to_bf16_bits_n(src.data(), narrow.data(), static_cast<int64_t>(src.size()));
  for (size_t i = 0; i < src.size(); ++i)
    ASSERT_EQ(narrow[i], lockstep::float_to_bf16_bits(src[i]))
        << "f32 bits " << std::hex << bits[i];
  // Through a tensor copy (the path autocast takes), both ways.
  lockstep::Generator gen(4);
  const lockstep::Tensor x = lockstep::randn({1000, 37}, gen);
  const auto xs = x.to_vector<float>();
  const auto bs = x.to(lockstep::kBFloat16).to(lockstep::kFloat32).to_vector<float>();
  for (size_t i = 0; i < xs.size(); ++i)
    ASSERT_EQ(bs[i], lockstep::bf16_bits_to_float(lockstep::float_to_bf16_bits(xs[i]))) << i;
}

TEST(HalfBulk, CopyBetweenF32AndF16UsesThemAndKeepsValues) {
  lockstep::Generator gen(3);
  const lockstep::Tensor x = lockstep::randn({1000, 37}, gen);
  const lockstep::Tensor h = x.to(lockstep::kFloat16);
  const auto xs = x.to_vector<float>();
  const auto hs = h.to(lockstep::kFloat32).to_vector<float>();
  for (size_t i = 0; i < xs.size(); ++i) {
    ASSERT_EQ(hs[i], lockstep::f16_bits_to_float(lockstep::float_to_f16_bits(xs[i]))) << i;
  }
}

}  // namespace
