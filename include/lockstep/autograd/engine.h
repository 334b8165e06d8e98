// The backward engine: runs the recorded graph in reverse and fills leaves' gradients.
#pragma once

#include <functional>
#include <vector>

#include "lockstep/tensor/tensor.h"

namespace lockstep::autograd {

// Runs backward from `roots` with the given output gradients (an undefined entry means ones,
// allowed only for one-element roots). Nodes run in dependency order, later-created first;
// each leaf's gradient is accumulated once, after every contribution to it has been summed.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots = {},
              bool retain_graph = false);

// Computes gradients of `outputs` w.r.t. `inputs` and returns them, without touching .grad().
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs = {}, bool retain_graph = false);

// Queues `callback` to run once when the current backward pass ends (after every node and
// every hook). Only callable from inside a backward pass (a hook or a node); DDP's reducer uses
// it to wait for its all-reduces. Callbacks run in the order queued, on the backward thread.
void queue_callback(std::function<void()> callback);
// True while the current thread is running a backward pass.
bool in_backward();

}  // namespace lockstep::autograd
