// Optimizer base, SGD, AdamW and clip_grad_norm; updates are fused per-parameter loops.
#include "lockstep/optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/reduce.h"
#include "lockstep/optim/exact_sum.h"
#include "ops/cpu/avx2_math.h"
#include "ops/kernels.h"
#include "ops/update_rule.h"
#include "tensor/dispatch.h"
#include "tensor/parallel.h"

namespace lockstep::optim {

namespace {
// Updates touch a handful of floats per element; below this they run on one thread.
constexpr int64_t kUpdateGrain = 16384;

// Note [Branch-free update loops]
// The SGD update written as one loop with its options tested per element (weight decay, a
// momentum buffer, its first step, Nesterov) compiled to scalar code that reloaded the double
// options every element: 7 ns per element, the optimizer a sixth of a DDP step's time. Each
// combination of options is its own loop here, over restrict pointers with the options already
// in T and passed to update_rule::sgd (src/ops/update_rule.h) as constants, which the
// compiler vectorizes. The arithmetic per element is the rule's, the same on every device.
template <typename T, bool kDecay, bool kMomentum, bool kFirst, bool kNesterov>
void sgd_range(T* __restrict p, const T* __restrict g, T* __restrict buf, int64_t begin,
               int64_t end, const update_rule::Sgd<T>& c) {
  for (int64_t k = begin; k < end; ++k) {
    update_rule::sgd(p[k], g[k], kMomentum ? buf + k : nullptr, c, kDecay, kMomentum, kFirst,
                     kNesterov);
  }
}

template <typename T>
void sgd_update(T* p, const T* g, T* buf, int64_t n, double lr, double wd, double mom, double damp,
                bool nesterov, bool first) {
  const update_rule::Sgd<T> c = update_rule::sgd_scalars<T>(lr, wd, mom, damp);
  auto run = [&]<bool kDecay, bool kMomentum, bool kFirst, bool kNesterov>() {
    cpu::parallel_for(0, n, kUpdateGrain, [&](int64_t b, int64_t e) {
      sgd_range<T, kDecay, kMomentum, kFirst, kNesterov>(p, g, buf, b, e, c);
    });
  };
  auto with_decay = [&]<bool kMomentum, bool kFirst, bool kNesterov>() {
    if (wd != 0) {
      run.template operator()<true, kMomentum, kFirst, kNesterov>();
    } else {
      run.template operator()<false, kMomentum, kFirst, kNesterov>();
    }
  };
  if (buf == nullptr) {
    with_decay.template operator()<false, false, false>();
  } else if (first) {
    if (nesterov) {
      with_decay.template operator()<true, true, true>();
    } else {
      with_decay.template operator()<true, true, false>();
    }
  } else if (nesterov) {
    with_decay.template operator()<true, false, true>();
  } else {
    with_decay.template operator()<true, false, false>();
  }
}

void check_param(const Tensor& p, const char* name) {
  LS_CHECK(p.defined() && p.is_leaf(), name, ": parameters must be leaf tensors");
  LS_CHECK(p.dtype() == kFloat32 || p.dtype() == kFloat64, name,
           ": parameters must be f32 or f64, got ", dtype_name(p.dtype()));
  LS_CHECK(p.is_contiguous(), name, ": parameters must be contiguous tensors, got shape ",
           p.shape().str(), " strides ", p.strides().str());
}

// Note [Fused updates on devices]
// On the CPU each parameter is updated by its own parallel loop (the loop is the fusion). On a
// device, one launch per parameter would cost more than the arithmetic, so a step gathers its
// group's parameters per device and runs the multi-tensor kernel of the device's table once
// (sgd_update, adamw_update in src/ops/kernels.h); both sides apply the per-element rules of
// src/ops/update_rule.h.
struct DeviceList {
  std::vector<Tensor> params, grads, bufs, bufs2;
  std::vector<uint8_t> first;
  std::vector<detail::AdamWStep> steps;
};

struct DeviceLess {
  bool operator()(const Device& a, const Device& b) const {
    return a.type != b.type ? a.type < b.type : a.index < b.index;
  }
};

struct DeviceLists {
  std::map<Device, DeviceList, DeviceLess> by_device;
  void add(const Tensor& p, const Tensor& g, const Tensor& b, const Tensor& b2, bool first) {
    DeviceList& l = by_device[p.device()];
    l.params.push_back(p);
    l.grads.push_back(g);
    if (b.defined()) l.bufs.push_back(b);
    if (b2.defined()) l.bufs2.push_back(b2);
    l.first.push_back(first ? 1 : 0);
  }
};

// A contiguous gradient of the parameter's dtype (copies only in unusual cases).
Tensor grad_of(const Tensor& p) {
  Tensor g = p.grad();
  if (g.dtype() != p.dtype()) g = g.to(p.dtype());
  return g.contiguous();
}
}  // namespace

Optimizer::Optimizer(std::vector<ParamGroup> groups, double default_lr, double default_weight_decay,
                     const char* name)
    : name_(name), groups_(std::move(groups)) {
  LS_CHECK(!groups_.empty(), name, ": no parameter groups");
  int64_t n = 0;
  for (auto& g : groups_) {
    if (g.lr < 0) g.lr = default_lr;
    if (g.weight_decay < 0) g.weight_decay = default_weight_decay;
    for (const Tensor& p : g.params) check_param(p, name);
    n += static_cast<int64_t>(g.params.size());
  }
  LS_CHECK(n > 0, name, ": got an empty parameter list");
  state_.resize(static_cast<size_t>(n));
}

void Optimizer::zero_grad(bool set_to_none) {
  autograd::NoGradGuard no_grad;
  for (auto& g : groups_)
    for (Tensor& p : g.params) {
      if (set_to_none)
        p.set_grad(Tensor());
      else if (p.grad().defined())
        p.grad().zero_();
    }
}

void Optimizer::set_lr(double lr) {
  for (auto& g : groups_) g.lr = lr;
}

int64_t Optimizer::num_params() const { return static_cast<int64_t>(state_.size()); }

Tensor& Optimizer::state(int64_t index, const std::string& field, const Tensor& like) {
  Tensor& t = state_[static_cast<size_t>(index)][field];
  AllocationScope scope("optimizer state");
  if (!t.defined()) t = zeros(like.shape(), TensorOptions(like.dtype()).with_device(like.device()));
  return t;
}

NamedTensors Optimizer::state_dict() const {
  NamedTensors out;
  out.emplace_back("step", full({}, static_cast<double>(steps_), kInt64));
  for (size_t g = 0; g < groups_.size(); ++g)
    out.emplace_back("group." + std::to_string(g) + ".lr", full({}, groups_[g].lr, kFloat64));
  for (size_t i = 0; i < state_.size(); ++i)
    for (const auto& [field, t] : state_[i]) out.emplace_back(std::to_string(i) + "." + field, t);
  return out;
}

void Optimizer::load_state_dict(const NamedTensors& state) {
  std::vector<std::map<std::string, Tensor>> fresh(state_.size());
  std::vector<const Tensor*> params;
  for (auto& g : groups_)
    for (const Tensor& p : g.params) params.push_back(&p);
  bool have_step = false;
  for (const auto& [name, t] : state) {
    if (name == "step") {
      steps_ = static_cast<int64_t>(t.item());
      have_step = true;
      continue;
    }
    if (name.rfind("group.", 0) == 0) {
      // "group.<g>.lr"
      const size_t dot = name.find('.', 6);
      const std::string g_str = dot == std::string::npos ? "" : name.substr(6, dot - 6);
      LS_CHECK(!g_str.empty() && g_str.find_first_not_of("0123456789") == std::string::npos &&
                   name.substr(dot + 1) == "lr",
               name_, ": malformed state key '", name, "' (expected group.<index>.lr)");
      const size_t g = std::stoul(g_str);
      LS_CHECK(g < groups_.size(), name_, ": state has group ", g, " but the optimizer has ",
               groups_.size(), " groups");
      groups_[g].lr = t.item();
      continue;
    }
    const size_t dot = name.find('.');
    const std::string idx_str = dot == std::string::npos ? "" : name.substr(0, dot);
    LS_CHECK(!idx_str.empty() && idx_str.find_first_not_of("0123456789") == std::string::npos,
             name_, ": malformed state key '", name, "' (expected <param index>.<field>)");
    const size_t idx = std::stoul(idx_str);
    LS_CHECK(idx < params.size(), name_, ": state for parameter ", idx, " but the optimizer has ",
             params.size(), " parameters");
    const auto fields = state_fields();
    LS_CHECK(std::find(fields.begin(), fields.end(), name.substr(dot + 1)) != fields.end(), name_,
             ": unknown state field in '", name, "' (was this state saved by another optimizer?)");
    const std::string field = name.substr(dot + 1);
    if (field == "step") {  // a per-parameter counter, not a tensor like the parameter
      fresh[idx][field] = t.to(kFloat64).clone();
      continue;
    }
    LS_CHECK(t.shape() == params[idx]->shape(), name_, ": state '", name, "' has shape ",
             t.shape().str(), " but parameter ", idx, " has shape ", params[idx]->shape().str());
    fresh[idx][field] = t.to(params[idx]->dtype()).to(params[idx]->device()).clone();
  }
  LS_CHECK(have_step, name_, ": state has no 'step' entry");
  state_ = std::move(fresh);
}

// ---- SGD ----

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions opts)
    : Optimizer(std::move(groups), opts.lr, opts.weight_decay, "SGD"), opts_(opts) {
  LS_CHECK(opts.lr >= 0, "SGD: lr must be >= 0, got ", opts.lr);
  LS_CHECK(opts.momentum >= 0, "SGD: momentum must be >= 0, got ", opts.momentum);
  LS_CHECK(!opts.nesterov || (opts.momentum > 0 && opts.dampening == 0),
           "SGD: nesterov needs momentum > 0 and dampening = 0");
}

