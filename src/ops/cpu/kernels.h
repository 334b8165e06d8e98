// The CPU's kernel table and the declarations of its kernels (defined in src/ops/cpu/*.cpp).
#pragma once

#include "ops/kernels.h"

namespace lockstep::cpu {

using detail::BadIndex;
using detail::BinaryOp;
using detail::CompareOp;
using detail::Kernels;
using detail::ReducePlan;
using detail::ScalarOp;
using detail::UnaryOp;

// The table itself is detail::kCpuKernels (Note [Kernel tables] in src/ops/kernels.h).

// Kernel declarations, one section per area, in the order of Kernels' sections.

// -- tensor methods, creation, copies (src/ops/cpu/copy.cpp, src/ops/cpu/factory.cpp) --
void copy_kernel(const Tensor& dst, const Tensor& src);
void fill_kernel(const Tensor& dst, double value);
void arange_kernel(const Tensor& out, double start, double step);
void rand_uniform_kernel(const Tensor& out, uint64_t seed, uint64_t start, double low,
                         double high);
void rand_normal_kernel(const Tensor& out, uint64_t seed, uint64_t start, double mean,
                        double std);
void randint_kernel(const Tensor& out, uint64_t seed, uint64_t start, int64_t low, int64_t high);

// -- elementwise (src/ops/cpu/elementwise.cpp) --
void binary_kernel(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                   double alpha);
void binary_scalar_kernel(ScalarOp op, const Tensor& out, const Tensor& a, double s);
void compare_kernel(CompareOp op, const Tensor& out, const Tensor& a, const Tensor& b);
void compare_scalar_kernel(CompareOp op, const Tensor& out, const Tensor& a, double s);
void unary_kernel(UnaryOp op, const Tensor& out, const Tensor& a, double p0, double p1);
void unary_backward_kernel(UnaryOp op, const Tensor& out, const Tensor& g, const Tensor& saved,
                           double p0, double p1);
void where_kernel(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
void binary_inplace_kernel(BinaryOp op, const Tensor& self, const Tensor& other, double alpha);

// -- reductions (src/ops/cpu/reduce.cpp) --
void sum_kernel(const Tensor& out, const Tensor& a, const ReducePlan& plan, double scale);
void var_kernel(const Tensor& out, const Tensor& a, const ReducePlan& plan, double denom);
void extreme_kernel(const Tensor& values, const Tensor& indices, const Tensor& a,
                    const ReducePlan& plan, bool is_max);

// -- shape ops (src/ops/cpu/index.cpp) --
void index_bounds_kernel(const Tensor& index, int64_t size, BadIndex* bad);
void index_select_kernel(const Tensor& out, const Tensor& src, int64_t dim, const Tensor& index);
void index_add_kernel(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src);
void gather_kernel(const Tensor& out, const Tensor& src, int64_t dim, const Tensor& index);
void scatter_add_kernel(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src);

// -- softmax, dropout, embedding (src/ops/cpu/softmax.cpp, src/ops/cpu/dropout.cpp) --
void softmax_kernel(const Tensor& y, const Tensor& x, int64_t dim, bool log);
void softmax_backward_kernel(const Tensor& dx, const Tensor& g, const Tensor& y, int64_t dim,
                             bool log);
void dropout_mask_kernel(const Tensor& mask, uint64_t seed, uint64_t start, double p);
void masked_scale_kernel(const Tensor& out, const Tensor& x, const Tensor& mask, double scale);

// -- linalg (src/ops/cpu/gemm.cpp) --
void gemm_kernel(const Tensor& c, const Tensor& a, const Tensor& b, const Tensor& bias);
void sum_rows_kernel(const Tensor& out, const Tensor& g);

// -- conv and pooling (src/ops/cpu/conv.cpp, src/ops/cpu/pool.cpp) --
void conv2d_kernel(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& bias,
                   const detail::ConvGeometry& geo, int64_t groups);
void conv2d_backward_kernel(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& g,
                            const Tensor& x, const Tensor& w, const detail::ConvGeometry& geo,
                            int64_t groups);
void pool2d_kernel(detail::PoolKind kind, const Tensor& out, const Tensor& indices,
                   const Tensor& x, const detail::ConvGeometry& geo);
void pool2d_backward_kernel(detail::PoolKind kind, const Tensor& dx, const Tensor& g,
                            const Tensor& indices, const detail::ConvGeometry& geo);

// -- losses (src/ops/cpu/loss.cpp) --
void cross_entropy_kernel(const Tensor& out, const Tensor& lse, const Tensor& logits,
                          const Tensor& targets, Reduction reduction, int64_t ignore_index,
                          double smoothing, detail::TargetCheck* check);
void cross_entropy_backward_kernel(const Tensor& dx, const Tensor& g, const Tensor& logits,
                                   const Tensor& targets, const Tensor& lse, Reduction reduction,
                                   int64_t ignore_index, double smoothing, int64_t count);
void mse_loss_kernel(const Tensor& out, const Tensor& x, const Tensor& t, Reduction reduction);
void mse_loss_backward_kernel(const Tensor& gx, const Tensor& gt, const Tensor& g,
                              const Tensor& x, const Tensor& t, Reduction reduction);

// -- norms (src/ops/cpu/norm.cpp) --
void layer_norm_kernel(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& weight, const Tensor& bias, double eps);
void layer_norm_backward_kernel(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                const Tensor& g, const Tensor& x, const Tensor& weight,
                                const Tensor& mean, const Tensor& rstd);
void batch_norm_stats_kernel(const Tensor& mean, const Tensor& var, const Tensor& x);
void batch_norm_kernel(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& var,
                       const Tensor& weight, const Tensor& bias, double eps);
void batch_norm_backward_kernel(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                const Tensor& g, const Tensor& x, const Tensor& mean,
                                const Tensor& var, const Tensor& weight, double eps,
                                bool training);

// -- attention (src/ops/cpu/attention.cpp) --
void attention_kernel(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                      const Tensor& v, double scale, bool causal);
void attention_backward_kernel(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                               const Tensor& g, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& out, const Tensor& lse, double scale, bool causal);

}  // namespace lockstep::cpu
