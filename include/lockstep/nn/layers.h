// Layers: Linear, Conv2d, pooling, Flatten, activations, Dropout, LayerNorm, BatchNorm,
// Embedding. Initialisation follows PyTorch's defaults, drawn from the Generator given.
#pragma once

#include <memory>

#include "lockstep/nn/module.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/nn.h"

namespace lockstep::nn {

// y = x W^T + b; W (out, in) Kaiming-uniform (bound 1/sqrt(in)), b uniform(+-1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, Generator& gen, bool bias = true);
  Tensor forward(const Tensor& x) override;
  Tensor& weight() { return weight_; }
  Tensor& bias() { return bias_; }

 protected:
  std::string extra_repr() const override;

 private:
  int64_t in_, out_;
  Tensor weight_, bias_;
};

struct Conv2dConfig {
  int64_t in_channels = 1, out_channels = 1, kernel_size = 3;
  int64_t stride = 1, padding = 0, dilation = 1, groups = 1;
  bool bias = true;
};

class Conv2d : public Module {
 public:
  Conv2d(const Conv2dConfig& cfg, Generator& gen);
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, Generator& gen)
      : Conv2d(Conv2dConfig{in_channels, out_channels, kernel_size}, gen) {}
  Tensor forward(const Tensor& x) override;
  Tensor& weight() { return weight_; }
  Tensor& bias() { return bias_; }

 protected:
  std::string extra_repr() const override;

 private:
  Conv2dConfig cfg_;
  Tensor weight_, bias_;
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(int64_t kernel, int64_t stride = 0, int64_t padding = 0)
      : Module("MaxPool2d"), opts_(Pool2dOptions::square(kernel, stride, padding)) {}
  Tensor forward(const Tensor& x) override { return max_pool2d(x, opts_); }

 private:
  Pool2dOptions opts_;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(int64_t kernel, int64_t stride = 0, int64_t padding = 0)
      : Module("AvgPool2d"), opts_(Pool2dOptions::square(kernel, stride, padding)) {}
  Tensor forward(const Tensor& x) override { return avg_pool2d(x, opts_); }

 private:
  Pool2dOptions opts_;
};

// Flattens dims [start_dim, end_dim] (default: all but the batch dim).
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1)
      : Module("Flatten"), start_(start_dim), end_(end_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start_, end_); }

 private:
  int64_t start_, end_;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override;
};

class GELU : public Module {
 public:
  explicit GELU(GeluApprox approx = GeluApprox::none) : Module("GELU"), approx_(approx) {}
  Tensor forward(const Tensor& x) override;

 private:
  GeluApprox approx_;
};

class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& x) override;
};

// Zeroes with probability p in training mode; its own Generator (seeded at construction) draws
// the masks, so a seed reproduces them.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, uint64_t seed = 0);
  Tensor forward(const Tensor& x) override;

 private:
  double p_;
  Generator gen_;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(const Dims& normalized_shape, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;

 private:
  Dims shape_;
  double eps_;
  Tensor weight_, bias_;
};

// Batch normalization over (N, C) or (N, C, L) [1d] and (N, C, H, W) [2d]. In training mode it
// normalizes with the batch statistics and updates running_mean / running_var (unbiased) with
// `momentum`; in eval mode it uses the running statistics.
class BatchNorm : public Module {
 public:
  BatchNorm(int64_t num_features, int64_t spatial_dims, double eps = 1e-5, double momentum = 0.1,
            bool affine = true);
  Tensor forward(const Tensor& x) override;
  int64_t num_features() const { return num_features_; }
  int64_t spatial_dims() const { return spatial_dims_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }

 protected:
  std::string extra_repr() const override;

 private:
  int64_t num_features_, spatial_dims_;
  double eps_, momentum_;
  Tensor weight_, bias_, running_mean_, running_var_, num_batches_tracked_;
};

class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, double eps = 1e-5, double momentum = 0.1)
      : BatchNorm(num_features, 1, eps, momentum) {}
};

class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5, double momentum = 0.1)
      : BatchNorm(num_features, 2, eps, momentum) {}
};

// Rows of a (num_embeddings, dim) table, initialised N(0, 1).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator& gen);
  Tensor forward(const Tensor& indices) override;
  Tensor& weight() { return weight_; }

 private:
  Tensor weight_;
};

}  // namespace lockstep::nn
