// How a row-major batched product c = a @ b maps onto cuBLASLt's column-major matmul: operand
// layouts, transposes, the strided batch and the loop around it (Note [cuBLASLt layouts]). Pure
// host logic, without CUDA headers, so that it is tested in every build.
#pragma once

#include <cstdint>

#include "lockstep/tensor/dims.h"

namespace lockstep::detail {

// Note [cuBLASLt layouts]
// cuBLASLt reads column-major matrices. The row-major c (m x n) in memory is the column-major
// c^T (n x m) with leading dimension n, and c^T = b^T a^T, so c = a @ b runs as the
// column-major product D (n x m) = op(A) (n x k) op(B) (k x m) with A = b's memory and B = a's.
// A row-major operand X (rows x cols) with strides (rs, cs) is, read column-major, either
// - X^T as stored, when cs == 1: a (cols x rows) matrix with ld = rs, op N; or
// - the transpose of a stored (rows x cols) matrix, when rs == 1: ld = cs, op T.
// That covers contiguous tensors, their .t() / .transpose(-1, -2) views and row slices of
// either, without a copy (linear's w.t(), the backward's g.t()); anything else (an expanded
// matrix dim, a step > 1 in both directions) is made contiguous first. Size-1 dims take any
// stride. The batch dims go to cuBLASLt's strided batch for the longest run of trailing batch
// dims over which each operand steps by one stride (stride 0: a broadcast operand); the
// remaining leading batch dims are a loop of calls. When b is one matrix for the whole batch
// and a's batch rows are one evenly strided run, the batch folds into the rows of one product.

// A row-major (rows x cols) matrix with strides (rs, cs) as a column-major cuBLASLt operand
// (see the Note); false when neither reading fits.
struct LtOperand {
  bool trans = false;                  // op T
  int64_t rows = 0, cols = 0, ld = 1;  // the stored column-major matrix
};
bool lt_operand(int64_t rows, int64_t cols, int64_t rs, int64_t cs, LtOperand* out);

// The plan in row-major terms; the caller hands cuBLASLt A = b_op, B = a_op, sizes (n, m, k)
// and D = c with leading dimension n (see the Note).
struct GemmPlan {
  int64_t m = 0, n = 0, k = 0;  // per product: m grows to batch * m when the batch folds
  LtOperand a_op, b_op;         // row-major a (m x k) and b (k x n) as cuBLASLt reads them
  int64_t batch = 1;            // products per cuBLASLt call (its strided batch)
  int64_t a_batch_stride = 0, b_batch_stride = 0, c_batch_stride = 0;  // elements
  // The calls: one per position over loop_shape, each starting at the element offsets that
  // offsets() gives for a, b and c.
  Dims loop_shape;
  Dims loop_a_strides, loop_b_strides, loop_c_strides;
  int64_t calls() const { return loop_shape.numel(); }
  void offsets(int64_t call, int64_t* a_off, int64_t* b_off, int64_t* c_off) const;
};

// The plan of c (batch..., m, n), contiguous, = a @ b for a (batch..., m, k) and b (batch...,
// k, n) given as the strides of views expanded to c's batch dims (a_strides and b_strides have
// batch.size() + 2 entries). Returns false when a (a_fits) or b (b_fits) has a matrix layout
// that cuBLASLt cannot read: the caller makes that operand contiguous and plans again.
bool plan_gemm(const Dims& batch, int64_t m, int64_t n, int64_t k, const Dims& a_strides,
               const Dims& b_strides, GemmPlan* plan, bool* a_fits, bool* b_fits);

}  // namespace lockstep::detail
