// Datasets, transforms and the DataLoader: order under any number of workers, collation,
// exceptions from workers, shutdown mid-epoch, bounded prefetch, drop_last, wait accounting.
#include <atomic>
#include <chrono>
#include <thread>

#include "lockstep/data/dataloader.h"
#include "lockstep/tensor/cuda.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::data;
using lockstep::testing::expect_error;
using lockstep::testing::values;
using Indices = std::vector<int64_t>;
using namespace std::chrono_literals;

namespace {

// Example i: input (2, 3) filled with i + j / 10 for element j, target i (i64 scalar). Optional
// per-index delays (to make workers finish out of order), a failing index, and a get() counter.
class ProbeDataset : public Dataset {
 public:
  explicit ProbeDataset(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    calls_.fetch_add(1);
    if (i == fail_at_) throw Error("bad sample " + std::to_string(i), __FILE__, __LINE__);
    if (delay_) std::this_thread::sleep_for(delay_(i));
    Tensor x = empty({2, 3}, kFloat32);
    for (int64_t j = 0; j < 6; ++j) x.data<float>()[j] = static_cast<float>(i) + j / 10.0f;
    return {x, scalar_tensor(static_cast<double>(i), kInt64)};
  }

  int64_t fail_at_ = -1;
  std::function<std::chrono::microseconds(int64_t)> delay_;
  mutable std::atomic<int64_t> calls_{0};

