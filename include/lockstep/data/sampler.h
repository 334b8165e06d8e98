// Samplers: which dataset indices a process reads each epoch, in what order (DistributedSampler).
#pragma once

#include <cstdint>
#include <vector>

namespace lockstep::data {

// The indices one process reads in one epoch. set_epoch() changes the order of shuffling
// samplers; indices() is a pure function of the construction arguments and the epoch.
class Sampler {
 public:
  virtual ~Sampler() = default;
  virtual std::vector<int64_t> indices() const = 0;
  // indices().size(), without building them.
  virtual int64_t num_samples() const = 0;
  virtual void set_epoch(int64_t epoch) { (void)epoch; }
};

// 0, 1, ..., size - 1 every epoch.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t size);
  std::vector<int64_t> indices() const override;
  int64_t num_samples() const override { return size_; }

 private:
  int64_t size_;
};

struct DistributedSamplerOptions {
  int64_t num_replicas = 1;
  int64_t rank = 0;
  bool shuffle = true;
  uint64_t seed = 0;
  // Drop the tail so that every rank gets floor(size / num_replicas) indices (with pad).
  bool drop_last = false;
  // true (training): every rank gets the same count, the short ranks repeating indices from the
  // start of the permutation. false (evaluation): no index is repeated or dropped, so the ranks'
  // counts differ by at most one and their union is exactly the dataset, once.
  bool pad = true;
};

// torch.utils.data.DistributedSampler, with the same semantics:
//  1. permutation of [0, size): Fisher-Yates driven by Philox seeded with seed + epoch, the
//     same on every rank (or the identity without shuffle);
//  2. padded by repeating its first indices up to a multiple of num_replicas, or with drop_last
//     truncated down to one;
//  3. rank r takes positions r, r + R, r + 2R, ...
// The permutation differs from PyTorch's (a different generator), nothing else does.
class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t size, int64_t num_replicas, int64_t rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);
  DistributedSampler(int64_t size, const DistributedSamplerOptions& options);

  std::vector<int64_t> indices() const override;
  // This rank's count; the same on every rank unless pad is false.
  int64_t num_samples() const override { return num_samples_; }
  // Starts a new epoch from its first index (clears set_start_index).
  void set_epoch(int64_t epoch) override;
  // Resumes the current epoch after its first `consumed` positions: the samples that all ranks
  // together already read, possibly with another number of ranks (a checkpoint taken with N
  // ranks resumed with M). Ranks together read a prefix of the epoch's order, so the rest is
  // order[consumed, size), padded (from the start of the order, as always) or truncated for the
  // new rank count and dealt out as usual: no sample of the epoch is skipped, none is read again
  // except as padding. With the same rank count, indices() is exactly the tail of what the
  // uninterrupted epoch gives this rank. Call after set_epoch().
  void set_start_index(int64_t consumed);
  int64_t start_index() const { return start_; }

  int64_t epoch() const { return epoch_; }
  int64_t size() const { return size_; }
  // Indices over all ranks in one epoch (num_samples * num_replicas with pad).
  int64_t total_size() const { return total_size_; }
  const DistributedSamplerOptions& options() const { return options_; }

 private:
  int64_t size_;
  DistributedSamplerOptions options_;
  int64_t num_samples_ = 0;
  int64_t total_size_ = 0;
  int64_t epoch_ = 0;
  int64_t start_ = 0;

  void count();  // num_samples_ and total_size_ for the positions from start_ on
};

// A permutation of [0, size) from Philox seeded with `seed` (Fisher-Yates); what
// DistributedSampler shuffles with, exposed so that tests and tools can reproduce it.
std::vector<int64_t> random_permutation(int64_t size, uint64_t seed);

}  // namespace lockstep::data
