// DataParallel: one process, one model replica per worker thread, the batch split among them and
// the gradients summed into replica 0. The simple scheme, kept as the baseline DDP is measured
// against.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "lockstep/nn/module.h"

namespace lockstep::dist {

// loss(output, target) for one replica's chunk, a mean over the chunk (as cross_entropy's).
using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;

// Each step copies replica 0's parameters and buffers to the other replicas (as PyTorch's
// DataParallel replicates every forward), splits the batch along dimension 0 into replicas()
// chunks whose sizes differ by at most one, and runs forward, loss and backward of every chunk
// on its own thread. Each chunk's loss is weighted by its share of the batch, so the gradients
// summed into replica 0's .grad() are those of the whole batch's mean loss; they are accumulated
// there, as a backward on replica 0 alone would. Optimizers step replica 0 (module()).
//
// On a machine with GPUs, PyTorch puts one replica per device; this CPU version puts one per
// thread, which is what its benchmark compares DDP with.
class DataParallel {
 public:
  // make_replica() must build the same architecture each time (checked: names and shapes).
  DataParallel(const std::function<std::shared_ptr<nn::Module>()>& make_replica, int replicas);

  const std::shared_ptr<nn::Module>& module() const { return replicas_[0]; }
  int replicas() const { return static_cast<int>(replicas_.size()); }

  // Returns the batch's mean loss.
  double forward_backward(const Tensor& input, const Tensor& target, const LossFn& loss);

 private:
  void broadcast_from_replica0();

  std::vector<std::shared_ptr<nn::Module>> replicas_;
};

}  // namespace lockstep::dist
