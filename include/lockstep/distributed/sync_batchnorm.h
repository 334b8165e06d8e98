// SyncBatchNorm (torch.nn.SyncBatchNorm): batch normalization whose batch statistics are those of
// the whole batch across a process group, so that N ranks with b samples each normalize like one
// process with N*b; and convert_sync_batchnorm(), which swaps it in for BatchNorm in a model.
//
//   auto model = dist::convert_sync_batchnorm(make_cnn());  // before wrapping in DDP
//   dist::DistributedDataParallel ddp(model, dist::default_group());
#pragma once

#include <memory>

#include "lockstep/distributed/process_group.h"
#include "lockstep/nn/module.h"

namespace lockstep::nn {
class BatchNorm;
}

namespace lockstep::dist {

// Note [SyncBatchNorm]
// Forward (training): every rank computes its batch's per-channel mean, biased variance and
// count; one all_gather brings every rank's triple to every rank, and each combines them (in f64,
// in rank order, so that every rank gets bit-identical statistics and running statistics) as the
// statistics of the union of the batches: uneven per-rank batch sizes, even an empty one, count
// exactly. Backward: the input gradient needs the whole batch's sums of dy and dy*(x - mean) per
// channel: one all_reduce of the two local sums (2C values). The weight and bias gradients are
// the local sums, as in PyTorch: DDP's gradient averaging reduces them like every other
// parameter's. Evaluation uses the running statistics and communicates nothing. Every rank of the
// group must run the forward and the backward (the collectives must match), so a Join's shadowing
// rank cannot stand in for it: SyncBatchNorm is not supported inside a Join.

// x (N, C, *), training mode only. running_mean/running_var (C) may be undefined; weight/bias (C)
// optional. Half inputs are normalized in f32, as batch_norm does.
Tensor sync_batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, double momentum, double eps,
                       ProcessGroup& pg);

// Parameters and buffers named as nn::BatchNorm's (weight, bias, running_mean, running_var,
// num_batches_tracked), so state dicts move between the two.
class SyncBatchNorm : public nn::Module {
 public:
  // pg: the group whose ranks share statistics; null means default_group() at first forward.
  explicit SyncBatchNorm(int64_t num_features, double eps = 1e-5, double momentum = 0.1,
                         bool affine = true, ProcessGroupPtr pg = nullptr);
  Tensor forward(const Tensor& x) override;
  const ProcessGroupPtr& process_group() const { return pg_; }

 protected:
  std::string extra_repr() const override;

 private:
  friend std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module>,
                                                            ProcessGroupPtr);
  SyncBatchNorm(const nn::BatchNorm& from, ProcessGroupPtr pg);
  int64_t num_features_;
  double eps_, momentum_;
  ProcessGroupPtr pg_;
  Tensor weight_, bias_, running_mean_, running_var_, num_batches_tracked_;
};

// Every nn::BatchNorm in `module`'s tree (the module itself included) replaced by a SyncBatchNorm
// over `pg` (null: the default group) that shares its parameter and buffer tensors, so an
// optimizer built before still updates them. Returns the module (a new SyncBatchNorm when
// `module` is itself a BatchNorm). As PyTorch's, it works on the registered children: a custom
// module that calls a BatchNorm through a member pointer of its own keeps calling the old one.
std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module> module,
                                                   ProcessGroupPtr pg = nullptr);

}  // namespace lockstep::dist
