// Every collective x every dtype x sizes 0, 1, 7 and a few MiB on one rank of a group, checked
// against a reference computed here; shared by the thread and the process tests.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "lockstep/base/error.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/half.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::testing {

inline constexpr DType kCollectiveDTypes[] = {kFloat32, kFloat64, kBFloat16,
                                              kFloat16, kInt32,   kInt64};
// "A few MiB": 2 MiB of float32 (the other dtypes scale with their width).
inline constexpr int64_t kBigElements = 512 * 1024;
inline constexpr int64_t kSweepSizes[] = {0, 1, 7, kBigElements};

// Values small enough that every sum, product, min and max over 4 ranks is exact in every dtype
// (bf16 has 8 significant bits), so results are compared for equality.
inline double sweep_value(int rank, int64_t i, int salt) {
  return static_cast<double>((i * 7 + rank * 3 + salt) % 9) - 4.0;
}
// For products: +-1 and +-2 only.
inline double sweep_factor(int rank, int64_t i, int salt) {
  static constexpr double kFactors[] = {1.0, -1.0, 2.0, -2.0, 1.0};
  return kFactors[(i + rank * 3 + salt) % 5];
}

// The value of x once stored in dtype t.
inline double round_to(DType t, double x) {
  switch (t) {
    case DType::bf16:
      return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(x)));
    case DType::f16:
      return f16_bits_to_float(float_to_f16_bits(static_cast<float>(x)));
    case DType::f32:
      return static_cast<float>(x);
    default:
      return x;
  }
}

// avg as the backends compute it: the exact sum, divided in the dtype's arithmetic width.
inline double avg_of(DType t, double sum, int n) {
  if (t == DType::f64) return sum / n;
  return round_to(t, static_cast<float>(sum) / static_cast<float>(n));
}

inline Tensor sweep_tensor(DType t, int64_t n, const std::function<double(int64_t)>& f) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = f(i);
  return from_vector(v, {n}).to(t);
}

class SweepChecker {
 public:
  explicit SweepChecker(std::string where) : where_(std::move(where)) {}

  void expect_equal(const std::string& what, const Tensor& got, const std::vector<double>& want) {
    const auto g = got.to_vector<double>();
    if (g.size() != want.size()) {
      fail(what + ": " + std::to_string(g.size()) + " elements, expected " +
           std::to_string(want.size()));
      return;
    }
    for (size_t i = 0; i < g.size(); ++i) {
      if (!(g[i] == want[i])) {
        fail(what + ": element " + std::to_string(i) + " is " + std::to_string(g[i]) +
             ", expected " + std::to_string(want[i]));
        return;
      }
    }
  }
  void fail(const std::string& msg) { failures_.push_back(where_ + ": " + msg); }
  // Throws with every failure, so that a rank (thread or process) reports them all at once.
  void done() const {
    if (failures_.empty()) return;
    std::string all;
    for (const auto& f : failures_) all += f + "\n";
    LS_THROW(all);
  }

 private:
  std::string where_;
  std::vector<std::string> failures_;
};

