// Optimizers over parameter groups: SGD and AdamW with PyTorch's update rules, per-parameter
// state that exports and imports as named tensors.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/optim/exact_sum.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::optim {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// A set of parameters sharing hyperparameters. Options not set here come from the optimizer's.
struct ParamGroup {
  std::vector<Tensor> params;
  double lr = -1.0;            // < 0: the optimizer's default
  double weight_decay = -1.0;  // < 0: the optimizer's default
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Updates every parameter that has a gradient (parameters without one are skipped).
  virtual void step() = 0;
  // Drops gradients (set_to_none) or zeroes them in place.
  void zero_grad(bool set_to_none = true);

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // Sets every group's learning rate.
  void set_lr(double lr);
  int64_t num_params() const;

  // Per-parameter state as named tensors "<param index>.<field>" (indices count across groups
  // in order), plus "step" and one "group.<g>.lr" per group (0-dim f64), ready for a
  // safetensors checkpoint. Virtual for wrappers that keep the state elsewhere
  // (dist::ZeroRedundancyOptimizer, whose state_dict() is collective).
  virtual NamedTensors state_dict() const;
  // Restores what state_dict() produced; checks names, shapes and the parameter count.
  virtual void load_state_dict(const NamedTensors& state);
  int64_t steps() const { return steps_; }

  // For a GradScaler: the gradients the next step() reads (unscale_ and the inf check go over
  // these), and its inf decision, the same on every rank that steps together. By default every
  // parameter's .grad() and the decision as it is; dist::ZeroRedundancyOptimizer with
  // reduce_scatter_gradients gives its averaged shards and all-reduces the decision.
  virtual std::vector<Tensor> step_gradients() {
    std::vector<Tensor> grads;
    for (const auto& group : groups_) {
      for (const auto& p : group.params)
        if (p.grad().defined()) grads.push_back(p.grad());
    }
    return grads;
  }
  virtual bool agree_found_inf(bool found) { return found; }

 protected:
  Optimizer(std::vector<ParamGroup> groups, double default_lr, double default_weight_decay,
            const char* name);
  // The per-parameter state fields this optimizer keeps (load_state_dict accepts only these).
  virtual std::vector<std::string> state_fields() const = 0;
  // State field `field` of parameter `index`, created as zeros like the parameter if absent.
  Tensor& state(int64_t index, const std::string& field, const Tensor& like);
  const char* name_;
  std::vector<ParamGroup> groups_;
  std::vector<std::map<std::string, Tensor>> state_;  // by parameter index
  int64_t steps_ = 0;
};

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

// torch.optim.SGD: g += wd p; buf = g (first step) else momentum buf + (1 - dampening) g;
// g = nesterov ? g + momentum buf : buf; p -= lr g.
class SGD : public Optimizer {
 public:
  SGD(std::vector<ParamGroup> groups, SGDOptions opts);
  SGD(const std::vector<Tensor>& params, SGDOptions opts) : SGD({ParamGroup{params}}, opts) {}
  void step() override;

 protected:
  std::vector<std::string> state_fields() const override { return {"momentum_buffer"}; }

 private:
  SGDOptions opts_;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

// torch.optim.AdamW: p *= 1 - lr wd; m, v moments with bias correction; p -= lr m^ /
// (sqrt(v^)+eps).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, AdamWOptions opts);
  AdamW(const std::vector<Tensor>& params, AdamWOptions opts) : AdamW({ParamGroup{params}}, opts) {}
  void step() override;

 protected:
  std::vector<std::string> state_fields() const override {
    return {"exp_avg", "exp_avg_sq", "step"};
  }

 private:
  AdamWOptions opts_;
};

// Scales gradients in place so that their global norm is at most max_norm; returns the norm
// before clipping. A non-finite norm is returned and nothing is scaled (a GradScaler will skip
// that step anyway). norm_type 2 (Euclidean) or infinity.
// The 2-norm is summed exactly (Note [Exact norm]), device gradients on the host after one copy:
// the same bits however the elements are split between tensors or ranks and wherever they live,
// so DDP, ZeroRedundancyOptimizer and FullyShardedDataParallel clip alike. The infinity norm of
// device gradients is taken on their device.
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);
// clip_grad_norm's parts, for wrappers that hold the gradient in shards: adds the squares of a
// floating tensor's elements to `acc` exactly (a device tensor is read back first); and the
// scaling, which multiplies `grads` in place by max_norm / (total + 1e-6) when that is below 1
// and returns `total` (nothing scaled when `total` is not finite).
void add_squares(ExactSum& acc, const Tensor& t);
double scale_to_max_norm(const std::vector<Tensor>& grads, double total, double max_norm);

// Throws when the loss of optimizer step `step` (1-based) is NaN or Inf: the training has
// diverged, and going on would only carry NaN into the parameters (io::save_checkpoint refuses
// to write them, Note [No NaN in a checkpoint]).
// The message names the step and the loss and ends with `remedy` (what the program's flags
// offer, e.g. "lower --lr"). A loop with a GradScaler skips such steps instead (fp16's overflow
// is expected and handled there) and does not call this.
void check_loss_is_finite(double loss, int64_t step, const std::string& remedy);

}  // namespace lockstep::optim
