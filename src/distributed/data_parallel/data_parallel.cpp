// DataParallel: replicas on threads (on the CPU or one per device), gradients summed into
// replica 0.
#include "lockstep/distributed/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <thread>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/tensor/cuda.h"

namespace lockstep::dist {

DataParallel::DataParallel(const std::function<std::shared_ptr<nn::Module>()>& make_replica,
                           int replicas)
    : DataParallel(make_replica,
                   std::vector<Device>(static_cast<size_t>(std::max(replicas, 0)), kCPU)) {
  LS_CHECK(replicas >= 1, "DataParallel: expected at least one replica, got ", replicas);
}

DataParallel::DataParallel(const std::function<std::shared_ptr<nn::Module>()>& make_replica,
                           std::vector<Device> devices)
    : devices_(std::move(devices)) {
  const int replicas = static_cast<int>(devices_.size());
  LS_CHECK(replicas >= 1, "DataParallel: expected at least one replica (device), got none");
  LS_CHECK(make_replica != nullptr, "DataParallel: no replica factory given");
  for (int k = 0; k < replicas; ++k) {
    auto m = make_replica();
    LS_CHECK(m != nullptr, "DataParallel: the factory returned no module for replica ", k);
    if (!devices_[k].is_cpu()) m->to(devices_[k]);
    replicas_.push_back(std::move(m));
  }
  const auto ref = replicas_[0]->named_parameters();
  for (int k = 1; k < replicas; ++k) {
    const auto other = replicas_[k]->named_parameters();
    LS_CHECK(other.size() == ref.size(), "DataParallel: replica ", k, " has ", other.size(),
             " parameters, replica 0 has ", ref.size(),
             "; the factory must build one architecture");
    for (size_t i = 0; i < ref.size(); ++i) {
      LS_CHECK(other[i].first == ref[i].first && other[i].second.shape() == ref[i].second.shape(),
               "DataParallel: replica ", k, "'s parameter ", i, " is '", other[i].first, "' ",
               other[i].second.shape().str(), ", replica 0's is '", ref[i].first, "' ",
               ref[i].second.shape().str());
    }
  }
  broadcast_from_replica0();
}

void DataParallel::broadcast_from_replica0() {
  autograd::NoGradGuard no_grad;
  const auto src_p = replicas_[0]->parameters();
  const auto src_b = replicas_[0]->buffers();
  for (size_t k = 1; k < replicas_.size(); ++k) {
    auto dst_p = replicas_[k]->parameters();
    for (size_t i = 0; i < src_p.size(); ++i) dst_p[i].detach().copy_(src_p[i]);
    auto dst_b = replicas_[k]->buffers();
    for (size_t i = 0; i < src_b.size() && i < dst_b.size(); ++i) dst_b[i].copy_(src_b[i]);
  }
}

double DataParallel::forward_backward(const Tensor& input, const Tensor& target,
                                      const LossFn& loss) {
  LS_CHECK(input.dim() >= 1 && target.dim() >= 1 && input.size(0) == target.size(0),
           "DataParallel: input and target must share dimension 0, got ", input.shape().str(),
           " and ", target.shape().str());
  const int64_t batch = input.size(0);
  const int k_used = static_cast<int>(std::min<int64_t>(replicas(), batch));
  LS_CHECK(k_used >= 1, "DataParallel: empty batch");
  broadcast_from_replica0();

  // Note [Replicas on devices]: each replica's thread has the CUDA runtime's per-thread state of
  // its own (current device, current stream), so work handed between threads is ordered with
  // events: the replica's thread waits for the copies this thread queued (parameters, above),
  // and this thread waits for the replica's backward before it reads the gradients.
  const auto k_count = static_cast<size_t>(k_used);
  std::vector<cuda::Event> copied(k_count), computed(k_count);
  for (int k = 0; k < k_used; ++k) {
    if (devices_[k].is_cuda()) copied[k].record(cuda::current_stream(devices_[k].index));
  }

  std::vector<double> losses(k_count, 0.0);
  std::vector<std::exception_ptr> errors(k_count);
  auto run = [&](int k) {
    try {
      const Device dev = devices_[k];
      std::optional<cuda::DeviceGuard> on_device;
      if (dev.is_cuda()) {
        on_device.emplace(dev.index);
        copied[k].wait(cuda::current_stream());
      }
      // Chunk k: sizes differ by at most one, the first (batch % k_used) chunks one larger.
      const int64_t base = batch / k_used, extra = batch % k_used;
      const int64_t start = k * base + std::min<int64_t>(k, extra);
      const int64_t n = base + (k < extra ? 1 : 0);
      nn::Module& m = *replicas_[k];
      if (k > 0) m.zero_grad(/*set_to_none=*/true);
      Tensor l =
          loss(m.forward(input.narrow(0, start, n).to(dev)), target.narrow(0, start, n).to(dev));
      losses[k] = l.item() * static_cast<double>(n) / static_cast<double>(batch);
      mul(l, static_cast<double>(n) / static_cast<double>(batch)).backward();
      if (dev.is_cuda()) computed[k].record(cuda::current_stream());
    } catch (...) {
      errors[k] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (int k = 1; k < k_used; ++k) threads.emplace_back(run, k);
  run(0);
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }

  // Replica 0 accumulated its own chunk; add the others' (gathered to its device).
  autograd::NoGradGuard no_grad;
  auto dst = replicas_[0]->parameters();
  for (int k = 1; k < k_used; ++k) {
    if (devices_[k].is_cuda()) computed[k].wait(cuda::current_stream(devices_[k].index));
    const auto src = replicas_[k]->parameters();
    for (size_t i = 0; i < dst.size(); ++i) {
      const Tensor g = src[i].grad();
      if (!g.defined()) continue;
      const Tensor here = g.to(dst[i].device());
      if (dst[i].grad().defined()) {
        dst[i].grad().add_(here);
      } else {
        dst[i].set_grad(here.is_same(g) ? g.clone() : here);
      }
    }
  }
  double total = 0;
  for (double l : losses) total += l;
  return total;
}

}  // namespace lockstep::dist
