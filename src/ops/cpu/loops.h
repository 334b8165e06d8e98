// Strided N-operand loops: the engine under every elementwise kernel.
#pragma once

#include <array>
#include <cstdint>

#include "lockstep/tensor/tensor.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

// N operands of one shape (inputs already expanded, so broadcast dims have stride 0), with
// dimensions coalesced where the memory layout allows, iterated innermost dimension first.
// The inner callback sees raw byte pointers, byte strides and a run length, so a typed loop
// over a contiguous run vectorizes.
template <int N>
class StridedLoop {
 public:
  StridedLoop(const Dims& shape, const std::array<const Tensor*, N>& ops) {
    for (int k = 0; k < N; ++k) {
      base_[k] = static_cast<char*>(ops[k]->data_ptr());
      esize_[k] = ops[k]->element_size();
    }
    // Keep non-trivial dims, innermost last.
    for (int64_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 1) continue;
      shape_[ndim_] = shape[d];
      for (int k = 0; k < N; ++k) strides_[k][ndim_] = ops[k]->stride(d) * esize_[k];
      ++ndim_;
    }
    // Merge dim d into d+1 when stepping over d equals stepping over all of d+1 for every
    // operand.
    int64_t out = 0;
    for (int64_t d = 0; d < ndim_; ++d) {
      if (out > 0) {
        bool can = true;
        for (int k = 0; k < N; ++k)
          can = can && strides_[k][out - 1] == strides_[k][d] * shape_[d];
        if (can) {
          shape_[out - 1] *= shape_[d];
          for (int k = 0; k < N; ++k) strides_[k][out - 1] = strides_[k][d];
          continue;
        }
      }
      shape_[out] = shape_[d];
      for (int k = 0; k < N; ++k) strides_[k][out] = strides_[k][d];
      ++out;
    }
    ndim_ = out;
    numel_ = 1;
    for (int64_t d = 0; d < ndim_; ++d) numel_ *= shape_[d];
    if (shape.numel() == 0) numel_ = 0;
  }

  int64_t numel() const { return numel_; }

  // inner(char* ptrs[N], const int64_t strides[N], int64_t n) for each run.
  template <typename Inner>
  void run(const Inner& inner, int64_t grain = kElementwiseGrain) const {
    if (numel_ == 0) return;
    if (ndim_ == 0) {  // a single element
      std::array<char*, N> p = base_;
      std::array<int64_t, N> s{};
      inner(p.data(), s.data(), 1);
      return;
    }
    parallel_for(0, numel_, grain, [&](int64_t b, int64_t e) { run_range(inner, b, e); });
  }

 private:
  template <typename Inner>
  void run_range(const Inner& inner, int64_t begin, int64_t end) const {
    const int64_t last = ndim_ - 1;
    int64_t idx[Dims::kMaxDims];
    int64_t rem = begin;
    for (int64_t d = last; d >= 0; --d) {
      idx[d] = rem % shape_[d];
      rem /= shape_[d];
    }
    std::array<int64_t, N> inner_strides;
    for (int k = 0; k < N; ++k) inner_strides[k] = strides_[k][last];
    int64_t pos = begin;
    while (pos < end) {
      std::array<char*, N> p;
      for (int k = 0; k < N; ++k) {
        char* q = base_[k];
        for (int64_t d = 0; d <= last; ++d) q += idx[d] * strides_[k][d];
        p[k] = q;
      }
      const int64_t n = std::min(shape_[last] - idx[last], end - pos);
      inner(p.data(), inner_strides.data(), n);
      pos += n;
      idx[last] += n;
      for (int64_t d = last; d > 0 && idx[d] == shape_[d]; --d) {
        idx[d] = 0;
        ++idx[d - 1];
      }
    }
  }

  std::array<char*, N> base_{};
  std::array<int64_t, N> esize_{};
  int64_t shape_[Dims::kMaxDims] = {};
  int64_t strides_[N][Dims::kMaxDims] = {};
  int64_t ndim_ = 0;
  int64_t numel_ = 0;
};

// out = op(a) elementwise; out and a have the same shape; types given explicitly.
template <typename Out, typename A, typename Op>
void unary_loop(const Tensor& out, const Tensor& a, const Op& op) {
  StridedLoop<2> loop(out.shape(), {&out, &a});
  loop.run([&](char** p, const int64_t* s, int64_t n) {
    Out* o = reinterpret_cast<Out*>(p[0]);
    const A* x = reinterpret_cast<const A*>(p[1]);
    if (s[0] == sizeof(Out) && s[1] == sizeof(A)) {
      for (int64_t i = 0; i < n; ++i) o[i] = op(x[i]);
    } else {
      for (int64_t i = 0; i < n; ++i)
        *reinterpret_cast<Out*>(p[0] + i * s[0]) = op(*reinterpret_cast<const A*>(p[1] + i * s[1]));
    }
  });
}

// out = op(a, b) elementwise; a and b already expanded to out's shape.
template <typename Out, typename A, typename B, typename Op>
void binary_loop(const Tensor& out, const Tensor& a, const Tensor& b, const Op& op) {
  StridedLoop<3> loop(out.shape(), {&out, &a, &b});
  loop.run([&](char** p, const int64_t* s, int64_t n) {
    Out* o = reinterpret_cast<Out*>(p[0]);
    const A* x = reinterpret_cast<const A*>(p[1]);
    const B* y = reinterpret_cast<const B*>(p[2]);
    if (s[0] == sizeof(Out) && s[1] == sizeof(A) && s[2] == sizeof(B)) {
      for (int64_t i = 0; i < n; ++i) o[i] = op(x[i], y[i]);
    } else if (s[0] == sizeof(Out) && s[1] == sizeof(A) && s[2] == 0) {
      const B yv = *y;
      for (int64_t i = 0; i < n; ++i) o[i] = op(x[i], yv);
    } else if (s[0] == sizeof(Out) && s[1] == 0 && s[2] == sizeof(B)) {
      const A xv = *x;
      for (int64_t i = 0; i < n; ++i) o[i] = op(xv, y[i]);
    } else {
      for (int64_t i = 0; i < n; ++i)
        *reinterpret_cast<Out*>(p[0] + i * s[0]) = op(*reinterpret_cast<const A*>(p[1] + i * s[1]),
                                                      *reinterpret_cast<const B*>(p[2] + i * s[2]));
    }
  });
}

// out = op(a, b, c) elementwise; all expanded to out's shape.
template <typename Out, typename A, typename B, typename C, typename Op>
void ternary_loop(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& c,
                  const Op& op) {
  StridedLoop<4> loop(out.shape(), {&out, &a, &b, &c});
  loop.run([&](char** p, const int64_t* s, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      *reinterpret_cast<Out*>(p[0] + i * s[0]) = op(*reinterpret_cast<const A*>(p[1] + i * s[1]),
                                                    *reinterpret_cast<const B*>(p[2] + i * s[2]),
                                                    *reinterpret_cast<const C*>(p[3] + i * s[3]));
  });
}

}  // namespace lockstep::cpu
