// scaled_dot_product_attention: softmax(q k^T * scale) v as one fused op that never holds the
// (T, T) attention matrix (Note [Fused attention] in src/ops/attention.cpp).
#pragma once

#include "lockstep/tensor/tensor.h"

namespace lockstep {

struct AttentionOptions {
  bool is_causal = false;  // query i attends to keys 0..i only
  double scale = 0.0;      // multiplies q k^T; 0 means 1 / sqrt(head dim)
};

// q (B, H, Tq, D), k (B, H, Tk, D), v (B, H, Tk, Dv) -> (B, H, Tq, Dv), as PyTorch's
// F.scaled_dot_product_attention without dropout or an explicit mask. Any number of leading
// dims, at least one ((H, T, D) works too), equal in q, k and v (no broadcasting). f32 and f64
// compute in their own dtype, bf16 and f16 in f32. is_causal requires Tq == Tk.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& opts = {});

}  // namespace lockstep
