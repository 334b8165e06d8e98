// Autocast: inside an `amp::autocast` scope, matrix products run with bf16/f16 inputs while
// precision-sensitive ops run in f32, as torch.autocast does. Parameters stay f32 (the master
// copies); their low-precision copies are made once per scope and cached. Per thread.
//
//   {
//     amp::autocast ac(kBFloat16);
//     Tensor loss = cross_entropy(model.forward(x), y);  // linear in bf16, loss in f32
//   }
//   loss.backward();  // f32 gradients for the f32 parameters
#pragma once

#include <string_view>

#include "lockstep/tensor/tensor.h"

namespace lockstep::amp {

// What an op does with its floating-point inputs inside an autocast scope.
enum class CastPolicy {
  kLowPrecision,  // f32 inputs are cast to the scope's dtype (bf16/f16); f32 accumulation
  kFloat32,       // bf16/f16 inputs are cast to f32
  kPromote,       // inputs are left alone; mixed dtypes promote to the widest (elementwise ops)
};

// The policy of an op by name ("linear", "softmax", ...); ops not in the table promote. The table
// is in src/ops/autocast.cpp, the only place it is written.
CastPolicy cast_policy(std::string_view op);
const char* policy_name(CastPolicy p);

class autocast {
 public:
  // dtype must be bf16 or f16. enabled = false makes a scope that turns autocast off (for a
  // region inside an enabled one, as torch.autocast(enabled=False)).
  explicit autocast(DType dtype = kBFloat16, bool enabled = true);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
};

bool is_autocast_enabled();
DType autocast_dtype();
// Low-precision copies currently cached (parameters cast in this scope); for tests.
int64_t autocast_cache_size();

namespace detail {
// For op implementations: `t` as the op's policy wants it in the current scope (unchanged when
// autocast is off, for undefined tensors and for non-floating dtypes). Casts are differentiable;
// leaf tensors that require grad (parameters) are cast once per outermost scope.
Tensor autocast_arg(const Tensor& t, CastPolicy policy);

// Called by the autograd engine at the start of every backward: cached low-precision copies
// made before it are dropped (their cast nodes are released by that backward).
void note_backward();

// Turns autocast off on this thread while alive: an op that has cast its arguments calls its
// own implementation without casting again.
class AutocastSuspend {
 public:
  AutocastSuspend();
  ~AutocastSuspend();
  AutocastSuspend(const AutocastSuspend&) = delete;
  AutocastSuspend& operator=(const AutocastSuspend&) = delete;

 private:
  bool prev_;
};
}  // namespace detail

}  // namespace lockstep::amp
