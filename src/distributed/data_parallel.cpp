// DataParallel: replicas on threads, gradients summed into replica 0.
#include "lockstep/distributed/data_parallel.h"

#include <cstring>
#include <exception>
#include <thread>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/ops/elementwise.h"

namespace lockstep::dist {

DataParallel::DataParallel(const std::function<std::shared_ptr<nn::Module>()>& make_replica,
                           int replicas) {
  LS_CHECK(replicas >= 1, "DataParallel: expected at least one replica, got ", replicas);
  LS_CHECK(make_replica != nullptr, "DataParallel: no replica factory given");
  for (int k = 0; k < replicas; ++k) {
    auto m = make_replica();
    LS_CHECK(m != nullptr, "DataParallel: the factory returned no module for replica ", k);
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

  std::vector<double> losses(static_cast<size_t>(k_used), 0.0);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(k_used));
  auto run = [&](int k) {
    try {
      // Chunk k: sizes differ by at most one, the first (batch % k_used) chunks one larger.
      const int64_t base = batch / k_used, extra = batch % k_used;
      const int64_t start = k * base + std::min<int64_t>(k, extra);
      const int64_t n = base + (k < extra ? 1 : 0);
      nn::Module& m = *replicas_[k];
      if (k > 0) m.zero_grad(/*set_to_none=*/true);
      Tensor l = loss(m.forward(input.narrow(0, start, n)), target.narrow(0, start, n));
      losses[k] = l.item() * static_cast<double>(n) / static_cast<double>(batch);
      mul(l, static_cast<double>(n) / static_cast<double>(batch)).backward();
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

  // Replica 0 accumulated its own chunk; add the others'.
  autograd::NoGradGuard no_grad;
  auto dst = replicas_[0]->parameters();
  for (int k = 1; k < k_used; ++k) {
    const auto src = replicas_[k]->parameters();
    for (size_t i = 0; i < dst.size(); ++i) {
      const Tensor g = src[i].grad();
      if (!g.defined()) continue;
      if (dst[i].grad().defined()) {
        dst[i].grad().add_(g);
      } else {
        dst[i].set_grad(g.clone());
      }
    }
  }
  double total = 0;
  for (double l : losses) total += l;
  return total;
}

}  // namespace lockstep::dist
