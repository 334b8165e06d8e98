// The mapping of row-major batched products onto cuBLASLt's column-major matmul (Note [cuBLASLt
// layouts] in src/ops/gemm_layout.h): each plan is executed here by a literal CPU model of what
// cublasLtMatmul computes from the same descriptors, and must give matmul's result.
#include <algorithm>

#include "ops/gemm_layout.h"  // internal to the library: test_ops has src/ on its include path
#include "testing.h"

using namespace lockstep;
using lockstep::detail::GemmPlan;
using lockstep::detail::LtOperand;

namespace {

// op(X)(i, j) of a column-major operand: the stored element (i, j) for op N, (j, i) for op T.
double op_at(const LtOperand& op, const double* base, int64_t i, int64_t j) {
  return op.trans ? base[j + i * op.ld] : base[i + j * op.ld];
}

// What cublasLtMatmul computes for every call and batch entry of the plan: D (n x m, column-
// major, ld n) = op(A) (n x k) op(B) (k x m) with A over b's memory and B over a's. Checks the
// stored layouts the descriptors would carry along the way.
void run_like_cublaslt(const GemmPlan& p, const double* a, const double* b, double* c) {
  const int64_t M = p.n, N = p.m, K = p.k;
  const LtOperand& A = p.b_op;
  const LtOperand& B = p.a_op;
  // Stored shapes: A is (M x K) for op N and (K x M) for op T; B (K x N) or (N x K).
  EXPECT_EQ(A.rows, A.trans ? K : M);
  EXPECT_EQ(A.cols, A.trans ? M : K);
  EXPECT_EQ(B.rows, B.trans ? N : K);
  EXPECT_EQ(B.cols, B.trans ? K : N);
  EXPECT_GE(A.ld, std::max<int64_t>(1, A.rows));
  EXPECT_GE(B.ld, std::max<int64_t>(1, B.rows));
  for (int64_t call = 0; call < p.calls(); ++call) {
    int64_t oa, ob, oc;
    p.offsets(call, &oa, &ob, &oc);
    for (int64_t e = 0; e < p.batch; ++e) {
      const double* pa = b + ob + e * p.b_batch_stride;
      const double* pb = a + oa + e * p.a_batch_stride;
      double* pd = c + oc + e * p.c_batch_stride;
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          double acc = 0;
          for (int64_t q = 0; q < K; ++q) {
            acc += op_at(A, pa, i, q) * op_at(B, pb, q, j);
          }
          pd[i + j * M] = acc;
        }
      }
    }
  }
}

Dims batch_of(const Dims& shape) {
  Dims b = shape;
  b.resize(b.size() - 2);
  return b;
}

Dims with(Dims batch, int64_t r, int64_t c) {
  batch.push_back(r);
  batch.push_back(c);
  return batch;
}

// Plans and runs c = a @ b as the CUDA gemm kernel does (a contiguous copy of an operand the
// plan cannot read) and compares with matmul on the CPU. Returns the plan.
GemmPlan check_product(const Tensor& a_in, const Tensor& b_in) {
  const Tensor expected = matmul(a_in, b_in);
  const Dims batch = batch_of(expected.shape());
  const int64_t m = a_in.size(-2), k = a_in.size(-1), n = b_in.size(-1);
  Tensor a = a_in.expand(with(batch, m, k)), b = b_in.expand(with(batch, k, n));
  GemmPlan plan;
  bool a_fits = false, b_fits = false;
  if (!detail::plan_gemm(batch, m, n, k, a.strides(), b.strides(), &plan, &a_fits, &b_fits)) {
    if (!a_fits) a = a_in.contiguous().expand(with(batch, m, k));
    if (!b_fits) b = b_in.contiguous().expand(with(batch, k, n));
    EXPECT_TRUE(
        detail::plan_gemm(batch, m, n, k, a.strides(), b.strides(), &plan, &a_fits, &b_fits));
  }
  Tensor c = zeros(expected.shape(), kFloat64);
  run_like_cublaslt(plan, a.data<double>(), b.data<double>(), c.data<double>());
  EXPECT_TRUE(allclose(c, expected, 1e-12, 1e-12))
      << "a " << a_in.shape() << " strides " << a_in.strides() << ", b " << b_in.shape()
      << " strides " << b_in.strides();
  return plan;
}

Tensor random(const Dims& shape, uint64_t seed) {
  Generator gen(seed);
  return randn(shape, gen, kFloat64);
}

}  // namespace

TEST(GemmLayout, ContiguousMatricesAreReadAsStoredTransposes) {
  const GemmPlan p = check_product(random({3, 4}, 1), random({4, 5}, 2));
  EXPECT_FALSE(p.a_op.trans);
  EXPECT_FALSE(p.b_op.trans);
  EXPECT_EQ(p.a_op.ld, 4);
  EXPECT_EQ(p.b_op.ld, 5);
  EXPECT_EQ(p.calls(), 1);
  EXPECT_EQ(p.batch, 1);
}

