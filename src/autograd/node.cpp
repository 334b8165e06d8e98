// Graph nodes, leaf gradient accumulation, and the helpers ops use to record history.
#include "lockstep/autograd/node.h"

#include "lockstep/autograd/grad_mode.h"

namespace lockstep::autograd {

namespace {
thread_local uint64_t tl_next_sequence_nr = 0;
}

Node::Node() : sequence_nr_(tl_next_sequence_nr++) {}

TensorList FunctionNode::apply(TensorList&& grads) {
  LS_CHECK(fn_ != nullptr, "backward through ", name_, " a second time: its saved tensors were "
           "freed after the first backward; pass retain_graph = true to the first one");
  return fn_(grads);
}

TensorList AccumulateGrad::apply(TensorList&& grads) {
  Tensor incoming = std::move(grads[0]);
  if (!incoming.defined()) return {};
  Tensor leaf(leaf_);
  LS_CHECK(incoming.shape() == leaf.shape(), "AccumulateGrad: gradient of shape ",
           incoming.shape().str(), " for a leaf of shape ", leaf.shape().str());
  if (incoming.dtype() != leaf.dtype()) incoming = incoming.to(leaf.dtype());
  AutogradMeta& meta = leaf_->autograd_meta();
  if (!meta.grad) {
    // Take the incoming buffer when nothing else can see it; otherwise copy, so that a later
    // in-place accumulation never writes into memory another tensor shares.
    const bool sole_owner = incoming.impl_ptr().use_count() == 1 &&
                            incoming.storage().use_count() == 1 && incoming.is_contiguous() &&
                            incoming.offset() == 0;
    meta.grad = sole_owner ? incoming.impl_ptr() : incoming.clone().impl_ptr();
    Tensor(meta.grad).impl()->grad_fn_.reset();
  } else {
    // In place, so a .grad that is a view into a larger buffer (DDP's buckets) stays one.
    Tensor(meta.grad).add_(incoming);
  }
  for (auto& [id, hook] : meta.post_accumulate_grad_hooks) hook(leaf);
  return {};
}

bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (t.grad_fn()) return {t.grad_fn(), t.impl()->output_nr_};
  AutogradMeta& meta = t.impl()->autograd_meta();
  std::shared_ptr<Node> acc = meta.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    meta.grad_accumulator = acc;
  }
  return {acc, 0};
}

void set_history(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
                 std::initializer_list<Tensor*> outputs) {
  set_history(node, inputs, std::vector<Tensor*>(outputs));
}

void set_history(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor*>& outputs) {
  node->next_edges.clear();
  node->next_edges.reserve(inputs.size());
  for (const Tensor& t : inputs) node->next_edges.push_back(gradient_edge(t));
  uint32_t nr = 0;
  for (Tensor* out : outputs) {
    if (out && out->defined()) {
      TensorImpl* impl = out->impl();
      impl->grad_fn_ = node;
      impl->output_nr_ = nr;
      impl->requires_grad_ = true;
    }
    ++nr;
  }
}

void record(const char* name, std::initializer_list<Tensor> inputs, Tensor& output,
            BackwardFn fn) {
  if (!grad_enabled()) return;
  bool any = false;
  for (const Tensor& t : inputs) any = any || (t.defined() && t.requires_grad());
  if (!any) return;
  auto node = std::make_shared<FunctionNode>(name, std::move(fn));
  set_history(node, std::vector<Tensor>(inputs), {&output});
}

}  // namespace lockstep::autograd
