// Op benchmarks: linear vs raw cblas_sgemm, a square sgemm, fused attention vs its composition,
// conv2d, cross_entropy, layer_norm, a 16M-float elementwise op vs memcpy, and the per-op
// overhead of a 1-element op with autograd recording.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "lockstep/lockstep.h"
#include "ops/cpu/attention_avx2.h"

using namespace lockstep;

namespace {

constexpr int64_t kBatch = 64;
constexpr int64_t kLargeElements = int64_t{16} << 20;  // 16M floats = 64 MiB

void set_gflops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// args: in, out
void BM_RawSgemm(benchmark::State& state) {
  const int64_t in = state.range(0), out = state.range(1);
  Generator g(0);
  Tensor x = randn({kBatch, in}, g), w = randn({out, in}, g), y = empty({kBatch, out});
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kBatch, out, in, 1.0f, x.data<float>(),
                in, w.data<float>(), in, 0.0f, y.data<float>(), out);
    benchmark::ClobberMemory();
  }
  set_gflops(state, 2.0 * kBatch * in * out);
}

void BM_Linear(benchmark::State& state) {
  const int64_t in = state.range(0), out = state.range(1);
  Generator g(0);
  Tensor x = randn({kBatch, in}, g), w = randn({out, in}, g), b = randn({out}, g);
  NoGradGuard no_grad;
  for (auto _ : state) {
    Tensor y = linear(x, w, b);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  set_gflops(state, 2.0 * kBatch * in * out);
}

void BM_LinearForwardBackward(benchmark::State& state) {
  const int64_t in = state.range(0), out = state.range(1);
  Generator g(0);
  Tensor x = randn({kBatch, in}, g);
  Tensor w = randn({out, in}, g).requires_grad_(), b = randn({out}, g).requires_grad_();
  for (auto _ : state) {
    w.set_grad(Tensor());
    b.set_grad(Tensor());
    sum(linear(x, w, b)).backward();
    benchmark::DoNotOptimize(w.grad().data_ptr());
  }
  set_gflops(state, 3 * 2.0 * kBatch * in * out);
}

// The Fashion-MNIST CNN's layers at batch 64: args Cin, Cout, H.
void BM_Conv2d(benchmark::State& state) {
  const int64_t cin = state.range(0), cout = state.range(1), h = state.range(2);
  Generator g(0);
  Tensor x = randn({kBatch, cin, h, h}, g), w = randn({cout, cin, 3, 3}, g), b = randn({cout}, g);
  NoGradGuard no_grad;
  for (auto _ : state) {
    Tensor y = conv2d(x, w, b);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  const int64_t ho = h - 2;
  set_gflops(state, 2.0 * kBatch * cout * ho * ho * cin * 9);
}

void BM_CrossEntropy(benchmark::State& state) {
  const int64_t n = state.range(0), c = state.range(1);
  Generator g(0);
  Tensor logits = randn({n, c}, g).requires_grad_();
  Tensor targets = randint(0, c, {n}, g);
  for (auto _ : state) {
    logits.set_grad(Tensor());
    cross_entropy(logits, targets).backward();
    benchmark::DoNotOptimize(logits.grad().data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * n * c * 4 * 3);
}

void BM_LayerNorm(benchmark::State& state) {
  const int64_t rows = state.range(0), dim = state.range(1);
  Generator g(0);
  Tensor x = randn({rows, dim}, g), w = ones({dim}), b = zeros({dim});
  NoGradGuard no_grad;
  for (auto _ : state) {
    Tensor y = layer_norm(x, {dim}, w, b);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * rows * dim * 4 * 2);
}

// The machine's GEMM peak as this build reaches it: one square sgemm, large enough that BLAS
// runs at full speed on every thread. args: n.
void BM_SquareSgemm(benchmark::State& state) {
  const int64_t n = state.range(0);
  Generator g(0);
  Tensor a = randn({n, n}, g), b = randn({n, n}, g), c = empty({n, n});
  const int ni = static_cast<int>(n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0f, a.data<float>(), ni,
                b.data<float>(), ni, 0.0f, c.data<float>(), ni);
    benchmark::ClobberMemory();
  }
  set_gflops(state, 2.0 * n * n * n);
}

// Attention at GPT-2-small-like head shapes: (B, H, T, D) = (8, 4, T, 32). The FLOPs counted are
// those of the math, not of what a kernel executes: 2 products of 2 T^2 D each per head in the
// forward, 4 more in the backward (the fused backward's recomputed q k^T is not counted), and
// only the pairs (i, j <= i) when causal. args: T, causal, fused (1) or naive composition (0),
// backward too (1), and zmm: the fused kernel's softmax exps on AVX-512 lanes where the CPU has
// them (1) or on AVX2 ones (0) (Note [Attention exps on AVX-512]).
constexpr int64_t kAttnBatch = 8, kAttnHeads = 4, kAttnDim = 32;

void BM_Attention(benchmark::State& state) {
  const int64_t t = state.range(0);
  const bool causal = state.range(1) != 0, fused = state.range(2) != 0,
             backward = state.range(3) != 0;
  cpu::set_attention_avx512(state.range(4) != 0);
  Generator g(0);
  const Dims shape{kAttnBatch, kAttnHeads, t, kAttnDim};
  Tensor q = randn(shape, g), k = randn(shape, g), v = randn(shape, g);
  Tensor mask = gt(arange(t, kFloat32).view({1, t}), arange(t, kFloat32).view({t, 1}));
  if (backward) {
    q.requires_grad_();
    k.requires_grad_();
    v.requires_grad_();
  }
  auto run = [&] {
    if (fused) return scaled_dot_product_attention(q, k, v, {.is_causal = causal});
    Tensor s = mul(matmul(q, k.transpose(-2, -1)), 1.0 / std::sqrt(double(kAttnDim)));
    if (causal) s = masked_fill(s, mask, -INFINITY);
    return matmul(softmax(s, -1), v);
  };
  for (auto _ : state) {
    if (backward) {
      sum(run()).backward();
      for (Tensor* t : {&q, &k, &v}) t->set_grad(Tensor());
    } else {
      NoGradGuard no_grad;
      Tensor y = run();
      benchmark::DoNotOptimize(y.data_ptr());
    }
  }
  const double pairs = causal ? t * (t + 1) / 2.0 : double(t) * t;
  set_gflops(state, (backward ? 6.0 : 2.0) * 2.0 * kAttnBatch * kAttnHeads * pairs * kAttnDim);
  cpu::set_attention_avx512(true);
}

// Bandwidth is bytes read plus bytes written, for memcpy as for the ops.
void BM_Memcpy(benchmark::State& state) {
  Tensor a = ones({kLargeElements}), b = empty({kLargeElements});
  for (auto _ : state) {
    std::memcpy(b.data_ptr(), a.data_ptr(), static_cast<size_t>(a.nbytes()));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kLargeElements * 4 * 2);
}

void BM_MulScalarLarge(benchmark::State& state) {
  Tensor a = ones({kLargeElements});
  NoGradGuard no_grad;
  for (auto _ : state) {
    Tensor y = mul(a, 1.5);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * kLargeElements * 4 * 2);
}

void BM_AddLarge(benchmark::State& state) {
  Tensor a = ones({kLargeElements}), b = ones({kLargeElements});
  NoGradGuard no_grad;
  for (auto _ : state) {
    Tensor y = add(a, b);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * kLargeElements * 4 * 3);
}

// One-element add of a tensor that requires grad: allocation, dispatch and graph recording.
void BM_TinyAddWithAutograd(benchmark::State& state) {
  Tensor a = ones({1}).requires_grad_(), b = ones({1});
  for (auto _ : state) {
    Tensor y = add(a, b);
    benchmark::DoNotOptimize(y.data_ptr());
  }
}

void BM_TinyAddNoGrad(benchmark::State& state) {
  Tensor a = ones({1}), b = ones({1});
  for (auto _ : state) {
    Tensor y = add(a, b);
    benchmark::DoNotOptimize(y.data_ptr());
  }
}

}  // namespace

BENCHMARK(BM_RawSgemm)->Args({784, 1024})->Args({1024, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_Linear)->Args({784, 1024})->Args({1024, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_LinearForwardBackward)->Args({784, 1024})->Args({1024, 1024})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_Conv2d)->Args({1, 32, 28})->Args({32, 64, 13})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_CrossEntropy)->Args({64, 10})->Args({512, 1000})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_LayerNorm)->Args({64, 1024})->Args({4096, 768})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_SquareSgemm)->Arg(1024)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_Attention)
    ->ArgNames({"T", "causal", "fused", "bwd", "zmm"})
    ->Args({128, 1, 1, 0, 1})->Args({128, 1, 1, 0, 0})->Args({128, 0, 1, 0, 1})
    ->Args({128, 1, 0, 0, 1})->Args({128, 1, 1, 1, 1})->Args({128, 1, 1, 1, 0})
    ->Args({128, 1, 0, 1, 1})->Args({1024, 1, 1, 0, 1})->Args({1024, 1, 1, 0, 0})
    ->Args({1024, 1, 0, 0, 1})
    ->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MulScalarLarge)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AddLarge)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TinyAddWithAutograd)->UseRealTime();
BENCHMARK(BM_TinyAddNoGrad)->UseRealTime();

BENCHMARK_MAIN();
