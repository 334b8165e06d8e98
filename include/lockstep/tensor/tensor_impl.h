// TensorImpl: the state behind a Tensor handle. Ops and autograd read it; users rarely need to.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lockstep/tensor/dims.h"
#include "lockstep/tensor/dtype.h"
#include "lockstep/tensor/storage.h"

namespace lockstep {

class Tensor;
namespace autograd {
class Node;
}

using PostAccumulateGradHook = std::function<void(Tensor&)>;

// What a tensor needs only when it takes part in autograd; allocated lazily so plain tensors
// stay small.
struct AutogradMeta {
  std::shared_ptr<class TensorImpl> grad;
  // Shared by every use of a leaf in a graph so its gradient is accumulated (and its hooks
  // fired) once per backward. Weak: the graph owns it.
  std::weak_ptr<autograd::Node> grad_accumulator;
  std::vector<std::pair<int, PostAccumulateGradHook>> post_accumulate_grad_hooks;
  int next_hook_id = 0;
};

class TensorImpl {
 public:
  TensorImpl(Storage storage, const Dims& shape, const Dims& strides, int64_t offset, DType dtype)
      : storage_(std::move(storage)),
        shape_(shape),
        strides_(strides),
        offset_(offset),
        dtype_(dtype) {}

  Storage storage_;
  Dims shape_;
  Dims strides_;  // in elements
  int64_t offset_ = 0;  // in elements
  DType dtype_ = DType::f32;

  bool requires_grad_ = false;
  std::shared_ptr<autograd::Node> grad_fn_;  // null for leaves
  uint32_t output_nr_ = 0;                   // which output of grad_fn_ this is
  std::unique_ptr<AutogradMeta> autograd_meta_;

  AutogradMeta& autograd_meta() {
    if (!autograd_meta_) autograd_meta_ = std::make_unique<AutogradMeta>();
    return *autograd_meta_;
  }
};

}  // namespace lockstep
