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
#include <tuple>
#include <type_traits>

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

// The one autocast prologue of an op (see LS_AUTOCAST below): casts every Tensor argument as
// `policy` wants it, then calls `f` on the cast arguments with autocast suspended, so that the op
// runs its own implementation once without casting again. Other arguments pass through.
template <typename F, typename... Args>
Tensor autocast_call(CastPolicy policy, const F& f, const Args&... args) {
  auto cast = [policy](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, Tensor>) {
      return autocast_arg(a, policy);
    } else {
      return a;
    }
  };
  // All casts happen before the suspension: they are themselves ops that record a backward.
  auto cast_args = std::tuple{cast(args)...};
  AutocastSuspend off;
  return std::apply(f, cast_args);
}
}  // namespace detail

}  // namespace lockstep::amp

// LS_AUTOCAST("linear", linear, x, w, b): the first line of an op that autocast applies to. Inside
// an enabled autocast scope it returns `fn(args...)` with the Tensor arguments cast per the op's
// policy (Note [Autocast policy] in src/ops/autocast.cpp; the policy is looked up once per call
// site); outside one it does nothing and the op goes on.
#define LS_AUTOCAST(name, fn, ...)                                                     \
  if (::lockstep::amp::is_autocast_enabled()) {                                        \
    static const ::lockstep::amp::CastPolicy ls_autocast_policy_ =                     \
        ::lockstep::amp::cast_policy(name);                                            \
    return ::lockstep::amp::detail::autocast_call(                                     \
        ls_autocast_policy_, [&](const auto&... ls_args_) { return fn(ls_args_...); }, \
        __VA_ARGS__);                                                                  \
  }
