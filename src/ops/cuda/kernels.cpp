// The CUDA kernel table, filled once from every area's fill function.
#include "ops/cuda/kernels.h"

namespace lockstep::cuda_ops {

namespace {
Kernels make_table() {
  Kernels k;
  fill_tensor_kernels(k);
  fill_factory_kernels(k);
  fill_elementwise_kernels(k);
  fill_reduce_kernels(k);
  fill_shape_kernels(k);
  fill_softmax_kernels(k);
  fill_linalg_kernels(k);
  fill_conv_kernels(k);
  fill_loss_kernels(k);
  fill_norm_kernels(k);
  fill_attention_kernels(k);
  fill_multi_tensor_kernels(k);
  return k;
}
}  // namespace

const Kernels& table() {
  static const Kernels k = make_table();
  return k;
}

}  // namespace lockstep::cuda_ops
