// The Gloo backend reduces in rank order (Note [Gloo rank-order reduction]): its all_reduce is
// bitwise a serial x0 + x1 + ... + x(n-1), the shm backend's all_reduce, and its own
// reduce_scatter followed by all_gather, for sizes that do not split evenly, smaller than the
// world and empty. Inputs span twelve orders of magnitude, so another order of addition would
// round differently.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "distributed/cost_model_settings.h"
#include "distributed/thread_ranks.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/lockstep.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;

namespace {

// Rank r's input of n elements: signed values of magnitude 1e-6 .. 1e6.
std::vector<float> input_of(int rank, int64_t n, uint64_t salt) {
  std::mt19937_64 gen(1000003 * static_cast<uint64_t>(rank) + salt);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(mantissa(gen) * std::pow(10.0, exponent(gen)));
  return v;
}

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  if (!v.empty()) std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}

// The algorithm a gloo all_reduce of `bytes` over `world` ranks must run under
// LOCKSTEP_ALLREDUCE_ALGO=`setting`: the forced one (two ranks: always whole), else the model's
// choice for the default link. Written out here rather than asked of the library, so that a
// backend that ignored the setting would fail.
AllReduceAlgorithm expected_algorithm(int world, int64_t bytes, const std::string& setting) {
  if (world == 2 || setting == "whole") return AllReduceAlgorithm::kWhole;
  if (setting == "direct") return AllReduceAlgorithm::kDirect;
  return choose_all_reduce(bytes, world, LinkModel{});
}

// Fails unless `pg` is a gloo group whose `calls` all_reduce calls so far all ran `want`.
void expect_ran(const ProcessGroupPtr& pg, AllReduceAlgorithm want, int64_t calls, int rank) {
  const auto* gloo = dynamic_cast<const ProcessGroupGloo*>(pg.get());
  ASSERT_NE(gloo, nullptr) << "rank " << rank << ": expected a gloo group, got " << pg->backend();
  const auto ran = gloo->all_reduce_counts();
  EXPECT_EQ(ran.whole, want == AllReduceAlgorithm::kWhole ? calls : 0)
      << "rank " << rank << " expected " << algorithm_name(want);
  EXPECT_EQ(ran.direct, want == AllReduceAlgorithm::kDirect ? calls : 0)
      << "rank " << rank << " expected " << algorithm_name(want);
}

// Every rank's all_reduce result on `backend` (one vector per rank); with `ran`, each rank's
// group must have run that algorithm.
std::vector<std::vector<float>> all_reduce_on(const std::string& backend, int world, int64_t n,
                                              ReduceOp op, uint64_t salt,
                                              std::optional<AllReduceAlgorithm> ran = {}) {
  std::vector<std::vector<float>> out(static_cast<size_t>(world));
  const auto errors =
      lockstep::testing::run_ranks_on(backend, world, [&](int r, ProcessGroupPtr pg) {
        Tensor t = from_vector(input_of(r, n, salt), {n});
        pg->all_reduce(t, AllReduceOptions{.op = op})->wait();
        out[r] = t.to_vector<float>();
        if (ran) expect_ran(pg, *ran, 1, r);
      });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << backend << " rank " << r;
  return out;
}

// ((x0 + x1) + x2) + ..., in f32; avg divides that sum by the world size.
std::vector<float> serial_sum(int world, int64_t n, ReduceOp op, uint64_t salt) {
  std::vector<float> acc = input_of(0, n, salt);
  for (int r = 1; r < world; ++r) {
    const auto x = input_of(r, n, salt);
    for (size_t i = 0; i < acc.size(); ++i) acc[i] += x[i];
  }
  if (op == ReduceOp::avg) {
    for (auto& a : acc) a /= static_cast<float>(world);
  }
  return acc;
}

// The gloo backend's all_reduce sends whole tensors or reduce-scatters and all-gathers, by the
// cost model (Note [Cost model]); LOCKSTEP_ALLREDUCE_ALGO, read when a group is made, forces one.
struct Sizes {
  int world;
  int64_t n;
  const char* algorithm;
};

// The link settings are cleared, so that "auto" means the default link whatever the caller's
// environment holds.
class GlooRankOrder : public ::testing::TestWithParam<Sizes> {
 protected:
  void SetUp() override {
    lockstep::testing::clear_cost_model_settings();
    ::setenv(env::kAllReduceAlgo, GetParam().algorithm, 1);
  }
  void TearDown() override { lockstep::testing::clear_cost_model_settings(); }

};

TEST_P(GlooRankOrder, AllReduceIsBitwiseTheSerialRankOrderSumAndShms) {
  const auto [world, n, algorithm] = GetParam();
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
    const uint64_t salt = static_cast<uint64_t>(n) * 7 + static_cast<uint64_t>(op);
    const auto want = bits(serial_sum(world, n, op, salt));
    const auto gloo =
        all_reduce_on("gloo", world, n, op, salt, expected_algorithm(world, n * 4, algorithm));
    const auto shm = all_reduce_on("shm", world, n, op, salt);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(bits(gloo[r]), want) << "gloo rank " << r << " op " << static_cast<int>(op);
      EXPECT_EQ(bits(shm[r]), want) << "shm rank " << r << " op " << static_cast<int>(op);
    }
  }
}

