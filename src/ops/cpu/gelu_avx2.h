// GELU's tanh approximation on f32 (and bf16) with AVX2 + FMA (Note [GELU on AVX2] in gelu_avx2.cpp), for
// contiguous tensors; elementwise.cpp calls them and falls back to its portable loops when they
// return false (a CPU without AVX2, or not x86-64).
#pragma once

#include <cstdint>

namespace lockstep::cpu {

// True when the f32 kernels run 16 lanes at a time (Note [GELU on AVX-512]): the CPU has
// AVX-512F and set_gelu_avx512(false) was not called. Tests turn it off to compare the bits.
bool gelu_avx512_enabled();
void set_gelu_avx512(bool enabled);

// y[i] = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) for i < n.
bool gelu_tanh_f32_avx2(float* y, const float* x, int64_t n);
// dx[i] = g[i] * d gelu_tanh / dx at x[i] for i < n.
bool gelu_tanh_backward_f32_avx2(float* dx, const float* g, const float* x, int64_t n);
// The same on bf16 bit patterns (autocast's MLP): each value converted to f32 in a register,
// computed as above and rounded once, bit for bit the f32 kernel between .to(kFloat32) and
// .to(kBFloat16) without the two f32 copies in memory.
bool gelu_tanh_bf16_avx2(uint16_t* y, const uint16_t* x, int64_t n);
bool gelu_tanh_backward_bf16_avx2(uint16_t* dx, const uint16_t* g, const uint16_t* x, int64_t n);

}  // namespace lockstep::cpu
