// Neural-network ops: softmax family, losses, normalization, embedding, dropout, convolution,
// pooling.
#pragma once

#include "lockstep/tensor/tensor.h"

namespace lockstep {

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

enum class Reduction { none, mean, sum };

struct CrossEntropyOptions {
  Reduction reduction = Reduction::mean;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
};
// logits (N, C) or (N, C, d1, ...); targets i64 (N) or (N, d1, ...) class indices.
// log-softmax and NLL fused in one pass.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets,
                     const CrossEntropyOptions& opts = {});
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::mean);

// Rows of `weight` (num, dim) selected by integer `indices` of any shape -> (*indices, dim).
Tensor embedding(const Tensor& weight, const Tensor& indices);

// Normalizes over the trailing dims given by `normalized_shape`; weight/bias optional.
Tensor layer_norm(const Tensor& x, const Dims& normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);

// torch.nn.functional.batch_norm over x (N, C, *), per channel (dim 1). training: normalizes
// with the batch's mean and biased variance over all dims but 1 and, when running_mean and
// running_var are defined, updates them in place (no gradient) as (1 - momentum) * running +
// momentum * batch statistic, the variance unbiased. Not training: normalizes with the running
// statistics, which must be defined. weight and bias (C) are optional.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum = 0.1,
                  double eps = 1e-5);

// Zeroes elements with probability p and scales the rest by 1/(1-p); identity when !training.
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen);

struct Conv2dOptions {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
  int64_t groups = 1;
  static Conv2dOptions square(int64_t stride, int64_t padding = 0, int64_t dilation = 1,
                              int64_t groups = 1) {
    return {stride, stride, padding, padding, dilation, dilation, groups};
  }
};
// x (N, C, H, W), weight (O, C/groups, kh, kw), bias (O) optional -> (N, O, Ho, Wo).
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              const Conv2dOptions& opts = {});

struct Pool2dOptions {
  int64_t kernel_h = 2, kernel_w = 2;
  int64_t stride_h = 0, stride_w = 0;  // 0: equal to the kernel
  int64_t pad_h = 0, pad_w = 0;
  static Pool2dOptions square(int64_t kernel, int64_t stride = 0, int64_t padding = 0) {
    return {kernel, kernel, stride, stride, padding, padding};
  }
};
Tensor max_pool2d(const Tensor& x, const Pool2dOptions& opts = {});
// Padding counts as zeros in the average (count_include_pad = true, PyTorch's default).
Tensor avg_pool2d(const Tensor& x, const Pool2dOptions& opts = {});

}  // namespace lockstep