// Runs the sweep on one rank of `pg`; every rank of the group must call it. Throws listing every
// mismatch.
inline void run_collective_sweep(dist::ProcessGroup& pg) {
  using dist::ReduceOp;
  const int me = pg.rank();
  const int ws = pg.size();
  SweepChecker check("rank " + std::to_string(me) + "/" + std::to_string(ws));
  int salt = 0;
  for (DType t : kCollectiveDTypes) {
    const bool floating = is_floating(t);
    for (int64_t n : kSweepSizes) {
      const std::string tag = std::string(dtype_name(t)) + " n=" + std::to_string(n);
      ++salt;
      // all_reduce, every op.
      std::vector<ReduceOp> ops = {ReduceOp::sum, ReduceOp::min, ReduceOp::max, ReduceOp::product};
      if (floating) ops.push_back(ReduceOp::avg);
      for (ReduceOp op : ops) {
        const bool product = op == ReduceOp::product;
        auto value = [&](int r, int64_t i) {
          return product ? sweep_factor(r, i, salt) : sweep_value(r, i, salt);
        };
        Tensor x = sweep_tensor(t, n, [&](int64_t i) { return value(me, i); });
        pg.all_reduce(x, {.op = op})->wait();
        std::vector<double> want(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          double acc = value(0, i);
          for (int r = 1; r < ws; ++r) {
            const double v = value(r, i);
            if (op == ReduceOp::sum || op == ReduceOp::avg) acc += v;
            if (op == ReduceOp::product) acc *= v;
            if (op == ReduceOp::min) acc = std::min(acc, v);
            if (op == ReduceOp::max) acc = std::max(acc, v);
          }
          want[i] = op == ReduceOp::avg ? avg_of(t, acc, ws) : acc;
        }
        check.expect_equal(tag + " all_reduce " + std::string(dist::reduce_op_name(op)), x, want);
      }

      // broadcast from a root that moves around.
      const int root = salt % ws;
      Tensor b = sweep_tensor(t, n, [&](int64_t i) { return sweep_value(me, i, salt); });
      pg.broadcast(b, {.root = root})->wait();
      std::vector<double> want_b(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) want_b[i] = sweep_value(root, i, salt);
      check.expect_equal(tag + " broadcast from " + std::to_string(root), b, want_b);

      // all_gather: chunk r is rank r's input.
      Tensor in = sweep_tensor(t, n, [&](int64_t i) { return sweep_value(me, i, salt); });
      Tensor out = full({ws * n}, 99.0, t);
      pg.all_gather(out, in)->wait();
      std::vector<double> want_g;
      for (int r = 0; r < ws; ++r)
        for (int64_t i = 0; i < n; ++i) want_g.push_back(sweep_value(r, i, salt));
      check.expect_equal(tag + " all_gather", out, want_g);

      // reduce_scatter (sum, and avg for floats): rank r gets the reduction of chunk r.
      for (ReduceOp op : floating ? std::vector<ReduceOp>{ReduceOp::sum, ReduceOp::avg}
                                  : std::vector<ReduceOp>{ReduceOp::sum}) {
        Tensor rin = sweep_tensor(t, ws * n, [&](int64_t i) { return sweep_value(me, i, salt); });
        const std::vector<double> rin_before = rin.to_vector<double>();
        Tensor rout = full({n}, 99.0, t);
        pg.reduce_scatter(rout, rin, {.op = op})->wait();
        std::vector<double> want_r(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          double acc = 0;
          for (int r = 0; r < ws; ++r) acc += sweep_value(r, me * n + i, salt);
          want_r[i] = op == ReduceOp::avg ? avg_of(t, acc, ws) : acc;
        }
        check.expect_equal(tag + " reduce_scatter " + std::string(dist::reduce_op_name(op)), rout,
                           want_r);
        check.expect_equal(tag + " reduce_scatter leaves its input alone", rin, rin_before);
        // In place, as NCCL's and MPI's: the output is the input's chunk `me`, which gets the
        // same values; the other chunks are left as they were.
        pg.reduce_scatter(rin.narrow(0, me * n, n), rin, {.op = op})->wait();
        std::vector<double> want_in = rin_before;
        for (int64_t i = 0; i < n; ++i) want_in[static_cast<size_t>(me * n + i)] = want_r[i];
        check.expect_equal(tag + " reduce_scatter in place " +
                               std::string(dist::reduce_op_name(op)),
                           rin, want_in);
      }
    }

    // Several tensors in one call (fused into one buffer), one of them strided.
    ++salt;
    Tensor a = sweep_tensor(t, 7, [&](int64_t i) { return sweep_value(me, i, salt); });
    Tensor base = sweep_tensor(t, 12, [&](int64_t i) { return sweep_value(me, 100 + i, salt); });
    Tensor strided = base.view({3, 4}).transpose(0, 1);  // [4, 3], not contiguous
    Tensor c = sweep_tensor(t, 3, [&](int64_t i) { return sweep_value(me, 200 + i, salt); });
    pg.all_reduce(std::vector<Tensor>{a, strided, c})->wait();
    auto summed = [&](int64_t off, int64_t n) {
      std::vector<double> w(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i)
        for (int r = 0; r < ws; ++r) w[i] += sweep_value(r, off + i, salt);
      return w;
    };
    check.expect_equal(std::string(dtype_name(t)) + " fused all_reduce, tensor 0", a, summed(0, 7));
    check.expect_equal(std::string(dtype_name(t)) + " fused all_reduce, strided tensor", base,
                       summed(100, 12));
    check.expect_equal(std::string(dtype_name(t)) + " fused all_reduce, tensor 2", c,
                       summed(200, 3));
  }

  // Several collectives in flight at once complete, in order, with the right values.
  std::vector<Tensor> xs;
  std::vector<dist::WorkPtr> works;
  for (int k = 0; k < 6; ++k) {
    xs.push_back(full({1000}, static_cast<double>(me + k), kFloat32));
    works.push_back(pg.all_reduce(xs.back()));
  }
  for (auto& w : works) w->wait();
  for (int k = 0; k < 6; ++k) {
    const double want = ws * k + ws * (ws - 1) / 2.0;
    check.expect_equal("in-flight all_reduce " + std::to_string(k), xs[k],
                       std::vector<double>(1000, want));
  }
  for (size_t k = 1; k < works.size(); ++k) {
    if (works[k]->seq() != works[k - 1]->seq() + 1) check.fail("sequence numbers out of order");
  }

  pg.barrier()->wait();

  // Objects: root's bytes everywhere; everyone's bytes in rank order (lengths differ, one empty).
  const dist::Bytes mine = dist::to_bytes(std::string(static_cast<size_t>(me * 5), 'a' + me));
  const dist::Bytes from_root = pg.broadcast_object(mine, ws - 1);
  if (dist::to_string(from_root) != std::string(static_cast<size_t>((ws - 1) * 5), 'a' + ws - 1)) {
    check.fail("broadcast_object gave '" + dist::to_string(from_root) + "'");
  }
  const auto all = pg.all_gather_object(mine);
  for (int r = 0; r < ws; ++r) {
    if (static_cast<int>(all.size()) != ws ||
        dist::to_string(all[r]) != std::string(static_cast<size_t>(r * 5), 'a' + r)) {
      check.fail("all_gather_object: entry " + std::to_string(r) + " is wrong");
      break;
    }
  }
  check.done();
}