void SGD::step() {
  autograd::NoGradGuard no_grad;
  int64_t index = 0;
  for (auto& group : groups_) {
    DeviceLists lists;
    for (Tensor& p : group.params) {
      const int64_t i = index++;
      if (!p.grad().defined()) continue;
      Tensor g = grad_of(p);
      const bool first = !state_[i].count("momentum_buffer");
      Tensor buf = opts_.momentum != 0 ? state(i, "momentum_buffer", p) : Tensor();
      if (detail::has_kernel(&detail::Kernels::sgd_update, p.device())) {
        lists.add(p, g, buf, Tensor(), first);
        continue;
      }
      const double lr = group.lr, wd = group.weight_decay, mom = opts_.momentum;
      const double damp = opts_.dampening;
      const bool nesterov = opts_.nesterov;
      cpu::dispatch_float(p.dtype(), "SGD", [&]<typename T>() {
        sgd_update<T>(p.data<T>(), g.data<T>(), buf.defined() ? buf.data<T>() : nullptr, p.numel(),
                      lr, wd, mom, damp, nesterov, first);
      });
    }
    const detail::SgdScalars o{group.lr, group.weight_decay, opts_.momentum, opts_.dampening,
                               opts_.nesterov};
    for (auto& [device, l] : lists.by_device) {
      if (opts_.momentum == 0) l.bufs.clear();
      detail::kernel(&detail::Kernels::sgd_update, device, "SGD")(l.params, l.grads, l.bufs,
                                                                  l.first, o);
    }
  }
  ++steps_;
}

