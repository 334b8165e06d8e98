// Training-step throughput of the Fashion-MNIST MLP and CNN at batch 64 with 1 and 2 threads,
// fed by the DataLoader, and the share of each step spent waiting for data (should be ~0).
#include <benchmark/benchmark.h>

#include <chrono>

#include "fashion_mnist_models.h"
#include "lockstep/data/data.h"
#include "lockstep/lockstep.h"

using namespace lockstep;

namespace {

constexpr int64_t kBatch = 64;

std::shared_ptr<data::MnistDataset> train_set() {
  static auto ds = data::load_mnist(data::kDefaultFashionMnistDir, data::Split::kTrain,
                                    {.normalize = true});
  return ds;
}

// args: model (0 mlp, 1 cnn), threads
void BM_TrainStep(benchmark::State& state) {
  const std::string kind = state.range(0) == 0 ? "mlp" : "cnn";
  const int threads = static_cast<int>(state.range(1));
  const int saved = get_num_threads();
  set_num_threads(threads);
  auto ds = train_set();
  Generator gen(0);
  auto model = examples::build_fashion_mnist_model(kind, gen);
  optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  auto sampler = std::make_shared<data::DistributedSampler>(ds->size(), 1, 0);
  data::DataLoader loader(ds, sampler, {.batch_size = kBatch, .num_workers = 1, .prefetch = 4});
  auto step = [&](const data::Batch& b) {
    Tensor loss = cross_entropy(model->forward(b.input), b.target);
    opt.zero_grad();
    loss.backward();
    opt.step();
    benchmark::DoNotOptimize(loss.item());
  };
  for (int i = 0; i < 5; ++i) step(*loader.next());  // warm the allocator cache
  loader.reset_wait_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    std::optional<data::Batch> b = loader.next();
    if (!b) b = loader.next();  // epoch boundary
    step(*b);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  state.counters["samples/s"] =
      benchmark::Counter(static_cast<double>(kBatch), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["data_wait_%"] = 100.0 * loader.wait_seconds() / secs;
  state.SetLabel(kind + " threads=" + std::to_string(threads));
  set_num_threads(saved);
}

// Collating a batch of 64 Fashion-MNIST images on the calling thread (num_workers 0).
void BM_Collate(benchmark::State& state) {
  auto ds = train_set();
  data::DataLoader loader(ds, std::make_shared<data::DistributedSampler>(ds->size(), 1, 0),
                          {.batch_size = kBatch});
  for (auto _ : state) {
    std::optional<data::Batch> b = loader.next();
    if (!b) b = loader.next();
    benchmark::DoNotOptimize(b->input.data_ptr());
  }
  state.counters["samples/s"] =
      benchmark::Counter(static_cast<double>(kBatch), benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(BM_Collate)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_TrainStep)
    ->ArgNames({"model", "threads"})
    ->Args({0, 1})->Args({0, 2})->Args({1, 1})->Args({1, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(3.0);

BENCHMARK_MAIN();