// reduce_scatter's chunks (n / world each) are not all_reduce's (64-byte multiples), and
// all_reduce's split is not used at all with two ranks: the rank order makes them agree anyway.
TEST_P(GlooRankOrder, ReduceScatterThenAllGatherIsBitwiseAllReduce) {
  const auto [world, n, algorithm] = GetParam();
  const int64_t per = n / world;  // the whole input: world x per elements
  const uint64_t salt = static_cast<uint64_t>(n) * 13;
  const auto errors =
      lockstep::testing::run_ranks_on("gloo", world, [&](int r, ProcessGroupPtr pg) {
        Tensor in = from_vector(input_of(r, per * world, salt), {per * world});
        Tensor reduced = zeros({per});
        pg->reduce_scatter(reduced, in)->wait();
        Tensor gathered = zeros({per * world});
        pg->all_gather(gathered, reduced)->wait();
        pg->all_reduce(in)->wait();
        expect_ran(pg, expected_algorithm(world, per * world * 4, algorithm), 1, r);
        EXPECT_EQ(bits(gathered.to_vector<float>()), bits(in.to_vector<float>())) << "rank " << r;
        EXPECT_EQ(bits(in.to_vector<float>()),
                  bits(serial_sum(world, per * world, ReduceOp::sum, salt)))
            << "rank " << r;
      });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Sizes: empty, smaller than the world, not a multiple of it, one 64-byte chunk plus a bit, more
// than one 1 MiB piece per chunk (pieces arrive and are reduced in order); each sent whole and
// reduce-scattered (two ranks always send whole tensors), and as the cost model chooses (whole
// for 16 KiB over four ranks, direct for 4 MiB).
std::vector<Sizes> sizes() {
  std::vector<Sizes> s;
  for (int world : {2, 3, 4}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{5}, int64_t{17}, int64_t{1000},
                      int64_t{4099}, int64_t{(1 << 20) + 5}}) {
      for (const char* algorithm : {"whole", "direct"}) {
        if (world == 2 && std::string(algorithm) == "direct") continue;
        if (n > (1 << 20) && std::string(algorithm) == "whole") continue;
        s.push_back({world, n, algorithm});
      }
    }
  }
  s.push_back({4, 4099, "auto"});
  s.push_back({4, (1 << 20) + 5, "auto"});
  return s;
}

INSTANTIATE_TEST_SUITE_P(Sizes, GlooRankOrder, ::testing::ValuesIn(sizes()), [](const auto& info) {
  return std::to_string(info.param.world) + "ranks_" + std::to_string(info.param.n) + "elements_" +
         info.param.algorithm;
});

// Every dtype the backend reduces, and ops other than sum: the same bits as shm's (which
// accumulates halves in f32 and rounds once, and wraps integers).
TEST(GlooRankOrder, EveryDtypeAndOpGivesShmsBits) {
  constexpr int kWorld = 3;
  constexpr int64_t kN = 20011;
  for (DType t : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64}) {
    for (ReduceOp op :
         {ReduceOp::sum, ReduceOp::avg, ReduceOp::product, ReduceOp::min, ReduceOp::max}) {
      if (op == ReduceOp::avg && (t == kInt32 || t == kInt64)) continue;
      std::vector<std::vector<uint8_t>> got[2];
      int which = 0;
      for (const char* backend : {"gloo", "shm"}) {
        auto& out = got[which++];
        out.resize(kWorld);
        const auto errors =
            lockstep::testing::run_ranks_on(backend, kWorld, [&](int r, ProcessGroupPtr pg) {
              auto v = input_of(r, kN, 99);
              if (op == ReduceOp::product) {
                for (auto& x : v) x = 1.0f + x * 1e-7f;  // stays finite over three ranks
              }
              if (t == kInt32 || t == kInt64) {
                for (auto& x : v) x = std::round(x);
              }
              Tensor x = from_vector(v, {kN}).to(t);
              pg->all_reduce(x, AllReduceOptions{.op = op})->wait();
              out[r].resize(static_cast<size_t>(x.nbytes()));
              std::memcpy(out[r].data(), x.data_ptr(), out[r].size());
            });
        for (int r = 0; r < kWorld; ++r) EXPECT_EQ(errors[r], "") << backend << " rank " << r;
      }
      for (int r = 0; r < kWorld; ++r) {
        EXPECT_TRUE(got[0][r] == got[1][r])
            << dtype_name(t) << " op " << static_cast<int>(op) << " rank " << r;
      }
    }
  }
}

}  // namespace
