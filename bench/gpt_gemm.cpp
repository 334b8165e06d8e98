// train_gpt's 15 f32 GEMM shapes (its default model: n_embd 128, 4C MLP, vocabulary 256, 2048
// tokens per rank): lockstep's matmul (oneDNN's brgemm where it runs, Note [f32 GEMM] in
// src/ops/cpu/bf16_gemm.cpp) against raw cblas_sgemm on the same operands, one thread.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include "lockstep/lockstep.h"

using namespace lockstep;

namespace {

constexpr int64_t kTokens = 2048;  // batch 16 x block 128 per rank
constexpr int64_t kC = 128;

// (m, n, k, a transposed, b transposed): forward x w^T, input gradient g w, weight gradient g^T x.
struct Shape {
  int64_t m, n, k;
  bool ta, tb;
};

Shape shape_of(int64_t index) {
  const int64_t outs[] = {3 * kC, kC, 4 * kC, kC, 256};  // c_attn, c_proj, c_fc, mlp c_proj, head
  const int64_t ins[] = {kC, kC, kC, 4 * kC, kC};
  const int64_t layer = index % 5, kind = index / 5, out = outs[layer], in = ins[layer];
  if (kind == 0) return {kTokens, out, in, false, true};  // y = x w^T
  if (kind == 1) return {kTokens, in, out, false, false};  // dx = g w
  return {out, in, kTokens, true, false};                  // dw = g^T x
}

Tensor operand(int64_t rows, int64_t cols, bool trans, Generator& g) {
  return trans ? randn({cols, rows}, g).t() : randn({rows, cols}, g);
}

void BM_GptGemmLockstep(benchmark::State& state) {
  const Shape s = shape_of(state.range(0));
  set_num_threads(1);
  Generator g(0);
  const Tensor a = operand(s.m, s.k, s.ta, g), b = operand(s.k, s.n, s.tb, g);
  NoGradGuard no_grad;
  for (auto _ : state) benchmark::DoNotOptimize(matmul(a, b).data_ptr());
  state.counters["GFLOP/s"] =
      benchmark::Counter(2e-9 * s.m * s.n * s.k, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_GptGemmOpenBlas(benchmark::State& state) {
  const Shape s = shape_of(state.range(0));
  set_num_threads(1);
  Generator g(0);
  const Tensor a = operand(s.m, s.k, s.ta, g), b = operand(s.k, s.n, s.tb, g);
  Tensor c = empty({s.m, s.n});
  const int lda = static_cast<int>(s.ta ? s.m : s.k), ldb = static_cast<int>(s.tb ? s.k : s.n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans,
                static_cast<int>(s.m), static_cast<int>(s.n), static_cast<int>(s.k), 1.0f,
                a.data<float>(), lda, b.data<float>(), ldb, 0.0f, c.data<float>(),
                static_cast<int>(s.n));
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2e-9 * s.m * s.n * s.k, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

// 0-4 forward (c_attn, c_proj, c_fc, mlp c_proj, head), 5-9 input gradients, 10-14 weight ones.
BENCHMARK(BM_GptGemmLockstep)->DenseRange(0, 14);
BENCHMARK(BM_GptGemmOpenBlas)->DenseRange(0, 14);
BENCHMARK_MAIN();
