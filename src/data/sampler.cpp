// SequentialSampler, DistributedSampler and the Philox-driven permutation they shuffle with.
#include "lockstep/data/sampler.h"

#include <algorithm>
#include <numeric>

#include "lockstep/base/error.h"
#include "lockstep/tensor/generator.h"

namespace lockstep::data {

namespace {

// Uniform in [0, bound) without modulo bias: reject the top partial range of 64-bit draws.
uint64_t uniform_below(Generator& gen, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t x;
  do {
    x = gen.next_u64();
  } while (x >= limit);
  return x % bound;
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

}  // namespace

std::vector<int64_t> random_permutation(int64_t size, uint64_t seed) {
  LS_CHECK(size >= 0, "random_permutation: size must be >= 0, got ", size);
  std::vector<int64_t> perm = iota(size);
  Generator gen(seed);
  for (int64_t i = size - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(uniform_below(gen, static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

SequentialSampler::SequentialSampler(int64_t size) : size_(size) {
  LS_CHECK(size >= 0, "SequentialSampler: size must be >= 0, got ", size);
}

std::vector<int64_t> SequentialSampler::indices() const { return iota(size_); }

DistributedSampler::DistributedSampler(int64_t size, int64_t num_replicas, int64_t rank,
                                       bool shuffle, uint64_t seed, bool drop_last)
    : DistributedSampler(size, DistributedSamplerOptions{.num_replicas = num_replicas,
                                                         .rank = rank,
                                                         .shuffle = shuffle,
                                                         .seed = seed,
                                                         .drop_last = drop_last,
                                                         .pad = true}) {}

DistributedSampler::DistributedSampler(int64_t size, const DistributedSamplerOptions& options)
    : size_(size), options_(options) {
  const int64_t r = options.num_replicas;
  LS_CHECK(size >= 0, "DistributedSampler: dataset size must be >= 0, got ", size);
  LS_CHECK(r > 0, "DistributedSampler: num_replicas must be positive, got num_replicas=", r,
           " (rank=", options.rank, ")");
  LS_CHECK(options.rank >= 0 && options.rank < r,
           "DistributedSampler: rank must be in [0, num_replicas), got rank=", options.rank,
           " with num_replicas=", r);
  LS_CHECK(options.pad || !options.drop_last,
           "DistributedSampler: drop_last needs pad=true (without padding nothing is dropped "
           "or repeated); got drop_last=true, pad=false");
  count();
}

void DistributedSampler::count() {
  const int64_t r = options_.num_replicas;
  const int64_t left = size_ - std::min(start_, size_);
  if (!options_.pad) {
    num_samples_ = left > options_.rank ? (left - options_.rank + r - 1) / r : 0;
    total_size_ = left;
  } else {
    // As torch: with drop_last the tail that does not fill a round of ranks is dropped.
    num_samples_ = options_.drop_last && left % r != 0 ? left / r : (left + r - 1) / r;
    total_size_ = num_samples_ * r;
  }
}

void DistributedSampler::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  start_ = 0;
  count();
}

void DistributedSampler::set_start_index(int64_t consumed) {
  LS_CHECK(consumed >= 0, "DistributedSampler::set_start_index: consumed must be >= 0, got ",
           consumed);
  start_ = consumed;
  count();
}

std::vector<int64_t> DistributedSampler::indices() const {
  const std::vector<int64_t> perm =
      options_.shuffle ? random_permutation(size_, options_.seed + static_cast<uint64_t>(epoch_))
                       : iota(size_);
  // The positions not yet consumed, padded by repeating the permutation from its start
  // (cyclically when it is shorter than the padding), or truncated for drop_last.
  std::vector<int64_t> order(perm.begin() + std::min(start_, size_), perm.end());
  order.reserve(static_cast<size_t>(std::max<int64_t>(total_size_, order.size())));
  for (int64_t k = 0; static_cast<int64_t>(order.size()) < total_size_; ++k)
    order.push_back(perm[k % size_]);
  order.resize(static_cast<size_t>(total_size_));

  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t p = options_.rank; p < total_size_; p += options_.num_replicas)
    mine.push_back(order[p]);
  LS_CHECK(static_cast<int64_t>(mine.size()) == num_samples_,
           "DistributedSampler: internal error: built ", mine.size(), " indices, expected ",
           num_samples_);
  return mine;
}

}  // namespace lockstep::data