TEST(GemmLayout, TransposedViewsBecomeTransposeOpsWithoutCopies) {
  // linear's x @ w.t() and its backward's g.t() @ x.
  const Tensor w = random({5, 4}, 3);
  Tensor a = random({3, 4}, 4);
  GemmPlan p = check_product(a, w.t());
  EXPECT_TRUE(p.b_op.trans);
  EXPECT_EQ(p.b_op.ld, 4);
  p = check_product(random({4, 3}, 5).t(), random({4, 5}, 6));
  EXPECT_TRUE(p.a_op.trans);
  EXPECT_EQ(p.a_op.ld, 3);
  check_product(random({4, 3}, 7).t(), random({5, 4}, 8).t());
}

TEST(GemmLayout, RowSlicesKeepTheirLeadingDimension) {
  const Tensor big = random({4, 9}, 9);
  const GemmPlan p = check_product(big.narrow(1, 2, 5), random({5, 3}, 10));
  EXPECT_FALSE(p.a_op.trans);
  EXPECT_EQ(p.a_op.ld, 9);
  check_product(random({6, 7}, 11).narrow(0, 1, 4).t(), random({6, 2}, 12).narrow(0, 1, 4));
}

TEST(GemmLayout, UniformBatchesAreOneStridedBatchedCall) {
  GemmPlan p = check_product(random({3, 2, 4}, 13), random({3, 4, 5}, 14));
  EXPECT_EQ(p.calls(), 1);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.a_batch_stride, 8);
  EXPECT_EQ(p.b_batch_stride, 20);
  EXPECT_EQ(p.c_batch_stride, 10);
  // Two batch dims that merge, with a size-1 dim between them.
  p = check_product(random({2, 1, 3, 2, 4}, 15), random({2, 1, 3, 4, 5}, 16));
  EXPECT_EQ(p.calls(), 1);
  EXPECT_EQ(p.batch, 6);
  // Attention's per-head products on transposed views: (B, H, T, d) @ (B, H, d, T).
  const Tensor q = random({2, 3, 4, 5}, 17);
  const Tensor kt = random({2, 3, 4, 5}, 18).transpose(-1, -2);
  p = check_product(q, kt);
  EXPECT_EQ(p.batch, 6);
  EXPECT_TRUE(p.b_op.trans);
}

TEST(GemmLayout, SharedRightOperandFoldsTheBatchIntoRows) {
  const GemmPlan p = check_product(random({2, 3, 4}, 19), random({4, 5}, 20));
  EXPECT_EQ(p.calls(), 1);
  EXPECT_EQ(p.batch, 1);
  EXPECT_EQ(p.m, 6);
  // Rows that do not run evenly (a batch slice) go to a batched call instead.
  const Tensor sliced = random({2, 5, 4}, 21).narrow(1, 0, 3);
  const GemmPlan q = check_product(sliced, random({4, 5}, 22));
  EXPECT_EQ(q.m, 3);
  EXPECT_EQ(q.batch, 2);
  EXPECT_EQ(q.b_batch_stride, 0);
}

TEST(GemmLayout, BroadcastAndPermutedBatchesLoopOverWhatDoesNotMerge) {
  // a broadcast along the inner batch dim, b along the outer one.
  GemmPlan p = check_product(random({2, 1, 3, 4}, 23), random({3, 4, 5}, 24));
  EXPECT_EQ(p.calls(), 2);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.a_batch_stride, 0);
  // Permuted batch dims: the inner one is a strided batch, the outer a loop.
  p = check_product(random({3, 2, 4, 5}, 25).transpose(0, 1), random({2, 3, 5, 2}, 26));
  EXPECT_EQ(p.calls(), 2);
  EXPECT_EQ(p.batch, 3);
  // Both broadcast: a over dim 0, b over dim 1.
  check_product(random({1, 3, 2, 4}, 27), random({2, 1, 4, 3}, 28));
}

TEST(GemmLayout, LayoutsCublasLtCannotReadAreCopied) {
  // An expanded column (both strides 0 or != 1) and a step of 2 in both directions.
  const Tensor col = random({3, 1}, 29).expand({3, 4});
  bool a_fits = true, b_fits = true;
  GemmPlan p;
  EXPECT_FALSE(detail::plan_gemm({}, 3, 5, 4, col.strides(), Dims{5, 1}, &p, &a_fits, &b_fits));
  EXPECT_FALSE(a_fits);
  EXPECT_TRUE(b_fits);
  check_product(col, random({4, 5}, 30));
  check_product(random({6, 8}, 31).slice(0, 0, 6, 2).slice(1, 0, 8, 2), random({4, 2}, 32));
}

TEST(GemmLayout, VectorsAndSizeOneDimsTakeAnyStride) {
  check_product(random({1, 4}, 33), random({4, 1}, 34));
  check_product(random({4, 7}, 35).narrow(1, 3, 1).t(), random({4, 6}, 36).slice(1, 0, 6, 3));
  check_product(random({3, 1}, 37), random({1, 5}, 38));
  check_product(random({2, 1, 4}, 39), random({2, 4, 1}, 40));
}
