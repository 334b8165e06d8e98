// CPU reduction kernels: each output reduces its runs of the input serially (a fixed order,
// so results do not depend on the thread count); outputs are spread over threads.
#include <algorithm>

#include "ops/cpu/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

namespace {

// Outputs per thread chunk: a reduction of many small rows should still spread over threads,
// one over few long rows parallelizes inside nothing (rows are reduced serially).
constexpr int64_t kReduceGrainElements = 32768;

// Calls f(ptr, stride, n) for each run of the innermost reduced dim of output `o`.
template <typename T, typename F>
void visit_reduced(const T* base, const ReducePlan& p, int64_t o, const F& f) {
  for (int64_t d = p.keep_shape.size() - 1; d >= 0; --d) {
    base += (o % p.keep_shape[d]) * p.keep_strides[d];
    o /= p.keep_shape[d];
  }
  const int64_t nr = p.red_shape.size();
  if (nr == 0) {
    f(base, 1, 1);
    return;
  }
  const int64_t inner_n = p.red_shape[nr - 1], inner_s = p.red_strides[nr - 1];
  if (inner_n == 0) return;
  int64_t outer = 1;
  for (int64_t d = 0; d + 1 < nr; ++d) outer *= p.red_shape[d];
  for (int64_t r = 0; r < outer; ++r) {
    const T* q = base;
    int64_t rem = r;
    for (int64_t d = nr - 2; d >= 0; --d) {
      q += (rem % p.red_shape[d]) * p.red_strides[d];
      rem /= p.red_shape[d];
    }
    f(q, inner_s, inner_n);
  }
}

// Runs body(o) for every output index in parallel.
template <typename Body>
void for_outputs(int64_t outputs, int64_t count, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, kReduceGrainElements / std::max<int64_t>(count, 1));
  parallel_for(0, outputs, grain, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) body(o);
  });
}

template <typename T>
inline double sum_run(const T* p, int64_t s, int64_t n) {
  // Four partial sums: independent chains the CPU overlaps, and a little less rounding.
  double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t i = 0;
  if (s == 1) {
    for (; i + 4 <= n; i += 4) {
      a0 += static_cast<double>(p[i]);
      a1 += static_cast<double>(p[i + 1]);
      a2 += static_cast<double>(p[i + 2]);
      a3 += static_cast<double>(p[i + 3]);
    }
  }
  for (; i < n; ++i) a0 += static_cast<double>(p[i * s]);
  return (a0 + a1) + (a2 + a3);
}

}  // namespace

void sum_kernel(const Tensor& out, const Tensor& a, const ReducePlan& p, double scale) {
  const char* op = "sum";
  const int64_t outputs = out.numel();
  dispatch_all(a.dtype(), op, [&]<typename T>() {
    if constexpr (is_half_type_v<T>) {
      LS_THROW(op, ": unreachable half path");
    } else {
      const T* base = static_cast<const T*>(a.data_ptr());
      if constexpr (std::is_floating_point_v<T>) {
        T* o = static_cast<T*>(out.data_ptr());
        if (outputs == 1 && a.is_contiguous()) {  // one long sum: split it into blocks
          const double total =
              blocked_sum(a.numel(), [&](int64_t k) { return static_cast<double>(base[k]); });
          o[0] = static_cast<T>(total * scale);
          return;
        }
        for_outputs(outputs, p.count, [&](int64_t i) {
          double acc = 0;
          visit_reduced(base, p, i,
                        [&](const T* q, int64_t s, int64_t n) { acc += sum_run(q, s, n); });
          o[i] = static_cast<T>(acc * scale);
        });
      } else {
        int64_t* o = static_cast<int64_t*>(out.data_ptr());
        for_outputs(outputs, p.count, [&](int64_t i) {
          int64_t acc = 0;
          visit_reduced(base, p, i, [&](const T* q, int64_t s, int64_t n) {
            for (int64_t k = 0; k < n; ++k) acc += static_cast<int64_t>(q[k * s]);
          });
          o[i] = acc;
        });
      }
    }
  });
}

void var_kernel(const Tensor& out, const Tensor& a, const ReducePlan& p, double denom) {
  dispatch_float(a.dtype(), "var", [&]<typename T>() {
    const T* base = static_cast<const T*>(a.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    for_outputs(out.numel(), p.count, [&](int64_t i) {
      double s = 0;
      visit_reduced(base, p, i, [&](const T* q, int64_t st, int64_t n) { s += sum_run(q, st, n); });
      const double m = s / static_cast<double>(p.count);
      double ss = 0;
      visit_reduced(base, p, i, [&](const T* q, int64_t st, int64_t n) {
        for (int64_t k = 0; k < n; ++k) {
          const double dv = static_cast<double>(q[k * st]) - m;
          ss += dv * dv;
        }
      });
      o[i] = static_cast<T>(ss / denom);  // denom 0 gives inf/NaN, as torch.var
    });
  });
}

void extreme_kernel(const Tensor& values, const Tensor& indices, const Tensor& s,
                    const ReducePlan& p, bool is_max) {
  const char* op = is_max ? "max" : "min";
  dispatch_numeric(s.dtype(), op, [&]<typename T>() {
    const T* base = static_cast<const T*>(s.data_ptr());
    T* vo = static_cast<T*>(values.data_ptr());
    int64_t* io = static_cast<int64_t*>(indices.data_ptr());
    for_outputs(values.numel(), p.count, [&](int64_t o) {
      T best{};
      int64_t best_i = -1, k = 0;
      bool nan_seen = false;
      visit_reduced(base, p, o, [&](const T* q, int64_t st, int64_t n) {
        for (int64_t j = 0; j < n; ++j, ++k) {
          const T v = q[j * st];
          if (nan_seen) continue;
          if (v != v) {  // NaN wins and stays, as in PyTorch
            best = v, best_i = k, nan_seen = true;
          } else if (best_i < 0 || (is_max ? v > best : v < best)) {
            best = v, best_i = k;
          }
        }
      });
      vo[o] = best;
      io[o] = best_i;
    });
  });
}

}  // namespace lockstep::cpu
