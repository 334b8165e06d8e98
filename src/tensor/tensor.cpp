// Tensor: metadata, element access, autograd accessors and printing. The methods that run
// kernels or record a backward (views, copies, conversion) are ops: src/ops/views.cpp and
// src/ops/tensor_ops.cpp; backward() is the engine's (src/autograd/engine.cpp).
#include "lockstep/tensor/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "tensor/dispatch.h"

namespace lockstep {

Dims contiguous_strides(const Dims& shape) {
  Dims s = Dims::filled(shape.size(), 1);
  int64_t acc = 1;
  for (int64_t d = shape.size() - 1; d >= 0; --d) {
    s[d] = acc;
    acc *= std::max<int64_t>(shape[d], 1);
  }
  return s;
}

namespace {
// Unlike reductions, size() and stride() have nothing to return for a 0-dim tensor.
int64_t checked_dim(int64_t d, int64_t ndim, const char* op) {
  LS_CHECK(ndim > 0, op, "(", d, "): a 0-dim tensor has no dimensions");
  LS_CHECK(d >= -ndim && d < ndim, op, ": dimension ", d, " is out of range for a tensor with ",
           ndim, " dimensions (expected [", -ndim, ", ", ndim - 1, "])");
  return d < 0 ? d + ndim : d;
}
}  // namespace

int64_t Tensor::size(int64_t d) const { return shape()[checked_dim(d, dim(), "size")]; }

int64_t Tensor::stride(int64_t d) const { return strides()[checked_dim(d, dim(), "stride")]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (shape()[d] == 1) continue;
    if (strides()[d] != expected) return false;
    expected *= shape()[d];
  }
  return true;
}

void* Tensor::data_ptr() const {
  if (impl_->storage_->data() == nullptr && numel() > 0) [[unlikely]]
    LS_THROW("a tensor of shape ", shape().str(), " whose storage holds no memory: a parameter of ",
             "a FullyShardedDataParallel unit outside its forward and backward, or its .grad() "
             "(read parameters through the wrapper: full_state_dict(), or inside "
             "summon_full_params(); FSDP keeps gradients in its shards: build the optimizer "
             "with wrap_optimizer() or over the wrapper's parameters(), and clip with its "
             "clip_grad_norm())");
  return static_cast<char*>(impl_->storage_->data()) + impl_->offset_ * element_size();
}

double Tensor::item() const {
  LS_CHECK(numel() == 1, "item(): expected a tensor with one element, got shape ", shape().str());
  // A device tensor: one synchronising copy back, as PyTorch's .item().
  if (!device().is_cpu()) return detach().to(kCPU).item();
  return at(Dims::filled(dim(), 0));
}

namespace {
int64_t element_offset(const Tensor& t, const Dims& index) {
  LS_CHECK(index.size() == t.dim(), "at: index ", index.str(), " has ", index.size(),
           " entries for a tensor with ", t.dim(), " dimensions");
  int64_t off = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    int64_t i = index[d];
    LS_CHECK(i >= 0 && i < t.shape()[d], "at: index ", index.str(), " is out of bounds for shape ",
             t.shape().str());
    off += i * t.strides()[d];
  }
  return off;
}

// Element access reads memory directly: the CPU's only.
void check_readable(const Tensor& t, const char* op) {
  LS_CHECK(t.defined(), op, ": input is an undefined tensor");
  LS_CHECK(t.device().is_cpu(), op, ": tensor on ", t.device().str(),
           " but element access reads CPU memory; copy it with .to(kCPU) first");
}
}  // namespace

double Tensor::at(const Dims& index) const {
  check_readable(*this, "at");
  const int64_t off = element_offset(*this, index);
  return cpu::dispatch_all(dtype(), "at", [&]<typename T>() {
    return cpu::convert<double>(static_cast<const T*>(data_ptr())[off]);
  });
}

