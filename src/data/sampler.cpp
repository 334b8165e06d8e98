// SequentialSampler, DistributedSampler and the Philox-driven permutation they shuffle with.
#include "lockstep/data/sampler.h"

#include <algorithm>
#include <numeric>

#include "lockstep/error.h"
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
  if (!options.pad) {
    num_samples_ = size > options.rank ? (size - options.rank + r - 1) / r : 0;
    total_size_ = size;
  } else {
    // As torch: with drop_last the tail that does not fill a round of ranks is dropped.
    num_samples_ = options.drop_last && size % r != 0 ? size / r : (size + r - 1) / r;
    total_size_ = num_samples_ * r;
  }
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order =
      options_.shuffle ? random_permutation(size_, options_.seed + static_cast<uint64_t>(epoch_))
                       : iota(size_);
  // Pad by repeating the permutation from its start (cyclically when it is shorter than the
  // padding), or truncate for drop_last.
  order.reserve(static_cast<size_t>(std::max(total_size_, size_)));
  for (int64_t k = 0; static_cast<int64_t>(order.size()) < total_size_; ++k)
    order.push_back(order[k % size_]);
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
