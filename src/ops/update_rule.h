// The per-element rules of SGD and AdamW, the one home of their formulas: the CPU loops
// (src/optim/optimizer.cpp) and the device kernels (src/ops/cuda/multi_tensor.cu) both call them,
// so the two cannot drift apart. Each runs in the parameters' type T with the step's scalars
// already converted to T; plain C++ when nvcc does not compile it.
#pragma once

#include <cmath>

#include "base/host_device.h"

namespace lockstep::update_rule {

// SGD's scalars in T.
template <typename T>
struct Sgd {
  T lr, weight_decay, momentum, one_minus_dampening;
};

template <typename T>
LS_HOST_DEVICE Sgd<T> sgd_scalars(double lr, double weight_decay, double momentum,
                                  double dampening) {
  return {static_cast<T>(lr), static_cast<T>(weight_decay), static_cast<T>(momentum),
          static_cast<T>(1 - dampening)};
}

// One element of SGD, as PyTorch's: d = g (+ wd * p); with momentum, b = first ? d : mom * b +
// (1 - dampening) * d and d = nesterov ? d + mom * b : b; then p -= lr * d. The CPU passes the
// flags as compile-time constants, so each combination compiles to its own vector loop; buf is
// read only when momentum is set.
template <typename T>
LS_HOST_DEVICE void sgd(T& p, T g, T* buf, const Sgd<T>& c, bool decay, bool momentum, bool first,
                        bool nesterov) {
  T d = g;
  if (decay) d += c.weight_decay * p;
  if (momentum) {
    const T b = first ? d : c.momentum * *buf + c.one_minus_dampening * d;
    *buf = b;
    d = nesterov ? d + c.momentum * b : b;
  }
  p -= c.lr * d;
}

// AdamW's scalars in T; the step's bias corrections come per tensor (a parameter may skip steps).
template <typename T>
struct AdamW {
  T decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
};

template <typename T>
LS_HOST_DEVICE AdamW<T> adamw_scalars(double lr, double weight_decay, double beta1, double beta2,
                                      double eps) {
  return {static_cast<T>(1 - lr * weight_decay), static_cast<T>(beta1), static_cast<T>(1 - beta1),
          static_cast<T>(beta2),                 static_cast<T>(1 - beta2), static_cast<T>(eps)};
}

// One element of decoupled AdamW: p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
// p -= step_size * m / (sqrt(v) / bc2_sqrt + eps), with step_size = lr / (1 - b1^t) and
// bc2_sqrt = sqrt(1 - b2^t).
template <typename T>
LS_HOST_DEVICE void adamw(T& p, T g, T& m, T& v, const AdamW<T>& c, T step_size, T bc2_sqrt) {
  p *= c.decay;
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
#if defined(__CUDA_ARCH__)
  const T root = sqrt(v);
#else
  const T root = std::sqrt(v);
#endif
  const T denom = root / bc2_sqrt + c.eps;
  p -= step_size * m / denom;
}

}  // namespace lockstep::update_rule
