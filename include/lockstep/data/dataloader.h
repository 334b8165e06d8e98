// DataLoader: batches from a Dataset in a Sampler's order, collated on background threads.
#pragma once

#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

#include "lockstep/data/dataset.h"
#include "lockstep/data/sampler.h"

namespace lockstep::data {

struct DataLoaderOptions {
  int64_t batch_size = 1;
  // Drop a last batch smaller than batch_size.
  bool drop_last = false;
  // 0 loads each batch on the thread that calls next(); n > 0 loads on n background threads.
  int64_t num_workers = 0;
  // Bound on batches loaded ahead of the consumer (being collated or ready, not yet taken).
  // Memory held is at most this many batches; with num_workers > prefetch, the extra workers
  // idle. Ignored when num_workers is 0.
  int64_t prefetch = 2;
  // Collate into page-locked (pinned) host memory, so that batch.input.to(cuda) is one
  // asynchronous DMA with no staging copy (PyTorch's pin_memory). Ordinary memory where no GPU
  // is visible (empty_pinned).
  bool pin_memory = false;
};

// Samples stacked along a new dim 0: input (B, ...), target (B, ...), both contiguous.
struct Batch {
  Tensor input;
  Tensor target;
  int64_t index = 0;             // position of this batch in its epoch
  std::vector<int64_t> indices;  // the dataset indices it holds, in order
};

// Batch k of an epoch always holds sampler positions [k * B, (k + 1) * B), whatever
// num_workers is: workers may finish out of order, the consumer receives batches in order.
//
// An epoch starts at the first next() after construction or after the previous epoch ended,
// or at begin(); it takes the sampler's indices() at that moment, so call set_epoch(e) before.
// An exception thrown while loading batch k (by Dataset::get or collation) is rethrown, as the
// same exception object, by the next() that would have returned batch k; that epoch ends.
// Destroying the loader, or starting a new epoch, mid-epoch stops the workers and joins them
// (each finishes at most the sample it is reading).
//
// Use from one thread: next() and iteration are not safe to call concurrently.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
             DataLoaderOptions options = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next batch of the current epoch (starting one if none is running), or nullopt when the
  // epoch is over; the call after that starts the next epoch.
  std::optional<Batch> next();
  // Abandons the running epoch, if any, and starts a new one.
  void start_epoch();
  // Forwards to the sampler; takes effect at the next epoch start.
  void set_epoch(int64_t epoch);

  // Batches per epoch.
  int64_t num_batches() const;
  int64_t batch_size() const { return options_.batch_size; }
  const Dataset& dataset() const { return *dataset_; }
  Sampler& sampler() const { return *sampler_; }
  const DataLoaderOptions& options() const { return options_; }

  // Total seconds spent inside next() waiting for a batch (with num_workers 0: loading it),
  // over the loader's life; a benchmark divides it by the step time to get the share of the
  // step spent waiting for data.
  double wait_seconds() const { return wait_seconds_; }
  void reset_wait_seconds() { wait_seconds_ = 0.0; }

  // Range-for over one epoch: `for (Batch& b : loader)`. begin() starts a new epoch.
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = Batch*;
    using reference = Batch&;

    Iterator() = default;
    Batch& operator*() { return *current_; }
    Batch* operator->() { return &*current_; }
    Iterator& operator++();
    bool operator==(const Iterator& other) const {
      return current_.has_value() == other.current_.has_value();
    }

   private:
    friend class DataLoader;
    explicit Iterator(DataLoader* loader);
    DataLoader* loader_ = nullptr;
    std::optional<Batch> current_;
  };
  Iterator begin();
  Iterator end() { return Iterator(); }

 private:
  struct Epoch;  // one epoch's indices, worker threads and queue
  void stop_epoch();

  std::shared_ptr<const Dataset> dataset_;
  std::shared_ptr<Sampler> sampler_;
  DataLoaderOptions options_;
  std::unique_ptr<Epoch> epoch_;
  double wait_seconds_ = 0.0;
};

// Stacks examples into one batch: input (n, ...) and target (n, ...), each sample copied once
// into the preallocated result. All inputs must share shape and dtype, likewise all targets.
Batch collate(const std::vector<Example>& examples);

}  // namespace lockstep::data
