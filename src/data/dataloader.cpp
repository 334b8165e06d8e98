// DataLoader: worker threads claim batch numbers, collate into preallocated tensors, and hand
// them over in order through a bounded window.
#include "lockstep/data/dataloader.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

namespace lockstep::data {

namespace {

using Clock = std::chrono::steady_clock;

// Shape of a batch of n samples shaped like `sample`.
Dims batch_shape(int64_t n, const Tensor& sample) {
  Dims shape = sample.shape();
  shape.insert(0, n);
  return shape;
}

// Copies `sample` into row i of `batch`; the row's shape and dtype must match exactly (copy_
// would broadcast or convert, hiding a dataset whose samples disagree).
void copy_row(const Tensor& batch, int64_t i, const Tensor& sample, const char* what,
              int64_t dataset_index) {
  LS_CHECK(sample.defined(), "DataLoader: the ", what, " of dataset index ", dataset_index,
           " is an undefined tensor");
  // batch is (B, ...) where ... is the first sample's shape.
  bool same_shape = sample.dim() + 1 == batch.dim();
  for (int64_t d = 0; same_shape && d < sample.dim(); ++d)
    same_shape = sample.size(d) == batch.size(d + 1);
  if (!same_shape || sample.dtype() != batch.dtype()) {
    Dims expected = batch.shape();
    expected.erase(0);
    LS_THROW("DataLoader: cannot collate: the ", what, " of dataset index ", dataset_index,
             " has shape ", sample.shape().str(), " and dtype ", dtype_name(sample.dtype()),
             ", but the batch's first sample has shape ", expected.str(), " and dtype ",
             dtype_name(batch.dtype()));
  }
  LS_CHECK(sample.device().is_cpu(), "DataLoader: the ", what, " of dataset index ", dataset_index,
           " is on ", sample.device().str(), "; datasets must yield CPU tensors");
  const int64_t bytes = sample.nbytes();
  if (sample.is_contiguous()) {
    if (bytes > 0) {
      std::memcpy(static_cast<char*>(batch.data_ptr()) + i * bytes, sample.data_ptr(),
                  static_cast<size_t>(bytes));
    }
  } else {
    batch.select(0, i).copy_(sample);
  }
}

// Loads dataset[indices[0..n)] straight into a fresh batch. Returns nullopt when `stop` is
// raised partway (the loader is shutting down).
std::optional<Batch> load_batch(const Dataset& dataset, const int64_t* indices, int64_t n,
                                const std::atomic<bool>* stop, bool pin) {
  Batch b;
  b.indices.assign(indices, indices + n);
  for (int64_t i = 0; i < n; ++i) {
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) return std::nullopt;
    Example e = dataset.get(indices[i]);
    LS_CHECK(e.input.defined() && e.target.defined(), "DataLoader: dataset index ", indices[i],
             " returned an example with an undefined input or target");
    if (i == 0) {
      // pin_memory: page-locked, so the copy to a GPU is one asynchronous DMA.
      b.input = pin ? empty_pinned(batch_shape(n, e.input), e.input.dtype())
                    : empty(batch_shape(n, e.input), e.input.dtype());
      b.target = pin ? empty_pinned(batch_shape(n, e.target), e.target.dtype())
                     : empty(batch_shape(n, e.target), e.target.dtype());
    }
    copy_row(b.input, i, e.input, "input", indices[i]);
    copy_row(b.target, i, e.target, "target", indices[i]);
  }
  return b;
}

}  // namespace

Batch collate(const std::vector<Example>& examples) {
  LS_CHECK(!examples.empty(), "collate: no examples to stack");
  const int64_t n = static_cast<int64_t>(examples.size());
  Batch b;
  b.input = empty(batch_shape(n, examples[0].input), examples[0].input.dtype());
  b.target = empty(batch_shape(n, examples[0].target), examples[0].target.dtype());
  for (int64_t i = 0; i < n; ++i) {
    copy_row(b.input, i, examples[i].input, "input", i);
    copy_row(b.target, i, examples[i].target, "target", i);
  }
  return b;
}

// One epoch in flight. Workers claim batch numbers in order, at most `prefetch` ahead of the
// consumer, and post results (a batch or the exception that stopped it) under their number;
// the consumer takes number after number, so the order never depends on the workers' timing.
struct DataLoader::Epoch {
  struct Result {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };

  const Dataset* dataset = nullptr;
  std::vector<int64_t> indices;
  int64_t batch_size = 1;
  int64_t num_batches = 0;
  int64_t prefetch = 1;
  bool pin_memory = false;

