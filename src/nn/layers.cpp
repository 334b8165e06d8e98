// Layer implementations and PyTorch's default initialisation.
#include "lockstep/nn/layers.h"

#include <cmath>
#include <sstream>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/linalg.h"

namespace lockstep::nn {

namespace {
// Kaiming-uniform with a = sqrt(5) (PyTorch's default for Linear and Conv weights) reduces to
// uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)); the bias uses the same bound.
Tensor uniform_init(const Dims& shape, int64_t fan_in, Generator& gen) {
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  if (bound == 0.0) return zeros(shape);
  return rand(shape, gen, kFloat32, -bound, bound);
}
}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, Generator& gen, bool bias)
    : Module("Linear"), in_(in_features), out_(out_features) {
  LS_CHECK(in_features > 0 && out_features > 0,
           "Linear: sizes must be positive, got in=", in_features, " out=", out_features);
  weight_ =
      register_parameter("weight", uniform_init({out_features, in_features}, in_features, gen));
  if (bias) bias_ = register_parameter("bias", uniform_init({out_features}, in_features, gen));
}

Tensor Linear::forward(const Tensor& x) { return linear(x, weight_, bias_); }

std::string Linear::extra_repr() const {
  std::ostringstream os;
  os << "in_features=" << in_ << ", out_features=" << out_
     << ", bias=" << (bias_.defined() ? "true" : "false");
  return os.str();
}

Conv2d::Conv2d(const Conv2dConfig& cfg, Generator& gen) : Module("Conv2d"), cfg_(cfg) {
  LS_CHECK(
      cfg.groups > 0 && cfg.in_channels % cfg.groups == 0 && cfg.out_channels % cfg.groups == 0,
      "Conv2d: groups=", cfg.groups, " must divide in_channels=", cfg.in_channels,
      " and out_channels=", cfg.out_channels);
  const int64_t fan_in = cfg.in_channels / cfg.groups * cfg.kernel_size * cfg.kernel_size;
  weight_ =
      register_parameter("weight", uniform_init({cfg.out_channels, cfg.in_channels / cfg.groups,
                                                 cfg.kernel_size, cfg.kernel_size},
                                                fan_in, gen));
  if (cfg.bias) bias_ = register_parameter("bias", uniform_init({cfg.out_channels}, fan_in, gen));
}

Tensor Conv2d::forward(const Tensor& x) {
  return conv2d(x, weight_, bias_,
                Conv2dOptions::square(cfg_.stride, cfg_.padding, cfg_.dilation, cfg_.groups));
}

std::string Conv2d::extra_repr() const {
  std::ostringstream os;
  os << cfg_.in_channels << ", " << cfg_.out_channels << ", kernel_size=" << cfg_.kernel_size
     << ", stride=" << cfg_.stride << ", padding=" << cfg_.padding;
  return os.str();
}

Tensor ReLU::forward(const Tensor& x) { return relu(x); }
Tensor GELU::forward(const Tensor& x) { return gelu(x, approx_); }
Tensor Tanh::forward(const Tensor& x) { return tanh(x); }

Dropout::Dropout(double p, uint64_t seed) : Module("Dropout"), p_(p), gen_(seed) {
  LS_CHECK(p >= 0.0 && p <= 1.0, "Dropout: p must be in [0, 1], got ", p);
}

Tensor Dropout::forward(const Tensor& x) { return dropout(x, p_, is_training(), gen_); }

LayerNorm::LayerNorm(const Dims& normalized_shape, double eps, bool affine)
    : Module("LayerNorm"), shape_(normalized_shape), eps_(eps) {
  if (affine) {
    weight_ = register_parameter("weight", ones(normalized_shape));
    bias_ = register_parameter("bias", zeros(normalized_shape));
  }
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, shape_, weight_, bias_, eps_); }

BatchNorm::BatchNorm(int64_t num_features, int64_t spatial_dims, double eps, double momentum,
                     bool affine)
    : Module(spatial_dims == 2 ? "BatchNorm2d" : "BatchNorm1d"),
      num_features_(num_features),
      spatial_dims_(spatial_dims),
      eps_(eps),
      momentum_(momentum) {
  if (affine) {
    weight_ = register_parameter("weight", ones({num_features}));
    bias_ = register_parameter("bias", zeros({num_features}));
  }
  running_mean_ = register_buffer("running_mean", zeros({num_features}));
  running_var_ = register_buffer("running_var", ones({num_features}));
  num_batches_tracked_ = register_buffer("num_batches_tracked", zeros({}, kInt64));
}

Tensor BatchNorm::forward(const Tensor& x) {
  const bool ok_rank = spatial_dims_ == 2 ? x.dim() == 4 : (x.dim() == 2 || x.dim() == 3);
  LS_CHECK(ok_rank && x.size(1) == num_features_, type_name(), ": expected input of shape ",
           spatial_dims_ == 2 ? "(N, C, H, W)" : "(N, C) or (N, C, L)", " with C=", num_features_,
           ", got ", x.shape().str());
  // The op normalizes (in f32 under autocast: its policy) and updates the running statistics.
  Tensor y =
      batch_norm(x, running_mean_, running_var_, weight_, bias_, is_training(), momentum_, eps_);
  if (is_training()) {
    autograd::NoGradGuard no_grad;
    num_batches_tracked_.add_(1.0);
  }
  return y;
}

std::string BatchNorm::extra_repr() const {
  std::ostringstream os;
  os << num_features_ << ", eps=" << eps_ << ", momentum=" << momentum_;
  return os.str();
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Generator& gen) : Module("Embedding") {
  weight_ = register_parameter("weight", randn({num_embeddings, dim}, gen));
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(weight_, indices); }

}  // namespace lockstep::nn