// Run by every rank of a group of 3: collectives whose arguments differ between ranks (size,
// dtype, root, op, kind) each fail on every rank with the same message naming both sides, before
// any data moves; a matching collective then works (the group goes on).
inline void run_mismatch_round(int r, dist::ProcessGroup& pg) {
  LS_CHECK(pg.size() == 3, "run_mismatch_round needs a group of 3, got ", pg.size());
  auto expect_failure = [&](const dist::WorkPtr& w, const std::string& want) {
    try {
      w->wait();
    } catch (const Error& e) {
      LS_CHECK(std::string(e.what()).find(want) != std::string::npos, "expected '", want,
               "', got: ", e.what());
      return;
    }
    LS_THROW("a mismatch went unnoticed: ", want);
  };
  Tensor x = full({r == 1 ? 512 : 1024}, 1.0, kFloat32);
  expect_failure(pg.all_reduce(x), "all_reduce: rank 1 has 512 elements, rank 0 has 1024");
  Tensor b = full({4}, 1.0, r == 2 ? kFloat64 : kFloat32);
  expect_failure(pg.broadcast(b), "broadcast: rank 2 has f64 tensors, rank 0 has f32");
  Tensor c = full({4}, 1.0, kFloat32);
  expect_failure(pg.broadcast(c, {.root = r == 0 ? 0 : 1}),
                 "broadcast: rank 1 has root 1, rank 0 has root 0");
  expect_failure(pg.all_reduce(c, {.op = r == 2 ? dist::ReduceOp::max : dist::ReduceOp::sum}),
                 "all_reduce: rank 2 reduces with max, rank 0 with sum");
  expect_failure(r == 1 ? pg.barrier() : pg.all_reduce(c),
                 "rank 1 called barrier, rank 0 called all_reduce");
  const int64_t per = r == 2 ? 5 : 4;
  Tensor gathered = empty({3 * per}, kFloat32);
  expect_failure(pg.all_gather(gathered, full({per}, 1.0, kFloat32)),
                 "all_gather: rank 2 has 5 elements, rank 0 has 4");
  Tensor scattered = empty({per}, kFloat32);
  expect_failure(pg.reduce_scatter(scattered, full({3 * per}, 1.0, kFloat32)),
                 "reduce_scatter: rank 2 has 5 elements, rank 0 has 4");
  Tensor y = full({1000}, static_cast<double>(r), kFloat32);
  pg.all_reduce(y)->wait();
  LS_CHECK(y.to_vector<double>() == std::vector<double>(1000, 3.0), "sum after a mismatch");
}

}  // namespace lockstep::testing