  std::mutex mu;
  std::condition_variable room;   // workers: a batch number may be claimed
  std::condition_variable ready;  // consumer: a result was posted
  int64_t next_claim = 0;         // guarded by mu
  int64_t next_deliver = 0;       // guarded by mu (written only by the consumer)
  std::map<int64_t, Result> results;
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;

  ~Epoch() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    room.notify_all();
    for (std::thread& t : workers) {
      if (t.joinable()) t.join();
    }
  }

  int64_t batch_begin(int64_t k) const { return k * batch_size; }
  int64_t batch_length(int64_t k) const {
    return std::min<int64_t>(batch_size, static_cast<int64_t>(indices.size()) - k * batch_size);
  }

  void work() {
    for (;;) {
      int64_t k;
      {
        std::unique_lock<std::mutex> lock(mu);
        room.wait(lock, [&] {
          return stop || next_claim >= num_batches || next_claim < next_deliver + prefetch;
        });
        if (stop || next_claim >= num_batches) return;
        k = next_claim++;
      }
      Result r;
      try {
        r.batch = load_batch(*dataset, indices.data() + batch_begin(k), batch_length(k), &stop,
                             pin_memory);
        if (!r.batch) return;  // stopping
        r.batch->index = k;
      } catch (...) {
        r.error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        results.emplace(k, std::move(r));
      }
      ready.notify_one();
    }
  }
};

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
                       DataLoaderOptions options)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), options_(options) {
  LS_CHECK(dataset_ != nullptr, "DataLoader: the dataset is null");
  LS_CHECK(sampler_ != nullptr, "DataLoader: the sampler is null");
  LS_CHECK(options_.batch_size > 0, "DataLoader: batch_size must be positive, got ",
           options_.batch_size);
  LS_CHECK(options_.num_workers >= 0, "DataLoader: num_workers must be >= 0, got ",
           options_.num_workers);
  LS_CHECK(options_.prefetch > 0, "DataLoader: prefetch must be positive, got ", options_.prefetch);
}

DataLoader::~DataLoader() { stop_epoch(); }

void DataLoader::stop_epoch() { epoch_.reset(); }

int64_t DataLoader::num_batches() const {
  const int64_t n = sampler_->num_samples();
  const int64_t b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

void DataLoader::set_epoch(int64_t epoch) { sampler_->set_epoch(epoch); }

void DataLoader::start_epoch() {
  stop_epoch();
  auto e = std::make_unique<Epoch>();
  e->dataset = dataset_.get();
  e->indices = sampler_->indices();
  e->batch_size = options_.batch_size;
  const auto n = static_cast<int64_t>(e->indices.size());
  e->num_batches = options_.drop_last ? n / e->batch_size : (n + e->batch_size - 1) / e->batch_size;
  e->prefetch = options_.prefetch;
  e->pin_memory = options_.pin_memory;
  for (const int64_t i : e->indices) {
    LS_CHECK(i >= 0 && i < dataset_->size(), "DataLoader: the sampler yielded index ", i,
             " for a dataset of size ", dataset_->size());
  }
  // If a thread fails to start, ~Epoch joins the ones that did.
  const int64_t workers = std::min(options_.num_workers, e->num_batches);
  for (int64_t w = 0; w < workers; ++w) e->workers.emplace_back([ep = e.get()] { ep->work(); });
  epoch_ = std::move(e);
}

std::optional<Batch> DataLoader::next() {
  if (!epoch_) start_epoch();
  Epoch& e = *epoch_;
  if (e.next_deliver >= e.num_batches) {
    stop_epoch();
    return std::nullopt;
  }
  const int64_t k = e.next_deliver;
  const auto t0 = Clock::now();
  Epoch::Result r;
  if (options_.num_workers == 0) {
    try {
      r.batch =
          load_batch(*dataset_, e.indices.data() + e.batch_begin(k), e.batch_length(k), nullptr,
                     e.pin_memory);
      r.batch->index = k;
    } catch (...) {
      r.error = std::current_exception();
    }
    ++e.next_deliver;
  } else {
    std::unique_lock<std::mutex> lock(e.mu);
    e.ready.wait(lock, [&] { return e.results.count(k) != 0; });
    auto it = e.results.find(k);
    r = std::move(it->second);
    e.results.erase(it);
    ++e.next_deliver;
    lock.unlock();
    e.room.notify_all();
  }
  wait_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  if (r.error) {
    stop_epoch();
    std::rethrow_exception(r.error);
  }
  return std::move(r.batch);
}

DataLoader::Iterator::Iterator(DataLoader* loader) : loader_(loader), current_(loader->next()) {}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  current_ = loader_->next();
  return *this;
}

DataLoader::Iterator DataLoader::begin() {
  start_epoch();
  return Iterator(this);
}

}  // namespace lockstep::data