void Tensor::set_at(const Dims& index, double value) {
  check_readable(*this, "set_at");
  const int64_t off = element_offset(*this, index);
  cpu::dispatch_all(dtype(), "set_at", [&]<typename T>() {
    static_cast<T*>(data_ptr())[off] = cpu::convert<T>(value);
  });
}

// ---- autograd accessors ----

Tensor& Tensor::requires_grad_(bool enabled) {
  LS_CHECK(is_leaf() || enabled, "requires_grad_(false): only leaf tensors can change this; use "
                                  "detach() for a tensor that is the result of an op");
  LS_CHECK(!enabled || is_floating(dtype()), "requires_grad_: only floating-point tensors can "
           "require gradients, got ", dtype_name(dtype()));
  impl_->requires_grad_ = enabled;
  return *this;
}

Tensor Tensor::grad() const {
  if (!impl_->autograd_meta_ || !impl_->autograd_meta_->grad) return Tensor();
  return Tensor(impl_->autograd_meta_->grad);
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined()) {
    LS_CHECK(g.shape() == shape(), "set_grad: gradient of shape ", g.shape().str(),
             " for a tensor of shape ", shape().str());
    LS_CHECK(g.dtype() == dtype(), "set_grad: gradient of dtype ", dtype_name(g.dtype()),
             " for a tensor of dtype ", dtype_name(dtype()));
  }
  impl_->autograd_meta().grad = g.impl_ptr();
}

Tensor Tensor::detach() const {
  return Tensor(std::make_shared<TensorImpl>(storage(), shape(), strides(), offset(), dtype()));
}

int Tensor::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const {
  LS_CHECK(is_leaf() && requires_grad(), "register_post_accumulate_grad_hook: only leaf tensors "
           "that require grad have one (this tensor is ",
           is_leaf() ? "a leaf that does not require grad" : "the result of an op", ")");
  AutogradMeta& m = impl_->autograd_meta();
  int id = m.next_hook_id++;
  m.post_accumulate_grad_hooks.emplace_back(id, std::move(hook));
  return id;
}

void Tensor::remove_post_accumulate_grad_hook(int id) const {
  if (!impl_->autograd_meta_) return;
  auto& hooks = impl_->autograd_meta_->post_accumulate_grad_hooks;
  std::erase_if(hooks, [id](const auto& h) { return h.first == id; });
}

// ---- printing ----

namespace {
constexpr int64_t kPrintEdge = 3;  // elements shown at each end of a long dimension

void print_rec(std::ostream& os, const Tensor& t, Dims& idx, int64_t d, int indent) {
  const int64_t n = t.shape()[d];
  const bool summarize = t.numel() > 1000 && n > 2 * kPrintEdge;
  os << '[';
  for (int64_t i = 0; i < n; ++i) {
    if (summarize && i == kPrintEdge) {
      os << (d + 1 == t.dim() ? "..., " : "...,\n" + std::string(indent + 1, ' '));
      i = n - kPrintEdge;
    }
    idx[d] = i;
    if (d + 1 == t.dim()) {
      double v = t.at(idx);
      if (is_floating(t.dtype())) os << std::setprecision(6) << v;
      else os << static_cast<int64_t>(v);
    } else {
      print_rec(os, t, idx, d + 1, indent + 1);
    }
    if (i + 1 < n) os << (d + 1 == t.dim() ? ", " : ",\n" + std::string(indent + 1, ' '));
  }
  os << ']';
}
}  // namespace

std::string Tensor::to_string() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream os;
  os << "tensor(dtype=" << dtype_name(dtype()) << ", device=" << device().str()
     << ", shape=" << shape().str();
  if (requires_grad()) os << ", requires_grad";
  os << ")\n";
  if (!device().is_cpu()) return os.str() + "<values on device>";
  if (dim() == 0) {
    os << at(Dims{});
  } else if (numel() == 0) {
    os << "[]";
  } else {
    Dims idx = Dims::filled(dim(), 0);
    print_rec(os, *this, idx, 0, 0);
  }
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.to_string(); }

}  // namespace lockstep
