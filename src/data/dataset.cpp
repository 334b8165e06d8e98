// TensorDataset, TransformDataset and Normalize.
#include "lockstep/data/dataset.h"

#include "lockstep/ops/elementwise.h"

namespace lockstep::data {

TensorDataset::TensorDataset(Tensor inputs, Tensor targets)
    : inputs_(std::move(inputs)), targets_(std::move(targets)) {
  LS_CHECK(inputs_.defined() && targets_.defined(),
           "TensorDataset: inputs and targets must both be defined tensors");
  LS_CHECK(inputs_.dim() >= 1 && targets_.dim() >= 1,
           "TensorDataset: inputs and targets need a dim 0 to index, got shapes ",
           inputs_.shape().str(), " and ", targets_.shape().str());
  LS_CHECK(inputs_.size(0) == targets_.size(0),
           "TensorDataset: inputs and targets must have the same size in dim 0, got ",
           inputs_.size(0), " (inputs ", inputs_.shape().str(), ") and ", targets_.size(0),
           " (targets ", targets_.shape().str(), ")");
}

Example TensorDataset::get(int64_t index) const {
  LS_CHECK(index >= 0 && index < size(), "TensorDataset::get: index ", index,
           " is out of range for a dataset of size ", size());
  return {inputs_.select(0, index), targets_.select(0, index)};
}

TransformDataset::TransformDataset(std::shared_ptr<const Dataset> base, Transform transform)
    : base_(std::move(base)), transform_(std::move(transform)) {
  LS_CHECK(base_ != nullptr, "TransformDataset: the base dataset is null");
  LS_CHECK(static_cast<bool>(transform_), "TransformDataset: the transform is empty");
}

Normalize::Normalize(std::vector<double> mean, std::vector<double> std, int64_t channel_dim)
    : mean_(std::move(mean)), std_(std::move(std)), channel_dim_(channel_dim) {
  LS_CHECK(!mean_.empty() && mean_.size() == std_.size(),
           "Normalize: mean and std need the same, non-zero number of values, got ", mean_.size(),
           " and ", std_.size());
  for (double s : std_) LS_CHECK(s != 0.0, "Normalize: std must be non-zero, got ", s);
  LS_CHECK(channel_dim_ >= 0, "Normalize: channel_dim must be >= 0, got ", channel_dim_);
}

Tensor Normalize::operator()(const Tensor& x) const {
  DType dt = x.dtype() == kFloat64 ? kFloat64 : kFloat32;
  Tensor xf = x.to(dt);
  const int64_t channels = static_cast<int64_t>(mean_.size());
  if (channels == 1) return div(sub(xf, mean_[0]), std_[0]);
  LS_CHECK(x.dim() > channel_dim_ && x.size(channel_dim_) == channels, "Normalize: expected ",
           channels, " channels in dim ", channel_dim_, ", got a tensor of shape ",
           x.shape().str());
  // mean and std shaped (C, 1, ..., 1) so that they broadcast against dims channel_dim.. of x.
  Dims stat_shape = Dims::filled(x.dim() - channel_dim_, 1);
  stat_shape[0] = channels;
  Tensor m = from_vector<double>(mean_, {channels}).to(dt).view(stat_shape);
  Tensor s = from_vector<double>(std_, {channels}).to(dt).view(stat_shape);
  return div(sub(xf, m), s);
}

Example Normalize::operator()(Example e) const {
  e.input = (*this)(e.input);
  return e;
}

}  // namespace lockstep::data
