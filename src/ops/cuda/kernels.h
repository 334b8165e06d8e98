// The CUDA kernel table: each area of src/ops/kernels.h fills its entries from its own file in
// src/ops/cuda/, the way src/ops/cpu/kernels.cpp fills the CPU's.
#pragma once

#include "ops/kernels.h"

namespace lockstep::cuda_ops {

using detail::Kernels;

// One per area, in the order of Kernels' sections.
void fill_tensor_kernels(Kernels& k);       // copy, fill (copy.cu)
void fill_factory_kernels(Kernels& k);      // arange, rand_uniform, rand_normal, randint (factory.cu)
void fill_elementwise_kernels(Kernels& k);  // binary .. binary_inplace (elementwise.cu)
void fill_reduce_kernels(Kernels& k);       // sum, var, extreme (reduce.cu)
void fill_shape_kernels(Kernels& k);        // index_bounds .. scatter_add (index.cu)
void fill_softmax_kernels(Kernels& k);      // softmax, dropout (softmax.cu)
void fill_linalg_kernels(Kernels& k);       // gemm (cuBLASLt), sum_rows (linalg.cu)
void fill_conv_kernels(Kernels& k);         // conv2d (cuDNN), pooling (conv.cu)
void fill_loss_kernels(Kernels& k);         // cross_entropy, mse_loss (loss.cu)
void fill_norm_kernels(Kernels& k);         // layer_norm, batch_norm (norm.cu)
void fill_attention_kernels(Kernels& k);    // attention, attention_backward (attention.cu)
void fill_multi_tensor_kernels(Kernels& k); // unscale_check, sgd_update, adamw_update

// The table, filled once on first use.
const Kernels& table();

}  // namespace lockstep::cuda_ops