 private:
  int64_t n_;
};

// Checks batch b: its samples are `expected`, in order, with the right values.
void expect_batch(const Batch& b, const Indices& expected, int64_t k) {
  const auto n = static_cast<int64_t>(expected.size());
  EXPECT_EQ(b.index, k);
  EXPECT_EQ(b.indices, expected);
  ASSERT_EQ(b.input.shape(), (Dims{n, 2, 3}));
  ASSERT_EQ(b.target.shape(), (Dims{n}));
  EXPECT_TRUE(b.input.is_contiguous());
  EXPECT_EQ(b.target.dtype(), kInt64);
  std::vector<double> x = values(b.input);
  for (int64_t s = 0; s < n; ++s) {
    EXPECT_EQ(b.target.at({s}), static_cast<double>(expected[s]));
    for (int64_t j = 0; j < 6; ++j)
      ASSERT_FLOAT_EQ(x[s * 6 + j], static_cast<float>(expected[s]) + j / 10.0f);
  }
}

// Every batch of one epoch, checked against the sampler's order.
void expect_epoch(DataLoader& loader, const Indices& order, int64_t batch, bool drop_last) {
  const auto n = static_cast<int64_t>(order.size());
  int64_t k = 0;
  for (Batch& b : loader) {
    const int64_t start = k * batch, end = std::min(n, start + batch);
    expect_batch(b, Indices(order.begin() + start, order.begin() + end), k);
    ++k;
  }
  EXPECT_EQ(k, drop_last ? n / batch : (n + batch - 1) / batch);
  EXPECT_EQ(k, loader.num_batches());
}

TEST(TensorDataset, GetReturnsViews) {
  Tensor x = arange(0.0, 24.0, 1.0, kFloat32).view({4, 2, 3});
  Tensor y = arange(4);
  TensorDataset ds(x, y);
  EXPECT_EQ(ds.size(), 4);
  Example e = ds.get(2);
  EXPECT_EQ(e.input.shape(), (Dims{2, 3}));
  EXPECT_EQ(e.target.dim(), 0);
  EXPECT_EQ(e.target.item(), 2.0);
  EXPECT_EQ(e.input.data_ptr(), static_cast<float*>(x.data_ptr()) + 12);
  e.input.set_at({0, 0}, -5.0);
  EXPECT_EQ(x.at({2, 0, 0}), -5.0);
  expect_error([&] { ds.get(4); }, {"index 4", "size 4"});
  expect_error([&] { ds.get(-1); }, {"index -1"});
  expect_error(
      [] {
        TensorDataset(zeros({3, 2}), zeros({4}));
      },
      {"same size in dim 0", "3", "[3, 2]", "4"});
}

TEST(Normalize, PerChannelAndSingleValue) {
  Tensor x = lockstep::testing::make({2, 2, 2}, [](int64_t i) { return double(i); });
  Tensor y = Normalize({1.0, 2.0}, {2.0, 4.0})(x);
  EXPECT_EQ(y.dtype(), kFloat32);
  EXPECT_EQ(values(y), (std::vector<double>{-0.5, 0, 0.5, 1, 0.5, 0.75, 1, 1.25}));
  Tensor u8 = full({3}, 255.0, kUInt8);
  EXPECT_EQ(values(Normalize({5.0}, {10.0})(u8)), (std::vector<double>{25, 25, 25}));
  // channel_dim 1 on a batch (N, C, L).
  Tensor batch = x.unsqueeze(0).expand({3, 2, 2, 2}).reshape({3, 2, 4});
  Tensor nb = Normalize({1.0, 2.0}, {2.0, 4.0}, 1)(batch);
  EXPECT_EQ(values(nb.select(0, 2)), values(y.reshape({2, 4})));
  expect_error([&] { Normalize({1, 2, 3}, {1, 1, 1})(x); }, {"3 channels in dim 0", "[2, 2, 2]"});
  expect_error([] { Normalize({1, 2}, {1}); }, {"same, non-zero number", "2 and 1"});
  expect_error([] { Normalize({1}, {0}); }, {"std must be non-zero"});
}

TEST(TransformDataset, AppliesPerSample) {
  auto base = std::make_shared<ProbeDataset>(5);
  auto ds = std::make_shared<TransformDataset>(base, Normalize({1.0}, {0.5}));
  EXPECT_EQ(ds->size(), 5);
  Example e = ds->get(3);
  EXPECT_FLOAT_EQ(e.input.at({0, 1}), (3.1 - 1.0) / 0.5);
  EXPECT_EQ(e.target.item(), 3.0);
  DataLoader loader(ds, std::make_shared<SequentialSampler>(5), {.batch_size = 5});
  Batch b = *loader.next();
  EXPECT_FLOAT_EQ(b.input.at({4, 1, 2}), (4.5 - 1.0) / 0.5);
}

TEST(DataLoader, OrderIsTheSamplersForAnyWorkerCount) {
  auto ds = std::make_shared<ProbeDataset>(103);
  // Later samples of a batch load faster, so workers finish batches out of order.
  ds->delay_ = [](int64_t i) { return std::chrono::microseconds((103 - i) % 7 * 150); };
  for (int64_t workers : {0, 1, 3}) {
    auto sampler = std::make_shared<DistributedSampler>(103, 2, 1, true, 11);
    DataLoader loader(ds, sampler, {.batch_size = 8, .num_workers = workers, .prefetch = 3});
    for (int64_t epoch : {0, 1}) {
      loader.set_epoch(epoch);
      SCOPED_TRACE("workers " + std::to_string(workers) + " epoch " + std::to_string(epoch));
      expect_epoch(loader, sampler->indices(), 8, false);
    }
  }
}

// pin_memory changes where batches live, never what they hold: pinned where a GPU is visible,
// ordinary memory where none is (pinning would buy nothing there).
TEST(DataLoader, PinMemoryBatchesHoldTheSameSamples) {
  auto ds = std::make_shared<ProbeDataset>(37);
  for (int64_t workers : {0, 2}) {
    auto sampler = std::make_shared<DistributedSampler>(37, 1, 0, true, 5);
    DataLoader loader(ds, sampler, {.batch_size = 8, .num_workers = workers, .pin_memory = true});
    SCOPED_TRACE("workers " + std::to_string(workers));
    expect_epoch(loader, sampler->indices(), 8, false);
    loader.set_epoch(1);
    for (Batch& b : loader) {
      EXPECT_EQ(b.input.is_pinned(), lockstep::cuda::is_available());
      EXPECT_EQ(b.target.is_pinned(), lockstep::cuda::is_available());
    }
  }
  // pin_memory() of a CPU tensor: equal values; of a pinned one: the same tensor.
  Tensor t = arange(0, 12, 1, kFloat32).reshape({3, 4});
  Tensor p = t.pin_memory();
  EXPECT_EQ(p.to_vector<float>(), t.to_vector<float>());
  EXPECT_EQ(p.is_pinned(), lockstep::cuda::is_available());
  if (p.is_pinned()) EXPECT_TRUE(p.pin_memory().is_same(p));
}

TEST(DataLoader, NextAndEpochBoundaries) {
  auto ds = std::make_shared<ProbeDataset>(10);
  auto sampler = std::make_shared<SequentialSampler>(10);
  DataLoader loader(ds, sampler, {.batch_size = 4, .num_workers = 2});
  EXPECT_EQ(loader.num_batches(), 3);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::optional<Batch> a = loader.next(), b = loader.next(), c = loader.next();
    ASSERT_TRUE(a && b && c);
    expect_batch(*c, {8, 9}, 2);  // the last, partial batch
    EXPECT_FALSE(loader.next().has_value());
  }
  // start_epoch() abandons the running epoch.
  loader.next();
  loader.start_epoch();
  expect_batch(*loader.next(), {0, 1, 2, 3}, 0);
}

