// Module: named parameters, buffers and children in a deterministic order; state_dict; modes.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/tensor/tensor.h"

namespace lockstep::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module {
 public:
  explicit Module(std::string type_name = "Module") : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The computation; the default throws (containers and layers override it).
  virtual Tensor forward(const Tensor& x);
  // Note [Forward hooks]: calling a module runs its forward pre-hooks, forward(), then its forward
  // hooks, in registration order; calling forward() directly runs no hook (PyTorch's __call__
  // and forward). Containers call their children this way, and so must a module whose children
  // another layer hooks (FullyShardedDataParallel gathers a unit's parameters in its pre-hook).
  Tensor operator()(const Tensor& x);

  // A pre-hook runs before forward(); a forward hook gets the output and returns the output the
  // caller sees (the same tensor, or one with more history). Ids are for remove_forward_hook.
  using ForwardPreHook = std::function<void(Module&)>;
  using ForwardHook = std::function<Tensor(Module&, const Tensor& output)>;
  int register_forward_pre_hook(ForwardPreHook hook);
  int register_forward_hook(ForwardHook hook);
  void remove_forward_hook(int id);

  // Note [Parameter order]
  // Registration order, depth-first: a module's own parameters, then each child's in the order
  // the children were registered; names join the path with dots ("layers.0.weight"). Every
  // rank that builds the same model gets the same order, which DDP's bucket layout relies on.
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const {
    return children_;
  }
  int64_t num_parameters() const;
  // Replaces the child registered as `name` by `m`, in the same position (so the parameter order
  // is kept): model surgery such as dist::convert_sync_batchnorm. A module that also keeps a
  // pointer of its own to the old child goes on calling that one.
  void replace_child(const std::string& name, std::shared_ptr<Module> m);

  // Parameters then buffers, by name (buffers registered non-persistent are left out).
  NamedTensors state_dict() const;
  // Copies values into the existing tensors (so handles held elsewhere stay valid). Strict:
  // a missing or unexpected key, or a shape or dtype mismatch, is an error naming the key.
  void load_state_dict(const NamedTensors& state, bool strict = true);

  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Drops every parameter's gradient (set_to_none) or zeroes it in place.
  void zero_grad(bool set_to_none = true);
  // Converts every parameter and buffer in place: handles held by layers see the change.
  void to(Device device);
  void to(DType dtype);  // floating parameters and buffers only

  const std::string& type_name() const { return type_name_; }
  // "Sequential(\n  (0): Linear(in=784, out=1024)\n ...)" like PyTorch's repr.
  virtual std::string to_string() const;

 protected:
  Tensor& register_parameter(const std::string& name, Tensor t);
  Tensor& register_buffer(const std::string& name, Tensor t, bool persistent = true);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }
  // One line of extra detail for to_string(), e.g. "in=784, out=1024".
  virtual std::string extra_repr() const { return ""; }

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> m);
  void check_new_name(const std::string& name) const;
  void collect(const std::string& prefix, bool params, bool recurse, bool persistent_only,
               NamedTensors& out) const;

  std::string type_name_;
  bool training_ = true;
  NamedTensors params_;
  NamedTensors buffers_;
  std::vector<bool> buffer_persistent_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<std::pair<int, ForwardPreHook>> pre_hooks_;
  std::vector<std::pair<int, ForwardHook>> post_hooks_;
  int next_hook_id_ = 0;
};

// Runs children in order; children are named "0", "1", ...
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  Sequential(std::initializer_list<std::shared_ptr<Module>> layers);
  void push_back(std::shared_ptr<Module> layer);
  Tensor forward(const Tensor& x) override;
  size_t size() const { return named_children().size(); }
  std::shared_ptr<Module> operator[](size_t i) const { return named_children()[i].second; }
};

}  // namespace lockstep::nn
