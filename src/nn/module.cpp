// Module bookkeeping: registration, traversal in a fixed order, state_dict, modes, conversion.
#include "lockstep/nn/module.h"

#include <set>
#include <sstream>

#include "lockstep/autograd/grad_mode.h"

namespace lockstep::nn {

Tensor Module::forward(const Tensor&) {
  LS_THROW(type_name_, " has no single-tensor forward(); call its own methods");
}

Tensor Module::operator()(const Tensor& x) {
  if (pre_hooks_.empty() && post_hooks_.empty()) return forward(x);
  // Copies: a hook may remove itself.
  const auto pre = pre_hooks_;
  for (const auto& [id, hook] : pre) hook(*this);
  Tensor out = forward(x);
  const auto post = post_hooks_;
  for (const auto& [id, hook] : post) out = hook(*this, out);
  return out;
}

int Module::register_forward_pre_hook(ForwardPreHook hook) {
  pre_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

int Module::register_forward_hook(ForwardHook hook) {
  post_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

void Module::remove_forward_hook(int id) {
  std::erase_if(pre_hooks_, [id](const auto& h) { return h.first == id; });
  std::erase_if(post_hooks_, [id](const auto& h) { return h.first == id; });
}

void Module::check_new_name(const std::string& name) const {
  LS_CHECK(!name.empty() && name.find('.') == std::string::npos, type_name_, ": invalid name '",
           name, "' (must be non-empty and contain no '.')");
  auto taken = [&](const auto& list) {
    for (const auto& [n, _] : list)
      if (n == name) return true;
    return false;
  };
  LS_CHECK(!taken(params_) && !taken(buffers_) && !taken(children_), type_name_, ": name '", name,
           "' is already registered");
}

Tensor& Module::register_parameter(const std::string& name, Tensor t) {
  check_new_name(name);
  LS_CHECK(t.defined(), type_name_, ": parameter '", name, "' is undefined");
  if (!t.requires_grad() && is_floating(t.dtype())) t.requires_grad_(true);
  params_.emplace_back(name, std::move(t));
  return params_.back().second;
}

Tensor& Module::register_buffer(const std::string& name, Tensor t, bool persistent) {
  check_new_name(name);
  buffers_.emplace_back(name, std::move(t));
  buffer_persistent_.push_back(persistent);
  return buffers_.back().second;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  check_new_name(name);
  LS_CHECK(m != nullptr, type_name_, ": child module '", name, "' is null");
  children_.emplace_back(name, std::move(m));
}

void Module::replace_child(const std::string& name, std::shared_ptr<Module> m) {
  LS_CHECK(m != nullptr, type_name_, ": replacement for child module '", name, "' is null");
  for (auto& [n, child] : children_) {
    if (n == name) {
      child = std::move(m);
      return;
    }
  }
  LS_THROW(type_name_, ": no child module named '", name, "' to replace");
}

void Module::collect(const std::string& prefix, bool params, bool recurse, bool persistent_only,
                     NamedTensors& out) const {
  if (params) {
    for (const auto& [n, t] : params_) out.emplace_back(prefix + n, t);
  } else {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (persistent_only && !buffer_persistent_[i]) continue;
      if (buffers_[i].second.defined())
        out.emplace_back(prefix + buffers_[i].first, buffers_[i].second);
    }
  }
  if (!recurse) return;
  for (const auto& [n, child] : children_)
    child->collect(prefix + n + ".", params, true, persistent_only, out);
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  collect("", true, recurse, false, out);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  collect("", false, recurse, false, out);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  return n;
}

NamedTensors Module::state_dict() const {
  NamedTensors out;
  collect("", true, true, false, out);
  collect("", false, true, true, out);
  return out;
}

void Module::load_state_dict(const NamedTensors& state, bool strict) {
  NamedTensors mine = state_dict();
  std::set<std::string> expected;
  for (const auto& [n, _] : mine) expected.insert(n);
  if (strict) {
    for (const auto& [n, _] : state) {
      LS_CHECK(expected.count(n), "load_state_dict: unexpected key '", n, "' (", type_name_,
               " has no parameter or buffer of that name)");
    }
  }
  autograd::NoGradGuard no_grad;
  for (auto& [name, dst] : mine) {
    const Tensor* src = nullptr;
    for (const auto& [n, t] : state)
      if (n == name) src = &t;
    if (src == nullptr) {
      LS_CHECK(!strict, "load_state_dict: missing key '", name, "' (expected shape ",
               dst.shape().str(), ")");
      continue;
    }
    LS_CHECK(src->shape() == dst.shape(), "load_state_dict: shape mismatch for '", name,
             "': expected ", dst.shape().str(), ", got ", src->shape().str());
    LS_CHECK(src->dtype() == dst.dtype(), "load_state_dict: dtype mismatch for '", name,
             "': expected ", dtype_name(dst.dtype()), ", got ", dtype_name(src->dtype()));
    dst.copy_(*src);
  }
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [n, child] : children_) child->train(on);
}

void Module::zero_grad(bool set_to_none) {
  autograd::NoGradGuard no_grad;
  for (Tensor& p : parameters()) {
    if (set_to_none)
      p.set_grad(Tensor());
    else if (p.grad().defined())
      p.grad().zero_();
  }
}

namespace {
// Replaces the tensor's contents in place: every handle to it sees the converted data.
void assign_in_place(Tensor& t, const Tensor& converted) {
  TensorImpl* impl = t.impl();
  impl->storage_ = converted.storage();
  impl->shape_ = converted.shape();
  impl->strides_ = converted.strides();
  impl->offset_ = converted.offset();
  impl->dtype_ = converted.dtype();
  if (impl->autograd_meta_) impl->autograd_meta_->grad.reset();
}
}  // namespace

void Module::to(Device device) {
  autograd::NoGradGuard no_grad;
  for (auto* list : {&params_, &buffers_})
    for (auto& [n, t] : *list)
      if (t.defined() && !(t.device() == device)) assign_in_place(t, t.to(device));
  for (auto& [n, child] : children_) child->to(device);
}

void Module::to(DType dtype) {
  LS_CHECK(is_floating(dtype), "Module::to: expected a floating dtype, got ", dtype_name(dtype));
  autograd::NoGradGuard no_grad;
  for (auto* list : {&params_, &buffers_})
    for (auto& [n, t] : *list)
      if (t.defined() && is_floating(t.dtype()) && t.dtype() != dtype)
        assign_in_place(t, t.to(dtype));
  for (auto& [n, child] : children_) child->to(dtype);
}

std::string Module::to_string() const {
  std::ostringstream os;
  os << type_name_ << "(" << extra_repr();
  if (!children_.empty()) {
    os << "\n";
    for (const auto& [n, child] : children_) {
      std::string inner = child->to_string();
      std::string indented;
      for (char c : inner) {
        indented += c;
        if (c == '\n') indented += "  ";
      }
      os << "  (" << n << "): " << indented << "\n";
    }
  }
  os << ")";
  return os.str();
}

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> layers) : Sequential() {
  for (auto& l : layers) push_back(l);
}

void Sequential::push_back(std::shared_ptr<Module> layer) {
  register_module(std::to_string(named_children().size()), std::move(layer));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (const auto& [n, layer] : named_children()) h = (*layer)(h);
  return h;
}

}  // namespace lockstep::nn
