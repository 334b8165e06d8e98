// CPU kernels of the index ops: index_select, gather and their adjoints (index_add,
// scatter_add), and the index range check.
#include <algorithm>
#include <vector>

#include "ops/cpu/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::cpu {

namespace {

// Rows (or lines) per thread chunk below which index kernels stay on one thread.
constexpr int64_t kIndexGrainElements = 32768;

// Product of shape[begin, end).
int64_t span_numel(const Dims& shape, int64_t begin, int64_t end) {
  int64_t n = 1;
  for (int64_t d = begin; d < end; ++d) n *= shape[d];
  return n;
}

// Runs f(lo, hi) over [0, n) in parallel with a grain of about kIndexGrainElements elements,
// where one unit of n moves `per_unit` elements.
template <typename F>
void parallel_units(int64_t n, int64_t per_unit, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kIndexGrainElements / std::max<int64_t>(per_unit, 1));
  parallel_for(0, n, grain, f);
}

// A 1-D contiguous index tensor as int64 values (already range-checked).
std::vector<int64_t> index_values(const Tensor& index, const char* op) {
  std::vector<int64_t> out(index.numel());
  dispatch_index(index.dtype(), op, [&]<typename I>() {
    const I* p = static_cast<const I*>(index.data_ptr());
    for (int64_t i = 0; i < index.numel(); ++i) out[i] = static_cast<int64_t>(p[i]);
  });
  return out;
}

// Iteration over the "lines" of a shape along `dim`: every position of the other dims, with
// the element offsets of each operand's start of line.
struct Lines {
  Dims shape;  // the iteration shape (gather's index shape)
  int64_t dim = 0;
  int64_t count = 1;  // number of lines

  Lines(const Dims& s, int64_t d) : shape(s), dim(d) {
    for (int64_t k = 0; k < s.size(); ++k)
      if (k != d) count *= s[k];
  }
  // Offset of line `line` for an operand with `strides`.
  int64_t offset(int64_t line, const Dims& strides) const {
    int64_t off = 0;
    for (int64_t k = shape.size() - 1; k >= 0; --k) {
      if (k == dim) continue;
      off += (line % shape[k]) * strides[k];
      line /= shape[k];
    }
    return off;
  }
};

// gi (outer, n, inner) += g (outer, k, inner) with row i of g going to row idx[i].
template <typename T>
void index_add_rows(const T* g, T* gi, const std::vector<int64_t>& idx, int64_t outer, int64_t n,
                    int64_t inner) {
  const int64_t k = idx.size();
  auto rows = [&](int64_t oi, int64_t j0, int64_t j1) {
    for (int64_t i = 0; i < k; ++i) {
      const T* from = g + (oi * k + i) * inner;
      T* to = gi + (oi * n + idx[i]) * inner;
      for (int64_t j = j0; j < j1; ++j) to[j] += from[j];
    }
  };
  // Repeated indices collide within one outer slice, so threads split the outer slices (or,
  // when there is only one, the columns of the inner rows).
  if (outer > 1) {
    parallel_units(outer, k * inner, [&](int64_t b, int64_t e) {
      for (int64_t oi = b; oi < e; ++oi) rows(oi, 0, inner);
    });
  } else {
    parallel_units(inner, k, [&](int64_t b, int64_t e) { rows(0, b, e); });
  }
}

// gi (contiguous, in_shape) at [.., index[p], ..] += g[p] for every position p of the
// contiguous `index` (gather's adjoint).
template <typename T>
void gather_add(const T* g, const Tensor& index, T* gi, const Dims& in_shape, int64_t d) {
  const Lines lines(index.shape(), d);
  const Dims idx_strides = contiguous_strides(index.shape());
  const Dims in_strides = contiguous_strides(in_shape);
  const int64_t len = index.shape()[d], step = idx_strides[d];
  dispatch_index(index.dtype(), "gather backward", [&]<typename I>() {
    const I* ip = static_cast<const I*>(index.data_ptr());
    // Two lines never share an input element (they differ outside `d`), so lines can run on
    // different threads.
    parallel_units(lines.count, len, [&](int64_t b, int64_t e) {
      for (int64_t l = b; l < e; ++l) {
        const int64_t io = lines.offset(l, idx_strides);
        T* dst = gi + lines.offset(l, in_strides);
        for (int64_t j = 0; j < len; ++j)
          dst[static_cast<int64_t>(ip[io + j * step]) * in_strides[d]] += g[io + j * step];
      }
    });
  });
}

}  // namespace

