// The f32 attention kernels for x86-64 CPUs with AVX2 and FMA (Note [Attention micro-kernel] in
// attention_avx2.cpp); attention.cpp calls them per head when attention_avx2_enabled().
#pragma once

#include <cstdint>

namespace lockstep::cpu {

// Sizes of one head: tq queries and tk keys, key dim d, value dim dv; and the row strides of its
// matrices (elements from one row to the next; within a row they are contiguous), so that q, k,
// v may be strided views of one projection (Note [Strided attention inputs] in
// src/ops/attention.cpp). The forward reads ldq, ldk, ldv, ldo; the backward all of them.
struct AttentionHead {
  int64_t tq, tk, d, dv;
  int64_t ldq = 0, ldk = 0, ldv = 0, ldo = 0, ldg = 0, lddq = 0, lddk = 0, lddv = 0;
};

// True when this CPU runs AVX2 + FMA and set_attention_avx2(false) was not called.
bool attention_avx2_enabled();
// Tests turn the AVX2 kernels off to check the portable ones (BLAS tiles) on the same machine.
void set_attention_avx2(bool enabled);
// True when the AVX2 kernels' softmax exps run 16 lanes at a time (Note [Attention exps on
// AVX-512]): the CPU has AVX-512F and set_attention_avx512(false) was not called. Tests turn it
// off to compare the bits on the same machine.
bool attention_avx512_enabled();
void set_attention_avx512(bool enabled);

// Asks the caches for rows x cols floats at p, rows ld apart (into L2): the next head's
// operands while this one computes (Note [Prefetching the next head]).
void attention_prefetch_rows(const float* p, int64_t rows, int64_t ld, int64_t cols);

// One head's forward: o (tq, dv) and lse (tq) from q (tq, d), k (tk, d), v (tk, dv), rows at
// the strides in n. Only call when attention_avx2_enabled().
void attention_forward_head_avx2(const float* q, const float* k, const float* v, float* o,
                                 float* lse, const AttentionHead& n, float scale, bool causal);

// One head's backward: dq, dk, dv (overwritten) from the output gradient g, the inputs, the
// forward's output o and lse.
void attention_backward_head_avx2(float* dq, float* dk, float* dv, const float* g, const float* q,
                                  const float* k, const float* v, const float* o, const float* lse,
                                  const AttentionHead& n, float scale, bool causal);

}  // namespace lockstep::cpu
