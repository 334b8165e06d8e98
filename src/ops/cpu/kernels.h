// The CPU's kernel table and the declarations of its kernels (defined in src/ops/cpu/*.cpp).
#pragma once

#include "ops/kernels.h"

namespace lockstep::cpu {

using detail::Kernels;

// The CPU table (Note [Kernel tables] in src/ops/kernels.h), built once.
const Kernels& kernels();

// Kernel declarations, one section per area, in the order of Kernels' sections.

}  // namespace lockstep::cpu
