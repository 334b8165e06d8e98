// layer_norm's f32 rows on AVX2 (Note [layer_norm on AVX2] in norm_avx2.cpp): the same
// arithmetic as the portable loops of norm.cpp, vectorized, so the same bits. norm.cpp calls
// them per row when layer_norm_avx2_enabled().
#pragma once

#include <cstdint>

namespace lockstep::cpu {

// True when this CPU runs AVX2 and set_layer_norm_avx2(false) was not called.
bool layer_norm_avx2_enabled();
// Tests turn the AVX2 rows off to compare them with the portable loops on the same machine.
void set_layer_norm_avx2(bool enabled);

// One row of n: y = (x - mean) * rstd (* w) (+ b), w and b optional; writes the row's mean and
// 1/std as the portable loop computes them (f64 sums of four interleaved lanes).
void layer_norm_row_f32_avx2(float* y, float* mean, float* rstd, const float* x, const float* w,
                             const float* b, int64_t n, double eps);

// One row's backward: dw_acc[i] += g * xhat and db_acc[i] += g (f64) when dw_acc is not null;
// dx (when not null) = rstd * (wg - mean(wg) - xhat * mean(wg * xhat)), wg = g * w (or g).
void layer_norm_backward_row_f32_avx2(float* dx, double* dw_acc, double* db_acc, const float* g,
                                      const float* x, const float* w, float mean, float rstd,
                                      int64_t n);

}  // namespace lockstep::cpu