// ---- AdamW ----

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions opts)
    : Optimizer(std::move(groups), opts.lr, opts.weight_decay, "AdamW"), opts_(opts) {
  LS_CHECK(opts.lr >= 0, "AdamW: lr must be >= 0, got ", opts.lr);
  LS_CHECK(opts.beta1 >= 0 && opts.beta1 < 1 && opts.beta2 >= 0 && opts.beta2 < 1,
           "AdamW: betas must be in [0, 1), got (", opts.beta1, ", ", opts.beta2, ")");
  LS_CHECK(opts.eps >= 0, "AdamW: eps must be >= 0, got ", opts.eps);
}

namespace {

// Note [AdamW on AVX2]
// The f32 update compiled as a scalar loop: std::sqrt may set errno, so GCC kept a compare and
// branch per element, and it re-read the step's scalars through the lambda's references each
// time (1.8% of an f32 train_gpt step). adamw_f32_avx2 runs update_rule::adamw's IEEE
// operations in the same order on 8 lanes; its target has AVX2 but not FMA, so nothing is
// contracted into a fused multiply-add and every element gets the bits of the scalar loop (the
// tail still runs there).
// The tests compare it bit for bit with that scalar loop, written out in the test.
#if defined(__GNUC__) && !defined(__clang__)
#define LS_NO_FMA_CONTRACTION gnu::optimize("fp-contract=off")  // also under LOCKSTEP_NATIVE
#else
#define LS_NO_FMA_CONTRACTION
#endif

// An f32 parameter's step: the rule's scalars and this step's bias corrections.
struct AdamWF32 {
  update_rule::AdamW<float> c;
  float step_size, bc2_sqrt;
};

// The update of element k, update_rule::adamw in f32.
[[LS_NO_FMA_CONTRACTION]] inline void adamw_f32_one(float* p, const float* g, float* m, float* v,
                                                    int64_t k, const AdamWF32& s) {
  update_rule::adamw(p[k], g[k], m[k], v[k], s.c, s.step_size, s.bc2_sqrt);
}

#if LS_HAVE_AVX2
// Elements [b, e) in whole vectors of 8; returns where the scalar tail starts.
[[gnu::target("avx2"), LS_NO_FMA_CONTRACTION]] int64_t adamw_f32_avx2(float* p, const float* g,
                                                                      float* m, float* v, int64_t b,
                                                                      int64_t e,
                                                                      const AdamWF32& s) {
  const __m256 decay = _mm256_set1_ps(s.c.decay), b1 = _mm256_set1_ps(s.c.beta1),
               nb1 = _mm256_set1_ps(s.c.one_minus_beta1), b2 = _mm256_set1_ps(s.c.beta2),
               nb2 = _mm256_set1_ps(s.c.one_minus_beta2), bc2 = _mm256_set1_ps(s.bc2_sqrt),
               eps = _mm256_set1_ps(s.c.eps), step = _mm256_set1_ps(s.step_size);
  int64_t k = b;
  for (; k + 8 <= e; k += 8) {
    const __m256 gk = _mm256_loadu_ps(g + k);
    const __m256 pk = _mm256_mul_ps(_mm256_loadu_ps(p + k), decay);
    const __m256 mk =
        _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m + k)), _mm256_mul_ps(nb1, gk));
    const __m256 vk = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v + k)),
                                    _mm256_mul_ps(_mm256_mul_ps(nb2, gk), gk));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vk), bc2), eps);
    _mm256_storeu_ps(m + k, mk);
    _mm256_storeu_ps(v + k, vk);
    _mm256_storeu_ps(p + k, _mm256_sub_ps(pk, _mm256_div_ps(_mm256_mul_ps(step, mk), denom)));
  }
  return k;
}
#endif

