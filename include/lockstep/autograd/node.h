// Node: one recorded operation in the autograd graph, and the helpers ops use to record one.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/tensor/tensor.h"

namespace lockstep::autograd {

class Node;

// Where a gradient goes: input `input_nr` of node `fn` (null fn: nowhere, the input needs none).
struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

using TensorList = std::vector<Tensor>;

class Node {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Gradients w.r.t. this node's outputs -> gradients w.r.t. its inputs (one per next_edges
  // entry; an undefined Tensor means "no gradient"). Entries of `grads` may be undefined when
  // an output got no gradient.
  virtual TensorList apply(TensorList&& grads) = 0;
  virtual std::string name() const = 0;
  // Frees what the node saved for backward (called after use unless retain_graph).
  virtual void release() {}
  // How many gradients apply() takes (the node's outputs).
  virtual uint32_t num_inputs() const { return 1; }

  // Creation order; backward runs later nodes first, which is the order DDP's buckets expect.
  uint64_t sequence_nr() const { return sequence_nr_; }
  std::vector<Edge> next_edges;

 private:
  uint64_t sequence_nr_;
};

// A node whose backward is a function; most ops use this.
using BackwardFn = std::function<TensorList(const TensorList& grads)>;
class FunctionNode final : public Node {
 public:
  FunctionNode(const char* name, BackwardFn fn, uint32_t num_outputs = 1)
      : name_(name), fn_(std::move(fn)), num_outputs_(num_outputs) {}
  TensorList apply(TensorList&& grads) override;
  std::string name() const override { return name_; }
  void release() override { fn_ = nullptr; }
  uint32_t num_inputs() const override { return num_outputs_; }

 private:
  const char* name_;
  BackwardFn fn_;
  uint32_t num_outputs_;
};

// Accumulates into a leaf's .grad() and then fires its post-accumulate-grad hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  TensorList apply(TensorList&& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  const std::shared_ptr<TensorImpl>& leaf() const { return leaf_; }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

// True when grad mode is on and any of the inputs requires grad.
bool needs_grad(std::initializer_list<const Tensor*> inputs);
bool needs_grad(const std::vector<Tensor>& inputs);
// The edge a gradient for `t` should flow into (its grad_fn, its leaf accumulator, or none).
Edge gradient_edge(const Tensor& t);
// Connects `node` to `inputs` and makes it the grad_fn of `outputs` (output_nr = position).
void set_history(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
                 std::initializer_list<Tensor*> outputs);
// The same for an op with a number of outputs known only at run time (unbind).
void set_history(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
                 const std::vector<Tensor*>& outputs);

// Records `fn` as the backward of an op with the given inputs and single output, when needed.
// `fn` gets the output gradient (grads[0]) and returns one gradient per input (undefined where
// an input does not need one).
void record(const char* name, std::initializer_list<Tensor> inputs, Tensor& output,
            BackwardFn fn);

}  // namespace lockstep::autograd
