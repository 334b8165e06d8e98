// Matrix products through BLAS.
#pragma once

#include <string>

#include "lockstep/tensor/tensor.h"

namespace lockstep {

// 1-D/2-D/batched as torch.matmul: batch dimensions broadcast; transposed operands are passed
// to BLAS as flags, not copied. f32 and f64 (bf16/f16 compute in f32).
Tensor matmul(const Tensor& a, const Tensor& b);
// How bf16 matrix products run in this build on this CPU: "oneDNN <implementation>" (bf16
// hardware GEMM, f32 accumulation) or "convert to f32 + sgemm".
std::string bf16_matmul_backend();
// x @ w^T + b with the bias fused into the product; x is (..., in), w is (out, in), b is (out).
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = Tensor());

}  // namespace lockstep
