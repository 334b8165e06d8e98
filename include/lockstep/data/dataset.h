// Dataset (size, get), TensorDataset over dim 0, and per-sample transforms (Normalize).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lockstep/tensor/tensor.h"

namespace lockstep::data {

// One sample: what the model reads and what the loss compares against.
struct Example {
  Tensor input;
  Tensor target;
};

// A random-access collection of examples. get() is called concurrently from DataLoader worker
// threads, so implementations must be safe to call from several threads at once (a const
// method that reads shared tensors, as TensorDataset does, is).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // index in [0, size()).
  virtual Example get(int64_t index) const = 0;
};

// Examples are rows (dim 0) of two tensors; get() returns views into them, never copies.
class TensorDataset : public Dataset {
 public:
  // inputs (N, ...) and targets (N, ...) must agree on N.
  TensorDataset(Tensor inputs, Tensor targets);

  int64_t size() const override { return inputs_.size(0); }
  Example get(int64_t index) const override;

  const Tensor& inputs() const { return inputs_; }
  const Tensor& targets() const { return targets_; }

 private:
  Tensor inputs_;
  Tensor targets_;
};

using Transform = std::function<Example(Example)>;

// Applies `transform` to each example of `base` as it is read (a per-sample transform).
class TransformDataset : public Dataset {
 public:
  TransformDataset(std::shared_ptr<const Dataset> base, Transform transform);

  int64_t size() const override { return base_->size(); }
  Example get(int64_t index) const override { return transform_(base_->get(index)); }

 private:
  std::shared_ptr<const Dataset> base_;
  Transform transform_;
};

// (x - mean[c]) / std[c] along `channel_dim`, in f32 (f64 stays f64; integer inputs become f32).
// mean and std hold one value for every channel, or a single value for all of them. Use
// channel_dim 0 for one sample (C, H, W), 1 for a batch or a whole dataset (N, C, H, W).
class Normalize {
 public:
  Normalize(std::vector<double> mean, std::vector<double> std, int64_t channel_dim = 0);

  Tensor operator()(const Tensor& x) const;
  // Normalizes the input, leaves the target alone: usable as a TransformDataset transform.
  Example operator()(Example e) const;

  const std::vector<double>& mean() const { return mean_; }
  const std::vector<double>& std() const { return std_; }

 private:
  std::vector<double> mean_;
  std::vector<double> std_;
  int64_t channel_dim_;
};

}  // namespace lockstep::data
