// The backward engine: dependency counting over the graph, a ready queue ordered so that leaf
// accumulation runs first and later-created nodes before earlier ones, and final callbacks.
#include "lockstep/autograd/engine.h"

#include <map>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/node.h"
#include "lockstep/ops/autocast.h"
#include "lockstep/ops/elementwise.h"

namespace lockstep::autograd {

namespace {

struct BackwardState {
  std::vector<std::function<void()>> callbacks;
};
thread_local BackwardState* tl_state = nullptr;

// Note [Ready order]
// Among nodes whose inputs are complete, AccumulateGrad runs first: a leaf's gradient is final
// the moment its accumulator is ready, and firing its hook then is what lets DDP start a
// bucket's all-reduce while the rest of backward still runs. Other nodes run later-created
// first, so gradients become ready in roughly reverse registration order of the parameters.
struct ReadyOrder {
  bool operator()(const Node* a, const Node* b) const {
    const bool acc_a = dynamic_cast<const AccumulateGrad*>(a) != nullptr;
    const bool acc_b = dynamic_cast<const AccumulateGrad*>(b) != nullptr;
    if (acc_a != acc_b) return acc_b;  // true means a runs after b
    return a->sequence_nr() < b->sequence_nr();
  }
};

class StateGuard {
 public:
  explicit StateGuard(BackwardState* s) : prev_(tl_state) { tl_state = s; }
  ~StateGuard() { tl_state = prev_; }

 private:
  BackwardState* prev_;
};

struct Capture {
  Node* node;
  uint32_t input_nr;
};

// Runs the graph. With `captures` empty, gradients reach leaves' .grad(); otherwise the
// gradients arriving at each captured edge are returned and no .grad() is touched.
std::vector<Tensor> run(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots,
                        bool retain_graph, const std::vector<Edge>& capture_edges) {
  LS_CHECK(grad_roots.empty() || grad_roots.size() == roots.size(), "backward: got ",
           grad_roots.size(), " gradients for ", roots.size(), " outputs");
  NoGradGuard no_grad;  // backward itself is not recorded (no double backward)
  // Gradients keep the dtypes of the forward; a backward() called inside an autocast scope must
  // not recast them.
  amp::detail::AutocastSuspend no_autocast;
  amp::detail::note_backward();

  std::vector<Edge> root_edges;
  std::vector<Tensor> root_grads;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    LS_CHECK(r.defined(), "backward: output ", i, " is undefined");
    LS_CHECK(r.requires_grad(), "backward: output ", i, " (shape ", r.shape().str(),
             ") does not require grad and has no grad_fn; did you compute it under NoGradGuard "
             "or from tensors without requires_grad?");
    Tensor g = grad_roots.empty() ? Tensor() : grad_roots[i];
    if (!g.defined()) {
      LS_CHECK(r.numel() == 1,
               "backward: a gradient can be created implicitly only for a "
               "one-element output, got shape ",
               r.shape().str(), "; pass the output gradient");
      g = ones_like(r);
    } else {
      LS_CHECK(g.shape() == r.shape(), "backward: gradient of shape ", g.shape().str(),
               " for an output of shape ", r.shape().str());
      // Backward functions take gradients in their output's dtype (a bf16 output given an f32
      // gradient under autocast): convert, as PyTorch does.
      if (g.dtype() != r.dtype() && is_floating(g.dtype()) && is_floating(r.dtype())) {
        g = g.to(r.dtype());
      }
    }
    root_edges.push_back(gradient_edge(r));
    root_grads.push_back(g);
  }

  // Count, for every reachable node, how many edges point at it.
  std::unordered_map<Node*, int> deps;
  std::unordered_map<Node*, std::shared_ptr<Node>> owners;
  std::vector<Node*> stack;
  for (const Edge& e : root_edges) {
    if (owners.emplace(e.fn.get(), e.fn).second) stack.push_back(e.fn.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges) {
      if (!e.fn) continue;
      ++deps[e.fn.get()];
      if (owners.emplace(e.fn.get(), e.fn).second) stack.push_back(e.fn.get());
    }
  }