void index_bounds_kernel(const Tensor& index, int64_t size, BadIndex* bad) {
  const Tensor ic = index.contiguous();
  dispatch_index(ic.dtype(), "index", [&]<typename I>() {
    const I* p = static_cast<const I*>(ic.data_ptr());
    for (int64_t i = 0; i < ic.numel(); ++i) {
      const int64_t v = static_cast<int64_t>(p[i]);
      if (v < 0 || v >= size) {
        *bad = BadIndex{i, v};
        return;
      }
    }
  });
}

// (outer, n, inner) -> (outer, k, inner), rows of `inner` contiguous elements.
void index_select_kernel(const Tensor& out, const Tensor& src, int64_t d, const Tensor& index) {
  const std::vector<int64_t> idx = index_values(index, "index_select");
  const int64_t k = idx.size(), n = src.shape()[d];
  const int64_t outer = span_numel(src.shape(), 0, d);
  const int64_t inner = span_numel(src.shape(), d + 1, src.dim());
  dispatch_all(src.dtype(), "index_select", [&]<typename T>() {
    const T* s = static_cast<const T*>(src.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    parallel_units(outer * k, inner, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t oi = r / k, i = r % k;
        const T* from = s + (oi * n + idx[i]) * inner;
        T* to = o + r * inner;
        for (int64_t j = 0; j < inner; ++j) to[j] = from[j];
      }
    });
  });
}

void index_add_kernel(const Tensor& dst, int64_t d, const Tensor& index, const Tensor& src) {
  const std::vector<int64_t> idx = index_values(index, "index_add");
  const int64_t n = dst.shape()[d];
  const int64_t outer = span_numel(dst.shape(), 0, d);
  const int64_t inner = span_numel(dst.shape(), d + 1, dst.dim());
  dispatch_float(dst.dtype(), "index_select backward", [&]<typename T>() {
    index_add_rows(static_cast<const T*>(src.data_ptr()), static_cast<T*>(dst.data_ptr()), idx,
                   outer, n, inner);
  });
}

void gather_kernel(const Tensor& out, const Tensor& t, int64_t d, const Tensor& idx_t) {
  const Lines lines(idx_t.shape(), d);
  const Dims idx_strides = contiguous_strides(idx_t.shape());  // also the output's
  const int64_t len = idx_t.shape()[d];
  const int64_t step = idx_strides[d];
  dispatch_all(t.dtype(), "gather", [&]<typename T>() {
    dispatch_index(idx_t.dtype(), "gather", [&]<typename I>() {
      const T* s = static_cast<const T*>(t.data_ptr());
      const I* ip = static_cast<const I*>(idx_t.data_ptr());
      T* o = static_cast<T*>(out.data_ptr());
      const int64_t ts = t.strides()[d];
      parallel_units(lines.count, len, [&](int64_t b, int64_t e) {
        for (int64_t l = b; l < e; ++l) {
          const int64_t io = lines.offset(l, idx_strides);
          const T* src = s + lines.offset(l, t.strides());
          for (int64_t j = 0; j < len; ++j)
            o[io + j * step] = src[static_cast<int64_t>(ip[io + j * step]) * ts];
        }
      });
    });
  });
}

void scatter_add_kernel(const Tensor& dst, int64_t d, const Tensor& index, const Tensor& src) {
  dispatch_float(dst.dtype(), "gather backward", [&]<typename T>() {
    gather_add(static_cast<const T*>(src.data_ptr()), index, static_cast<T*>(dst.data_ptr()),
               dst.shape(), d);
  });
}

}  // namespace lockstep::cpu
