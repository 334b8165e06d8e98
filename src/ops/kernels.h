// The seam between each op's front and its kernels: one table of kernel entry points per device
// type, as ggml has one table of operations per backend.
#pragma once

#include <vector>

#include "lockstep/base/error.h"
#include "lockstep/ops/nn.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::detail {

// Note [Kernel tables]
// An op's front (src/ops/<op>.cpp) checks its arguments, broadcasts, applies autocast, allocates
// the output and records the backward; then it asks for the kernel of the device its tensors are
// on, in one place per op:
//
//   kernel(&Kernels::binary, out.device(), "add")(BinaryOp::add, out, a, b);
//
// and calls it. Kernels receive tensors that are already checked, broadcast (stride-0 views) and
// of the dtype they compute in; they only compute. Each device type has one `Kernels` table:
// src/ops/cpu/kernels.cpp fills the CPU's, and a CUDA build adds src/ops/cuda/ with its own table
// without touching any front. An entry left null means "no kernel for this device": `kernel()`
// throws naming the op and the device. Dispatch costs one indirect call per op, never per
// element: the kernel switches on its op enum and dtype once and runs a typed loop.

// Argument types of the kernels of the areas tensor methods, elementwise, reductions, shape ops.
// Ops that share a loop shape share one entry and an op enum, so the table stays small.
enum class BinaryOp : uint8_t { add, sub, mul, div, pow, maximum, minimum };
// a op s with a scalar s: rsub is s - a, square is a * a (pow with exponent 2).
enum class ScalarOp : uint8_t { add, mul, div, rsub, pow, square };
// isnan and isfinite look at a only (compare_scalar ignores its scalar for them).
enum class CompareOp : uint8_t { eq, ne, lt, le, gt, ge, isnan, isfinite };
// neg .. clamp keep a numeric dtype; exp .. gelu_tanh compute in f32/f64. clamp's bounds are
// the kernel's p0, p1.
enum class UnaryOp : uint8_t {
  neg, abs, sign, relu, clamp, exp, log, sqrt, rsqrt, tanh, sigmoid, gelu, gelu_tanh
};

// A reduction's split of the input's dims into kept (one output each) and reduced ones.
struct ReducePlan {
  Dims keep_shape, keep_strides;  // input strides of the kept dims
  Dims red_shape, red_strides;    // input strides of the reduced dims
  Dims out_shape;                 // with or without the kept size-1 dims
  Dims keepdim_shape;             // always with them
  int64_t count = 1;              // elements reduced per output
};

// The first index entry outside [0, size): its row-major position (-1: none) and value.
struct BadIndex {
  int64_t position = -1;
  int64_t value = 0;
};

// Argument types of the kernels of the areas linalg, conv and pooling, losses, norms.
// The window of a 2-D convolution or pooling over one input plane.
struct ConvGeometry {
  int64_t height = 0, width = 0;  // input plane
  int64_t kernel_h = 1, kernel_w = 1;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
  int64_t out_h = 0, out_w = 0;  // output plane

  int64_t out_plane() const { return out_h * out_w; }
};

enum class PoolKind : uint8_t { max, avg };

// What a loss kernel found in its class targets: how many are not ignore_index, and the first
// one outside [0, classes) that is not (the front throws for it).
struct TargetCheck {
  int64_t count = 0;
  BadIndex bad;
};

// Per-tensor scalars of the fused optimizer updates (src/optim/optimizer.cpp).
struct SgdScalars {
  double lr = 0, weight_decay = 0, momentum = 0, dampening = 0;
  bool nesterov = false;
};
struct AdamWScalars {
  double lr = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0;
};
// What differs between the tensors of one AdamW update: the step count's bias corrections.
struct AdamWStep {
  double step_size = 0;  // lr / (1 - beta1^t)
  double bc2_sqrt = 1;   // sqrt(1 - beta2^t)
};