TEST(DataLoader, DropLast) {
  auto ds = std::make_shared<ProbeDataset>(10);
  for (int64_t workers : {0, 2}) {
    DataLoader keep(ds, std::make_shared<SequentialSampler>(10),
                    {.batch_size = 4, .num_workers = workers});
    expect_epoch(keep, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, 4, false);
    DataLoader drop(ds, std::make_shared<SequentialSampler>(10),
                    {.batch_size = 4, .drop_last = true, .num_workers = workers});
    EXPECT_EQ(drop.num_batches(), 2);
    expect_epoch(drop, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, 4, true);
    DataLoader small(ds, std::make_shared<SequentialSampler>(3),
                     {.batch_size = 4, .drop_last = true, .num_workers = workers});
    EXPECT_FALSE(small.next().has_value());
  }
}

TEST(DataLoader, WorkerExceptionReachesTheConsumer) {
  for (int64_t workers : {0, 1, 3}) {
    auto ds = std::make_shared<ProbeDataset>(40);
    ds->fail_at_ = 21;
    DataLoader loader(ds, std::make_shared<SequentialSampler>(40),
                      {.batch_size = 5, .num_workers = workers, .prefetch = 4});
    for (int64_t k = 0; k < 4; ++k)
      expect_batch(*loader.next(), {5 * k, 5 * k + 1, 5 * k + 2, 5 * k + 3, 5 * k + 4}, k);
    try {
      loader.next();
      ADD_FAILURE() << "expected the dataset's error, workers " << workers;
    } catch (const Error& e) {
      EXPECT_EQ(e.message(), "bad sample 21");
    }
    // The failed epoch is over; a new one starts from batch 0.
    expect_batch(*loader.next(), {0, 1, 2, 3, 4}, 0);
  }
}

TEST(DataLoader, DestroyedMidEpochReturnsPromptly) {
  auto ds = std::make_shared<ProbeDataset>(10000);
  ds->delay_ = [](int64_t) { return 2ms; };
  for (int64_t workers : {1, 4}) {
    ds->calls_ = 0;
    auto t0 = std::chrono::steady_clock::now();
    {
      DataLoader loader(ds, std::make_shared<SequentialSampler>(10000),
                        {.batch_size = 64, .num_workers = workers, .prefetch = 8});
      ASSERT_TRUE(loader.next().has_value());  // ~128 ms of loading per batch
    }
    // Stopping waits only for the sample each worker has in hand, not for the batches in
    // flight: counted in samples read, which does not depend on how loaded the machine is.
    // Finishing the in-flight batches would read (1 + min(workers, 8)) * 64 or more.
    EXPECT_LT(ds->calls_.load(), 64 * (workers == 1 ? 2 : 6)) << "workers " << workers;
    // And no hang (a generous bound, not a speed requirement).
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 10.0) << "workers " << workers;
  }
  // Destroyed before anything was taken, and after the epoch started without a next().
  {
    DataLoader loader(ds, std::make_shared<SequentialSampler>(10000),
                      {.batch_size = 64, .num_workers = 3});
    loader.start_epoch();
  }
  { DataLoader loader(ds, std::make_shared<SequentialSampler>(10), {.num_workers = 3}); }
}

TEST(DataLoader, PrefetchIsBounded) {
  auto ds = std::make_shared<ProbeDataset>(1000);
  DataLoader loader(ds, std::make_shared<SequentialSampler>(1000),
                    {.batch_size = 10, .num_workers = 4, .prefetch = 3});
  ASSERT_TRUE(loader.next().has_value());
  // Wait (up to 10 s on a loaded machine) for the workers to fill the window, then give them
  // time to overrun it if they were going to.
  for (int i = 0; i < 1000 && ds->calls_.load() < 40; ++i) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(50ms);
  // The batch taken plus at most 3 ahead.
  EXPECT_EQ(ds->calls_.load(), 40);
}

