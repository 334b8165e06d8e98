// The mapping of row-major batched products onto cuBLASLt (Note [cuBLASLt layouts] in
// src/ops/gemm_layout.h).
#include "ops/gemm_layout.h"

#include <algorithm>
#include <climits>

namespace lockstep::detail {

bool lt_operand(int64_t rows, int64_t cols, int64_t rs, int64_t cs, LtOperand* out) {
  const int64_t min_row_ld = std::max<int64_t>(1, cols), min_col_ld = std::max<int64_t>(1, rows);
  if ((cs == 1 || cols <= 1) && (rows <= 1 || rs >= min_row_ld)) {
    // X^T as stored: column-major (cols x rows), op N.
    out->trans = false;
    out->rows = cols;
    out->cols = rows;
    out->ld = rows <= 1 ? min_row_ld : rs;
  } else if ((rs == 1 || rows <= 1) && (cols <= 1 || cs >= min_col_ld)) {
    // X stored column-major (rows x cols), read transposed: op T.
    out->trans = true;
    out->rows = rows;
    out->cols = cols;
    out->ld = cols <= 1 ? min_col_ld : cs;
  } else {
    return false;
  }
  return true;
}

void GemmPlan::offsets(int64_t call, int64_t* a_off, int64_t* b_off, int64_t* c_off) const {
  *a_off = *b_off = *c_off = 0;
  for (int64_t d = loop_shape.size() - 1; d >= 0; --d) {
    const int64_t i = call % loop_shape[d];
    call /= loop_shape[d];
    *a_off += i * loop_a_strides[d];
    *b_off += i * loop_b_strides[d];
    *c_off += i * loop_c_strides[d];
  }
}

bool plan_gemm(const Dims& batch, int64_t m, int64_t n, int64_t k, const Dims& a_strides,
               const Dims& b_strides, GemmPlan* plan, bool* a_fits, bool* b_fits) {
  const int64_t nd = batch.size();
  GemmPlan p;
  *a_fits = lt_operand(m, k, a_strides[nd], a_strides[nd + 1], &p.a_op);
  *b_fits = lt_operand(k, n, b_strides[nd], b_strides[nd + 1], &p.b_op);
  if (!*a_fits || !*b_fits) return false;
  p.m = m, p.n = n, p.k = k;

  // One b for every batch entry: a's rows (batch..., m) may fold into one (batch * m) x k
  // operand when each non-trivial dim steps over exactly the dims inside it.
  bool b_shared = true;
  for (int64_t d = 0; d < nd; ++d) b_shared = b_shared && (batch[d] == 1 || b_strides[d] == 0);
  const int64_t nb = batch.numel();
  if (b_shared && nb > 1) {
    bool merge = true, first = true;
    int64_t rs = a_strides[nd], expected = 0;
    for (int64_t d = nd; d >= 0 && merge; --d) {
      const int64_t size = d == nd ? m : batch[d];
      if (size == 1) continue;
      if (first) {
        rs = a_strides[d];
        expected = rs * size;
        first = false;
      } else {
        merge = a_strides[d] == expected;
        expected *= size;
      }
    }
    LtOperand folded;
    if (merge && lt_operand(nb * m, k, rs, a_strides[nd + 1], &folded)) {
      p.a_op = folded;
      p.m = nb * m;
      *plan = p;
      return true;
    }
  }

  // The longest run of trailing batch dims over which a, b and c (contiguous) each step by one
  // stride goes to the strided batch; the dims before it are a loop of calls.
  Dims c_strides = Dims::filled(nd, 0);
  int64_t step = m * n;
  for (int64_t d = nd - 1; d >= 0; --d) {
    c_strides[d] = step;
    step *= batch[d];
  }
  int64_t split = nd, inner = 1;
  int64_t ea = 0, eb = 0, ec = 0;  // the strides the next outer dim must have to join
  for (int64_t d = nd - 1; d >= 0; --d) {
    if (batch[d] == 1) {
      split = d;
      continue;
    }
    if (inner == 1) {
      p.a_batch_stride = a_strides[d];
      p.b_batch_stride = b_strides[d];
      p.c_batch_stride = c_strides[d];
    } else if (a_strides[d] != ea || b_strides[d] != eb || c_strides[d] != ec ||
               inner * batch[d] > INT_MAX) {
      break;  // cuBLASLt's batch count is an int
    }
    ea = a_strides[d] * batch[d];
    eb = b_strides[d] * batch[d];
    ec = c_strides[d] * batch[d];
    inner *= batch[d];
    split = d;
  }
  p.batch = inner;
  for (int64_t d = 0; d < split; ++d) {
    if (batch[d] == 1) continue;
    p.loop_shape.push_back(batch[d]);
    p.loop_a_strides.push_back(a_strides[d]);
    p.loop_b_strides.push_back(b_strides[d]);
    p.loop_c_strides.push_back(c_strides[d]);
  }
  *plan = p;
  return true;
}

}  // namespace lockstep::detail