// One f32 parameter's update over [b, e).
void adamw_f32(float* p, const float* g, float* m, float* v, int64_t b, int64_t e,
               const AdamWF32& s) {
  int64_t k = b;
#if LS_HAVE_AVX2
  if (cpu::cpu_has_avx2()) k = adamw_f32_avx2(p, g, m, v, b, e, s);
#endif
  for (; k < e; ++k) adamw_f32_one(p, g, m, v, k, s);
}

}  // namespace

void AdamW::step() {
  autograd::NoGradGuard no_grad;
  ++steps_;
  int64_t index = 0;
  for (auto& group : groups_) {
    DeviceLists lists;
    for (Tensor& p : group.params) {
      const int64_t i = index++;
      if (!p.grad().defined()) continue;
      Tensor g = grad_of(p);
      Tensor m = state(i, "exp_avg", p), v = state(i, "exp_avg_sq", p);
      // Per-parameter step count, as PyTorch keeps it (a parameter may skip steps).
      Tensor& st = state_[i]["step"];
      if (!st.defined()) st = zeros({}, kFloat64);
      st.fill_(st.item() + 1);
      const double t = st.item();
      const double lr = group.lr, wd = group.weight_decay;
      const double b1 = opts_.beta1, b2 = opts_.beta2, eps = opts_.eps;
      const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
      const double step_size = lr / bc1, bc2_sqrt = std::sqrt(bc2);
      if (detail::has_kernel(&detail::Kernels::adamw_update, p.device())) {
        lists.add(p, g, m, v, false);
        lists.by_device[p.device()].steps.push_back({step_size, bc2_sqrt});
        continue;
      }
      if (p.dtype() == kFloat32) {  // Note [AdamW on AVX2]
        const AdamWF32 s{update_rule::adamw_scalars<float>(lr, wd, b1, b2, eps),
                         static_cast<float>(step_size), static_cast<float>(bc2_sqrt)};
        float* pp = p.data<float>();
        const float* gp = g.data<float>();
        float* mp = m.data<float>();
        float* vp = v.data<float>();
        cpu::parallel_for(0, p.numel(), kUpdateGrain,
                          [&](int64_t b, int64_t e) { adamw_f32(pp, gp, mp, vp, b, e, s); });
        continue;
      }
      cpu::dispatch_float(p.dtype(), "AdamW", [&]<typename T>() {
        const update_rule::AdamW<T> c = update_rule::adamw_scalars<T>(lr, wd, b1, b2, eps);
        const T step = static_cast<T>(step_size), bc2_root = static_cast<T>(bc2_sqrt);
        T* pp = p.data<T>();
        const T* gp = g.data<T>();
        T* mp = m.data<T>();
        T* vp = v.data<T>();
        cpu::parallel_for(0, p.numel(), kUpdateGrain, [&](int64_t b, int64_t e) {
          for (int64_t k = b; k < e; ++k) {
            update_rule::adamw(pp[k], gp[k], mp[k], vp[k], c, step, bc2_root);
          }
        });
      });
    }
    const detail::AdamWScalars o{group.lr, group.weight_decay, opts_.beta1, opts_.beta2, opts_.eps};
    for (auto& [device, l] : lists.by_device) {
      detail::kernel(&detail::Kernels::adamw_update, device, "AdamW")(l.params, l.grads, l.bufs,
                                                                      l.bufs2, l.steps, o);
    }
  }
}