  std::map<std::pair<Node*, uint32_t>, size_t> capture_index;
  for (size_t i = 0; i < capture_edges.size(); ++i) {
    if (capture_edges[i].fn)
      capture_index[{capture_edges[i].fn.get(), capture_edges[i].input_nr}] = i;
  }
  std::vector<Tensor> captured(capture_edges.size());
  const bool capturing = !capture_edges.empty();

  std::unordered_map<Node*, TensorList> buffers;
  auto add_to_buffer = [&](const Edge& e, Tensor g) {
    TensorList& buf = buffers[e.fn.get()];
    if (buf.empty()) buf.resize(e.fn->num_inputs());
    LS_CHECK(e.input_nr < buf.size(), "backward: edge into input ", e.input_nr, " of ",
             e.fn->name(), " which has ", buf.size());
    Tensor& slot = buf[e.input_nr];
    slot = slot.defined() ? add(slot, g) : std::move(g);
  };

  std::priority_queue<Node*, std::vector<Node*>, ReadyOrder> ready;
  for (size_t i = 0; i < root_edges.size(); ++i) add_to_buffer(root_edges[i], root_grads[i]);
  {
    std::unordered_set<Node*> pushed;
    for (const Edge& e : root_edges)
      if (deps[e.fn.get()] == 0 && pushed.insert(e.fn.get()).second) ready.push(e.fn.get());
  }

  BackwardState state;
  StateGuard guard(&state);
  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    TensorList inputs = std::move(buffers[node]);
    buffers.erase(node);
    inputs.resize(node->num_inputs());

    if (capturing) {
      for (uint32_t k = 0; k < inputs.size(); ++k) {
        auto it = capture_index.find({node, k});
        if (it != capture_index.end()) captured[it->second] = inputs[k];
      }
    }
    bool any = false;
    for (const Tensor& t : inputs) any = any || t.defined();
    const bool skip = !any || (capturing && dynamic_cast<AccumulateGrad*>(node) != nullptr);

    TensorList outputs;
    if (!skip) {
      try {
        outputs = node->apply(std::move(inputs));
      } catch (const Error& e) {
        LS_THROW("in backward of ", node->name(), ": ", e.message());
      }
      if (!retain_graph) node->release();
    }
    LS_CHECK(skip || outputs.size() == node->next_edges.size() || outputs.empty(), "backward of ",
             node->name(), " returned ", outputs.size(), " gradients for ", node->next_edges.size(),
             " inputs");
    for (size_t i = 0; i < node->next_edges.size(); ++i) {
      const Edge& e = node->next_edges[i];
      if (!e.fn) continue;
      if (i < outputs.size() && outputs[i].defined()) add_to_buffer(e, std::move(outputs[i]));
      if (--deps[e.fn.get()] == 0) ready.push(e.fn.get());
    }
  }

  // Callbacks may queue more callbacks; run until none are left.
  for (size_t i = 0; i < state.callbacks.size(); ++i) {
    auto cb = std::move(state.callbacks[i]);
    cb();
  }
  return captured;
}

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots,
              bool retain_graph) {
  run(roots, grad_roots, retain_graph, {});
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs, bool retain_graph) {
  std::vector<Edge> edges;
  for (size_t i = 0; i < inputs.size(); ++i) {
    LS_CHECK(inputs[i].defined() && inputs[i].requires_grad(), "grad: input ", i,
             " does not require grad");
    edges.push_back(gradient_edge(inputs[i]));
  }
  return run(outputs, grad_outputs, retain_graph, edges);
}

void queue_callback(std::function<void()> callback) {
  LS_CHECK(tl_state != nullptr,
           "queue_callback: only callable during a backward pass (from a "
           "hook or a node); this thread is not running one");
  tl_state->callbacks.push_back(std::move(callback));
}

bool in_backward() { return tl_state != nullptr; }

}  // namespace lockstep::autograd

namespace lockstep {

// Declared with the Tensor (include/lockstep/tensor/tensor.h); defined here, above the ops that
// the backward runs.
void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  autograd::backward({*this}, {gradient}, retain_graph);
}

}  // namespace lockstep