TEST(DataLoader, CountsTimeWaitedForData) {
  auto ds = std::make_shared<ProbeDataset>(20);
  ds->delay_ = [](int64_t) { return 3ms; };
  DataLoader sync(ds, std::make_shared<SequentialSampler>(20), {.batch_size = 5});
  EXPECT_EQ(sync.wait_seconds(), 0.0);
  sync.next();
  EXPECT_GE(sync.wait_seconds(), 0.015);  // loading 5 samples on this thread
  sync.reset_wait_seconds();
  EXPECT_EQ(sync.wait_seconds(), 0.0);

  auto fast = std::make_shared<ProbeDataset>(20);
  DataLoader ahead(fast, std::make_shared<SequentialSampler>(20),
                   {.batch_size = 5, .num_workers = 2, .prefetch = 4});
  ahead.start_epoch();
  // "Compute" while the workers load everything (polling, so a loaded machine cannot flake it).
  for (int i = 0; i < 1000 && fast->calls_.load() < 20; ++i) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(20ms);
  for (int k = 0; k < 4; ++k) ASSERT_TRUE(ahead.next().has_value());
  EXPECT_LT(ahead.wait_seconds(), 0.015);  // ready batches cost a queue pop, not a load
}

TEST(DataLoader, CollatesNonContiguousSamplesAndRejectsMismatches) {
  Tensor x = arange(0.0, 24.0, 1.0, kFloat32).view({4, 3, 2}).transpose(1, 2);  // (4, 2, 3)
  auto ds = std::make_shared<TensorDataset>(x, arange(4));
  DataLoader loader(ds, std::make_shared<SequentialSampler>(4), {.batch_size = 4});
  Batch b = *loader.next();
  EXPECT_TRUE(b.input.is_contiguous());
  EXPECT_EQ(values(b.input), values(x));

  std::vector<Example> bad{{zeros({2}), scalar_tensor(0)}, {zeros({3}), scalar_tensor(1)}};
  expect_error([&] { collate(bad); }, {"input", "shape [3]", "first sample has shape [2]"});
  std::vector<Example> dt{{zeros({2}), scalar_tensor(0)}, {zeros({2}, kFloat64), scalar_tensor(1)}};
  expect_error([&] { collate(dt); }, {"dtype f64", "dtype f32"});
  Batch c =
      collate({{ones({2}), scalar_tensor(3, kInt64)}, {zeros({2}), scalar_tensor(4, kInt64)}});
  EXPECT_EQ(values(c.input), (std::vector<double>{1, 1, 0, 0}));
  EXPECT_EQ(values(c.target), (std::vector<double>{3, 4}));
}

TEST(DataLoader, ValidatesOptions) {
  auto ds = std::make_shared<ProbeDataset>(4);
  auto s = std::make_shared<SequentialSampler>(4);
  expect_error([&] { DataLoader(ds, s, {.batch_size = 0}); }, {"batch_size must be positive", "0"});
  expect_error([&] { DataLoader(ds, s, {.num_workers = -1}); }, {"num_workers", "-1"});
  expect_error([&] { DataLoader(ds, s, {.prefetch = 0}); }, {"prefetch must be positive"});
  expect_error([&] { DataLoader(nullptr, s); }, {"dataset is null"});
  DataLoader too_far(ds, std::make_shared<SequentialSampler>(6));
  expect_error([&] { too_far.next(); }, {"sampler yielded index 4", "size 4"});
}

TEST(DataLoader, CollatesMnistSizedBatches) {
  // 64 samples of (1, 28, 28) f32 from a TensorDataset, each copied once into the batch. How
  // fast that is, is measured by bench/train_bench (BM_Collate), not asserted here.
  auto ds = std::make_shared<TensorDataset>(arange(0.0, 4096.0 * 784, 1.0).view({4096, 1, 28, 28}),
                                            arange(4096));
  DataLoader loader(ds, std::make_shared<DistributedSampler>(4096, 1, 0), {.batch_size = 64});
  int64_t batches = 0;
  while (std::optional<Batch> b = loader.next()) {
    ASSERT_EQ(b->input.shape(), (Dims{64, 1, 28, 28}));
    ASSERT_TRUE(b->input.is_contiguous());
    for (int64_t j : {0, 63}) {
      const int64_t idx = b->indices[static_cast<size_t>(j)];
      ASSERT_EQ(b->target.at({j}), idx);
      ASSERT_EQ(b->input.at({j, 0, 27, 27}), idx * 784.0 + 783.0);
    }
    ++batches;
  }
  EXPECT_EQ(batches, 64);
}

}  // namespace