// ---- clip_grad_norm ----

void add_squares(ExactSum& acc, const Tensor& t) {
  // A device tensor is read back: the exact sum is the host's, and the same bits wherever the
  // gradient lives are worth one copy of it per clipped step.
  const Tensor c = (t.device().is_cpu() ? t : t.to(kCPU)).contiguous();
  // Blocks of a fixed size, each summed exactly and the blocks merged exactly: the threads'
  // split cannot change the result.
  constexpr int64_t kBlock = int64_t{1} << 15;
  const int64_t n = c.numel(), blocks = (n + kBlock - 1) / kBlock;
  std::vector<ExactSum> parts(static_cast<size_t>(blocks));
  cpu::dispatch_float(c.dtype(), "add_squares", [&]<typename T>() {
    const T* x = c.data<T>();
    cpu::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        ExactSum& part = parts[static_cast<size_t>(blk)];
        const int64_t end = std::min(n, (blk + 1) * kBlock);
        for (int64_t k = blk * kBlock; k < end; ++k) part.add_square(static_cast<double>(x[k]));
      }
    });
  });
  for (const ExactSum& part : parts) acc.add(part);
}

double scale_to_max_norm(const std::vector<Tensor>& grads, double total, double max_norm) {
  if (!std::isfinite(total)) return total;
  // PyTorch's coefficient, clamped at 1 (clip_grad_norm_): a norm under the limit is left as is.
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    autograd::NoGradGuard no_grad;
    for (const Tensor& g : grads)
      if (g.defined()) Tensor(g).mul_(coef);
  }
  return total;
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  LS_CHECK(max_norm >= 0, "clip_grad_norm: max_norm must be >= 0, got ", max_norm);
  LS_CHECK(norm_type == 2.0 || std::isinf(norm_type),
           "clip_grad_norm: norm_type must be 2 or "
           "infinity, got ",
           norm_type);
  autograd::NoGradGuard no_grad;
  const bool inf_norm = std::isinf(norm_type);
  double acc = 0;
  ExactSum exact;  // the squares, wherever the gradients live (Note [Exact norm])
  // The infinity norm of device gradients: partial maxima stay on the device, read once at the
  // end, so it costs one host synchronisation per step, not one per parameter.
  Tensor device_acc;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    Tensor g = grad_of(p);
    if (!inf_norm) {
      add_squares(exact, g);
      continue;
    }
    if (!g.device().is_cpu()) {
      Tensor part = max(abs(g.to(kFloat64)));
      if (device_acc.defined() && part.device() != device_acc.device())
        part = part.to(device_acc.device());
      device_acc = !device_acc.defined() ? part : maximum(device_acc, part);
      continue;
    }
    double part = 0;
    cpu::dispatch_float(g.dtype(), "clip_grad_norm", [&]<typename T>() {
      const T* x = g.data<T>();
      // NaN must win, as it does for the 2-norm; max() would drop it.
      for (int64_t k = 0; k < g.numel(); ++k) {
        const double v = std::abs(static_cast<double>(x[k]));
        part = (v > part || std::isnan(v)) && !std::isnan(part) ? v : part;
      }
    });
    acc = std::isnan(part) || part > acc ? part : acc;
  }
  if (!inf_norm) acc = exact.value();
  if (device_acc.defined()) {
    const double part = device_acc.item();
    acc = std::isnan(part) || part > acc ? part : acc;
  }
  return scale_to_max_norm(grads, inf_norm ? acc : std::sqrt(acc), max_norm);
}

void check_loss_is_finite(double loss, int64_t step, const std::string& remedy) {
  if (std::isfinite(loss)) return;
  LS_THROW("step ", step, ": the loss is ",
           std::isnan(loss) ? "NaN"
           : loss > 0       ? "Inf"
                            : "-Inf",
           ": the training has diverged, so it stops here (no checkpoint holding NaN or Inf is "
           "written; the last one written, if any, is the state to go back to). ",
           remedy);
}

}  // namespace lockstep::optim