struct Kernels {
  // Filled per area; each area's entries are declared in its own section below.
#define LS_KERNEL_ENTRY(name, ...) void (*name)(__VA_ARGS__) = nullptr;
  // -- tensor methods, creation, copies (src/ops/tensor_ops.cpp, src/ops/factory.cpp) --
  // dst = src converted to dst's dtype; src is expanded to dst's shape and shares no memory
  // with it in another layout. A device's copy also moves data between it and the CPU.
  LS_KERNEL_ENTRY(copy, const Tensor& dst, const Tensor& src)
  LS_KERNEL_ENTRY(fill, const Tensor& dst, double value)
  // Contiguous `out` = start + i * step; the random fills follow Note [Random tensors]
  // (src/ops/factory.cpp) from Philox block `start` of `seed`.
  LS_KERNEL_ENTRY(arange, const Tensor& out, double start, double step)
  LS_KERNEL_ENTRY(rand_uniform, const Tensor& out, uint64_t seed, uint64_t start, double low,
                  double high)
  LS_KERNEL_ENTRY(rand_normal, const Tensor& out, uint64_t seed, uint64_t start, double mean,
                  double std)
  LS_KERNEL_ENTRY(randint, const Tensor& out, uint64_t seed, uint64_t start, int64_t low,
                  int64_t high)
  // -- elementwise (src/ops/elementwise.cpp) --
  // Operands of one numeric dtype (f32, f64, i32, i64, u8; 16-bit floats are computed in f32 by
  // the front), inputs expanded to out's shape; `alpha` scales b in add and sub.
  LS_KERNEL_ENTRY(binary, BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                  double alpha)
  LS_KERNEL_ENTRY(binary_scalar, ScalarOp op, const Tensor& out, const Tensor& a, double s)
  // bool out; a and b of one numeric dtype.
  LS_KERNEL_ENTRY(compare, CompareOp op, const Tensor& out, const Tensor& a, const Tensor& b)
  LS_KERNEL_ENTRY(compare_scalar, CompareOp op, const Tensor& out, const Tensor& a, double s)
  // The CPU's unary and unary_backward also take contiguous bf16 for gelu_tanh (Note [bf16 GELU]
  // in src/ops/cpu/elementwise.cpp).
  LS_KERNEL_ENTRY(unary, UnaryOp op, const Tensor& out, const Tensor& a, double p0, double p1)
  // out = d op(x)/dx * g, of one floating dtype; `saved` is the op's input x, or its output y
  // for exp, sqrt, rsqrt, tanh, sigmoid.
  LS_KERNEL_ENTRY(unary_backward, UnaryOp op, const Tensor& out, const Tensor& g,
                  const Tensor& saved, double p0, double p1)
  // out = cond ? a : b; cond bool, a and b of out's dtype, all expanded to out's shape.
  LS_KERNEL_ENTRY(where, const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b)
  // self = self op other (add: self + alpha * other, mul), any dtype; other is of self's dtype,
  // expanded to its shape, and does not alias it.
  LS_KERNEL_ENTRY(binary_inplace, BinaryOp op, const Tensor& self, const Tensor& other,
                  double alpha)
  // -- reductions (src/ops/reduce.cpp) --
  // sum * scale over the plan's reduced dims; f32/f64 out of a's dtype, integers into i64.
  LS_KERNEL_ENTRY(sum, const Tensor& out, const Tensor& a, const ReducePlan& plan, double scale)
  // Sum of squared deviations / denom; f32/f64.
  LS_KERNEL_ENTRY(var, const Tensor& out, const Tensor& a, const ReducePlan& plan, double denom)
  // Largest (smallest) value and its first index (i64) per output; NaN wins. Numeric dtypes.
  LS_KERNEL_ENTRY(extreme, const Tensor& values, const Tensor& indices, const Tensor& a,
                  const ReducePlan& plan, bool is_max)
  // -- shape ops (src/ops/shape.cpp) --
  // Index tensors are i64 or i32; *bad receives the first entry outside [0, size).
  LS_KERNEL_ENTRY(index_bounds, const Tensor& index, int64_t size, BadIndex* bad)
  // out.select(dim, i) = src.select(dim, index[i]); src contiguous, index 1-D contiguous, checked.
  LS_KERNEL_ENTRY(index_select, const Tensor& out, const Tensor& src, int64_t dim,
                  const Tensor& index)
  // dst.select(dim, index[i]) += src.select(dim, i); dst and src contiguous f32/f64.
  LS_KERNEL_ENTRY(index_add, const Tensor& dst, int64_t dim, const Tensor& index,
                  const Tensor& src)
  // out[.., j, ..] = src[.., index[.., j, ..], ..] along dim (torch.gather); out and index
  // contiguous, index checked.
  LS_KERNEL_ENTRY(gather, const Tensor& out, const Tensor& src, int64_t dim, const Tensor& index)
  // gather's adjoint: dst[.., index[p], ..] += src[p]; dst, index, src contiguous, f32/f64.
  LS_KERNEL_ENTRY(scatter_add, const Tensor& dst, int64_t dim, const Tensor& index,
                  const Tensor& src)
  // -- softmax, dropout, embedding --
  // Row-wise along dim, f32/f64, any strides (embedding uses index_select and index_add).
  LS_KERNEL_ENTRY(softmax, const Tensor& y, const Tensor& x, int64_t dim, bool log)
  LS_KERNEL_ENTRY(softmax_backward, const Tensor& dx, const Tensor& g, const Tensor& y,
                  int64_t dim, bool log)
  // Contiguous u8 mask: element i keeps (1) when lane i % 4 of Philox block start + i / 4 of
  // `seed`, as u in [0, 1), is >= p.
  LS_KERNEL_ENTRY(dropout_mask, const Tensor& mask, uint64_t seed, uint64_t start, double p)
  // out = x * mask * scale; contiguous, any floating dtype.
  LS_KERNEL_ENTRY(masked_scale, const Tensor& out, const Tensor& x, const Tensor& mask,
                  double scale)
  // -- linalg (src/ops/linalg.cpp) --
  // c = a @ b (+ bias added to every row when defined). a (..., m, k) and b (..., k, n), any
  // strides, have batch dims that broadcast to c's (batch..., m, n); c is contiguous. a and b
  // share one floating dtype; c has it for f32 and f64 and is f32 for bf16 and f16 (the
  // products accumulate in f32). bias (n) has c's dtype. The one GEMM of matmul and linear.
  // The CPU kernel also takes a bf16 c for bf16 operands (with an f32 bias) and rounds once.
  LS_KERNEL_ENTRY(gemm, const Tensor& c, const Tensor& a, const Tensor& b, const Tensor& bias)
  // out (n) = column sums of g (rows x n, any strides), f32/f64 accumulated in double in an
  // order that does not depend on threads: linear's bias gradient. The CPU kernel also takes a
  // bf16 or f16 g with an f32 out. (The reduction kernel's sum
  // over dim 0 walks each column with a stride: 0.2 ms at (64, 1024), where the whole linear
  // forward and backward takes 3 ms.)
  LS_KERNEL_ENTRY(sum_rows, const Tensor& out, const Tensor& g)
  // -- conv and pooling (src/ops/conv.cpp, src/ops/pool.cpp) --
  // x (N, C, H, W), w (O, C / groups, kh, kw), bias (O) or undefined, out (N, O, Ho, Wo): all
  // contiguous, of one floating dtype (bf16 accumulates in f32 and rounds once).
  LS_KERNEL_ENTRY(conv2d, const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& bias,
                  const ConvGeometry& geo, int64_t groups)
  // Overwrites each defined gradient: dx like x, dw like w, db (O); g is like out.
  LS_KERNEL_ENTRY(conv2d_backward, const Tensor& dx, const Tensor& dw, const Tensor& db,
                  const Tensor& g, const Tensor& x, const Tensor& w, const ConvGeometry& geo,
                  int64_t groups)
  // Every (H, W) plane of contiguous f32/f64 x into out's (Ho, Wo) plane; max also writes each
  // winner's flat position h * W + w in its plane into `indices` (i64, like out).
  LS_KERNEL_ENTRY(pool2d, PoolKind kind, const Tensor& out, const Tensor& indices,
                  const Tensor& x, const ConvGeometry& geo)
  // Overwrites dx (like x) from g (like out); max reads the forward's indices.
  LS_KERNEL_ENTRY(pool2d_backward, PoolKind kind, const Tensor& dx, const Tensor& g,
                  const Tensor& indices, const ConvGeometry& geo)
  // -- losses (src/ops/loss.cpp) --
  // Rows of logits (N, C, d...) along dim 1, f32/f64, any strides; targets contiguous i64, one
  // per row (row-major over the other dims). Writes each row's log-sum-exp into lse (rows) and
  // into out the label-smoothed NLL: per row (rows) for Reduction::none (0 where ignored), else
  // a 0-dim sum, or mean over the non-ignored rows. *check receives the targets' count and first
  // bad entry (out is then unspecified).
  LS_KERNEL_ENTRY(cross_entropy, const Tensor& out, const Tensor& lse, const Tensor& logits,
                  const Tensor& targets, Reduction reduction, int64_t ignore_index,
                  double smoothing, TargetCheck* check)
  // dx contiguous like logits; g is out's gradient, of logits' dtype; count as *check had it.
  LS_KERNEL_ENTRY(cross_entropy_backward, const Tensor& dx, const Tensor& g,
                  const Tensor& logits, const Tensor& targets, const Tensor& lse,
                  Reduction reduction, int64_t ignore_index, double smoothing, int64_t count)
  // Contiguous x and t of one shape, f32/f64; out like x for none, else 0-dim.
  LS_KERNEL_ENTRY(mse_loss, const Tensor& out, const Tensor& x, const Tensor& t,
                  Reduction reduction)
  // Overwrites each defined gradient gx, gt (like x) from g (out's gradient).
  LS_KERNEL_ENTRY(mse_loss_backward, const Tensor& gx, const Tensor& gt, const Tensor& g,
                  const Tensor& x, const Tensor& t, Reduction reduction)
  // -- norms: layer_norm, batch_norm (src/ops/norm.cpp, src/ops/batch_norm.cpp) --
  // Rows of contiguous x (M, N), f32/f64; weight and bias (N) or undefined. Writes y (M, N) and
  // each row's mean and 1/std (M) for the backward.
  LS_KERNEL_ENTRY(layer_norm, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                  const Tensor& x, const Tensor& weight, const Tensor& bias, double eps)
  // Overwrites each defined gradient: dx (M, N), dweight and dbias (N); g (M, N) contiguous.
  LS_KERNEL_ENTRY(layer_norm_backward, const Tensor& dx, const Tensor& dweight,
                  const Tensor& dbias, const Tensor& g, const Tensor& x, const Tensor& weight,
                  const Tensor& mean, const Tensor& rstd)
  // Per channel (dim 1) of contiguous x (N, C, *), f32/f64: the mean and biased variance (C),
  // in one pass over x.
  LS_KERNEL_ENTRY(batch_norm_stats, const Tensor& mean, const Tensor& var, const Tensor& x)
  // y = (x - mean) / sqrt(var + eps) * weight + bias per channel; weight, bias undefined or (C).
  LS_KERNEL_ENTRY(batch_norm, const Tensor& y, const Tensor& x, const Tensor& mean,
                  const Tensor& var, const Tensor& weight, const Tensor& bias, double eps)
  // Overwrites each defined gradient: dx like x, dweight and dbias (C). mean and var are the
  // statistics the forward used: the batch's own when training (their dependence on x enters
  // dx), constants (running statistics) when not.
  LS_KERNEL_ENTRY(batch_norm_backward, const Tensor& dx, const Tensor& dweight,
                  const Tensor& dbias, const Tensor& g, const Tensor& x, const Tensor& mean,
                  const Tensor& var, const Tensor& weight, double eps, bool training)
  // -- attention (src/ops/attention.cpp) --
  // q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv), f32/f64, with the same leading (batch,
  // head) dims, N heads in all; each row contiguous, rows and heads at any strides (Note
  // [Strided attention inputs] in src/ops/attention.cpp). Writes out (..., Tq, Dv), strided
  // alike, = softmax(q k^T * scale, causal mask when causal) v and each query row's log-sum-exp
  // of its scaled scores, lse (N, Tq, contiguous), for the backward.
  LS_KERNEL_ENTRY(attention, const Tensor& out, const Tensor& lse, const Tensor& q,
                  const Tensor& k, const Tensor& v, double scale, bool causal)
  // Overwrites dq, dk, dv (shaped like q, k, v) from g (out's gradient) and the forward's out
  // and lse, recomputing the probabilities tile by tile; all strided as above.
  LS_KERNEL_ENTRY(attention_backward, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                  const Tensor& g, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& out, const Tensor& lse, double scale, bool causal)
  // -- multi-tensor updates (src/amp/grad_scaler.cpp, src/optim/optimizer.cpp) --
  // One launch over a list of contiguous tensors of one device, however many (Note [Multi-tensor
  // kernels] in src/ops/cuda/multi_tensor.cu). The CPU keeps its own parallel loops in amp/ and
  // optim/ and leaves these null.
  // Every g of grads (f32, f64, bf16 or f16) *= inv in place; found_inf (f32, 1 element, same
  // device) becomes 1 when any result is inf or NaN and is left alone otherwise.
  LS_KERNEL_ENTRY(unscale_check, const std::vector<Tensor>& grads, double inv,
                  const Tensor& found_inf)
  // SGD with momentum (PyTorch's formula, as src/optim/optimizer.cpp); params, grads and bufs
  // pairwise of one shape and dtype (f32/f64); bufs empty when momentum is 0; first[i]: buffer i
  // is new (it takes the gradient as it is).
  LS_KERNEL_ENTRY(sgd_update, const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  const std::vector<Tensor>& bufs, const std::vector<uint8_t>& first,
                  const SgdScalars& o)
  // Decoupled AdamW; exp_avg and exp_avg_sq like the params; steps[i] for tensor i.
  LS_KERNEL_ENTRY(adamw_update, const std::vector<Tensor>& params,
                  const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avg,
                  const std::vector<Tensor>& exp_avg_sq, const std::vector<AdamWStep>& steps,
                  const AdamWScalars& o)
#undef LS_KERNEL_ENTRY
};

