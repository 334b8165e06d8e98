// The in-place division that makes a sum an average, for the hier backend (Gloo's own
// collectives reduce with the shm kernel, Note [Gloo rank-order reduction]).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/base/error.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/half.h"

namespace lockstep::dist::detail {

// data[i] /= divisor for a contiguous floating-point buffer.
inline void divide_in_place(void* data, DType t, size_t n, int divisor) {
  switch (t) {
    case DType::f32: {
      auto* p = static_cast<float*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] /= d;
      return;
    }
    case DType::f64: {
      auto* p = static_cast<double*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= divisor;
      return;
    }
    case DType::bf16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16_bits(bf16_bits_to_float(p[i]) / divisor);
      return;
    }
    case DType::f16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_f16_bits(f16_bits_to_float(p[i]) / divisor);
      return;
    }
    default:
      LS_THROW("avg of ", dtype_name(t), " tensors is not defined");
  }
}

}  // namespace lockstep::dist::detail
