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
// With a list of devices (PyTorch's device_ids) there is one replica per device, moved there
// after make_replica() built it: the chunks travel to their replica's device, each replica's
// thread works on that device, and the gradients are summed into replica 0's on devices[0]
// (streams ordered with events both ways). Without, the replicas are threads on the CPU, which
// is what the DDP benchmark compares with.
class DataParallel {
 public:
  // make_replica() must build the same architecture each time (checked: names and shapes).
  DataParallel(const std::function<std::shared_ptr<nn::Module>()>& make_replica, int replicas);
  DataParallel(const std::function<std::shared_ptr<nn::Module>()>& make_replica,
               std::vector<Device> devices);

  const std::shared_ptr<nn::Module>& module() const { return replicas_[0]; }
  int replicas() const { return static_cast<int>(replicas_.size()); }
  const std::vector<Device>& devices() const { return devices_; }

  // Returns the batch's mean loss.
  double forward_backward(const Tensor& input, const Tensor& target, const LossFn& loss);

 private:
  void broadcast_from_replica0();

  std::vector<std::shared_ptr<nn::Module>> replicas_;
  std::vector<Device> devices_;  // replica k's
};

}  // namespace lockstep::dist