// The CPU's table, built at compile time (src/ops/cpu/kernels.cpp): looking up a CPU kernel is
// two loads, no call and no guard, since tiny ops pay for every instruction here.
extern const Kernels kCpuKernels;

// The table of any other device type, or nullptr when this build has none (a CPU-only build asked
// for cuda). Defined in src/ops/kernels.cpp, the one place that knows which device tables exist.
const Kernels* device_kernels(DeviceType type);
// The table of emulated CUDA devices (Note [Emulated kernels] in src/ops/kernels.cpp).
const Kernels& emulated_kernels();

inline const Kernels* kernels_of(DeviceType type) {
  if (type == DeviceType::cpu) [[likely]] return &kCpuKernels;
  return device_kernels(type);
}

// Whether `device`'s table has the kernel `entry` (the multi-tensor entries, which the CPU's table
// leaves to loops in optim/ and amp/, Note [Multi-tensor kernels]).
template <typename Fn>
bool has_kernel(Fn Kernels::*entry, const Device& device) {
  const Kernels* table = kernels_of(device.type);
  return table != nullptr && table->*entry != nullptr;
}

[[noreturn]] void throw_no_kernel(const char* op, const Device& device, bool device_has_table);

// The kernel `entry` of `device`'s table; throws "<op>: no kernel for <device> ..." when the
// build has no table for the device or the table has no such kernel.
template <typename Fn>
Fn kernel(Fn Kernels::*entry, const Device& device, const char* op) {
  const Kernels* table = kernels_of(device.type);
  if (table != nullptr && table->*entry != nullptr) [[likely]] return table->*entry;
  throw_no_kernel(op, device, table != nullptr);
}

}  // namespace lockstep::detail
