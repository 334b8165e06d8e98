// Helpers of the GPU tests (tests/cuda/): the skip every test starts with, and comparisons of a
// CUDA result with the CPU's, which is the reference (src/ops/cpu/).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "lockstep/lockstep.h"
#include "lockstep/tensor/cuda.h"

namespace lockstep::testing {

// LOCKSTEP_TEST_GPU_AS_CPU=1: the CPU stands in for the GPU, so the comparisons compare the CPU
// with itself. That checks the tests themselves where no GPU exists (every case builds its
// inputs, and the CPU takes every op it is meant to take): ctest cuda.backend_ops_self_check.
inline bool gpu_as_cpu() {
  static const bool on = [] {
    const char* v = std::getenv("LOCKSTEP_TEST_GPU_AS_CPU");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// Why the GPU tests cannot run here, or "" when they can.
inline std::string gpu_skip_reason() {
  if (gpu_as_cpu()) return "";
  if (cuda::emulated()) return "";  // LOCKSTEP_TEST_EMULATE_GPUS: ctest cuda.emulated
  if (!cuda::compiled_with_cuda()) return "this build has no CUDA support (LOCKSTEP_CUDA=OFF)";
  if (!cuda::is_available()) return "no GPU visible (CUDA support is built, device_count() is 0)";
  return "";
}

// The first statement of every GPU test: skips it, with the reason, where there is no GPU.
#define LS_REQUIRE_GPU()                                                          \
  do {                                                                            \
    const std::string ls_gpu_skip_ = ::lockstep::testing::gpu_skip_reason();      \
    if (!ls_gpu_skip_.empty()) GTEST_SKIP() << ls_gpu_skip_;                      \
  } while (0)

inline Device gpu() { return gpu_as_cpu() ? kCPU : cuda_device(0); }

// How close a CUDA result must be to the CPU's: |gpu - cpu| <= atol + rtol * |cpu|.
struct Tol {
  double rtol = 1e-5;
  double atol = 1e-5;
};

// Per dtype, for ops whose every output element rounds a few times (elementwise, copies).
inline Tol tol_for(DType dt) {
  switch (dt) {
    case DType::f64: return {1e-12, 1e-12};
    case DType::f32: return {1e-5, 1e-5};
    case DType::bf16: return {1e-2, 1e-2};  // 8 significant bits: one rounding apart is 0.4%
    case DType::f16: return {2e-3, 2e-3};   // 11 significant bits
    default: return {0, 0};                 // integers and bool: exact
  }
}

// For ops that sum many terms (reductions, GEMM, convolution, norms, losses): the GPU adds in
// another order (trees across threads), so f32 results differ by more than one rounding.
inline Tol tol_sum(DType dt) {
  switch (dt) {
    case DType::f64: return {1e-10, 1e-10};
    case DType::f32: return {1e-4, 1e-4};
    case DType::bf16: return {2e-2, 2e-2};
    case DType::f16: return {5e-3, 5e-3};
    default: return {0, 0};
  }
}

// Same shape and dtype, `gpu_out` on the GPU, and every value within `tol` of `cpu_out` (NaN
// where the CPU has NaN, the same infinities). Names `what` and the first position that differs.
inline void expect_matches_cpu(const Tensor& cpu_out, const Tensor& gpu_out, Tol tol,
                               const std::string& what) {
  ASSERT_TRUE(cpu_out.defined()) << what << ": CPU result undefined";
  ASSERT_TRUE(gpu_out.defined()) << what << ": CUDA result undefined";
  ASSERT_TRUE(gpu_out.device() == gpu()) << what << ": result on " << gpu_out.device().str();
  ASSERT_EQ(gpu_out.shape(), cpu_out.shape()) << what << ": shape " << gpu_out.shape().str()
                                              << " vs CPU " << cpu_out.shape().str();
  ASSERT_EQ(gpu_out.dtype(), cpu_out.dtype()) << what << ": dtype " << dtype_name(gpu_out.dtype())
                                              << " vs CPU " << dtype_name(cpu_out.dtype());
  const std::vector<double> want = cpu_out.to_vector<double>();
  const std::vector<double> got = gpu_out.to_vector<double>();
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i], g = got[i];
    const bool same = (std::isnan(w) && std::isnan(g)) || w == g ||
                      std::abs(g - w) <= tol.atol + tol.rtol * std::abs(w);
    if (!same) {
      ADD_FAILURE() << what << " (" << dtype_name(cpu_out.dtype()) << ", shape "
                    << cpu_out.shape().str() << "): element " << i << " is " << g
                    << " on CUDA, " << w << " on the CPU (rtol " << tol.rtol << ", atol "
                    << tol.atol << ")";
      return;
    }
  }
}

}  // namespace lockstep::testing
