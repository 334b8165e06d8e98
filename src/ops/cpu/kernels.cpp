// The CPU's kernel table: every entry points to a kernel in src/ops/cpu/.
#include "ops/cpu/kernels.h"

namespace lockstep::cpu {

namespace {
constexpr Kernels make_table() {
  Kernels t;
  // One section per area, in the order of Kernels' sections (src/ops/kernels.h).
  // -- tensor methods, creation, copies --
  t.copy = copy_kernel;
  t.fill = fill_kernel;
  t.arange = arange_kernel;
  t.rand_uniform = rand_uniform_kernel;
  t.rand_normal = rand_normal_kernel;
  t.randint = randint_kernel;
  // -- elementwise --
  t.binary = binary_kernel;
  t.binary_scalar = binary_scalar_kernel;
  t.compare = compare_kernel;
  t.compare_scalar = compare_scalar_kernel;
  t.unary = unary_kernel;
  t.unary_backward = unary_backward_kernel;
  t.where = where_kernel;
  t.binary_inplace = binary_inplace_kernel;
  // -- reductions --
  t.sum = sum_kernel;
  t.var = var_kernel;
  t.extreme = extreme_kernel;
  // -- shape ops --
  t.index_bounds = index_bounds_kernel;
  t.index_select = index_select_kernel;
  t.index_add = index_add_kernel;
  t.gather = gather_kernel;
  t.scatter_add = scatter_add_kernel;
  // -- softmax, dropout, embedding --
  t.softmax = softmax_kernel;
  t.softmax_backward = softmax_backward_kernel;
  t.dropout_mask = dropout_mask_kernel;
  t.masked_scale = masked_scale_kernel;
  // -- linalg --
  t.gemm = gemm_kernel;
  t.sum_rows = sum_rows_kernel;
  // -- conv and pooling --
  t.conv2d = conv2d_kernel;
  t.conv2d_backward = conv2d_backward_kernel;
  t.pool2d = pool2d_kernel;
  t.pool2d_backward = pool2d_backward_kernel;
  // -- losses --
  t.cross_entropy = cross_entropy_kernel;
  t.cross_entropy_backward = cross_entropy_backward_kernel;
  t.mse_loss = mse_loss_kernel;
  t.mse_loss_backward = mse_loss_backward_kernel;
  // -- norms --
  t.layer_norm = layer_norm_kernel;
  t.layer_norm_backward = layer_norm_backward_kernel;
  t.batch_norm_stats = batch_norm_stats_kernel;
  t.batch_norm = batch_norm_kernel;
  t.batch_norm_backward = batch_norm_backward_kernel;
  // -- attention --
  t.attention = attention_kernel;
  t.attention_backward = attention_backward_kernel;
  return t;
}
}  // namespace

}  // namespace lockstep::cpu

namespace lockstep::detail {
// constinit: the table is data in the binary, complete before any static initializer runs.
constinit const Kernels kCpuKernels = cpu::make_table();
}  // namespace lockstep::detail
