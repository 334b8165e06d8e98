// The seam between each op's front and its kernels: one table of kernel entry points per device
// type, as ggml has one table of operations per backend.
#pragma once

#include "lockstep/base/error.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::detail {

// Note [Kernel tables]
// An op's front (src/ops/<op>.cpp) checks its arguments, broadcasts, applies autocast, allocates
// the output and records the backward; then it asks for the kernel of the device its tensors are
// on, in one place per op:
//
//   kernel(&Kernels::binary, out.device(), "add")(BinaryOp::add, out, a, b);
//
// and calls it. Kernels receive tensors that are already checked, broadcast (stride-0 views) and
// of the dtype they compute in; they only compute. Each device type has one `Kernels` table:
// src/ops/cpu/kernels.cpp fills the CPU's, and a CUDA build adds src/ops/cuda/ with its own table
// without touching any front. An entry left null means "no kernel for this device": `kernel()`
// throws naming the op and the device. Dispatch costs one indirect call per op, never per
// element: the kernel switches on its op enum and dtype once and runs a typed loop.
struct Kernels {
  // Filled per area; each area's entries are declared in its own section below.
#define LS_KERNEL_ENTRY(name, ...) void (*name)(__VA_ARGS__) = nullptr;
  // -- tensor methods, creation, copies (src/ops/tensor_ops.cpp, src/ops/factory.cpp) --
  // -- elementwise (src/ops/elementwise.cpp) --
  // -- reductions (src/ops/reduce.cpp) --
  // -- shape ops (src/ops/shape.cpp) --
  // -- softmax, dropout, embedding --
  // -- linalg (src/ops/linalg.cpp) --
  // -- conv and pooling (src/ops/conv.cpp, src/ops/pool.cpp) --
  // -- losses (src/ops/loss.cpp) --
  // -- norms: layer_norm, batch_norm (src/ops/norm.cpp) --
#undef LS_KERNEL_ENTRY
};

// The table of a device type, or nullptr when this build has none (a CPU-only build asked for
// cuda). Defined in src/ops/kernels.cpp, the one place that knows which device tables exist.
const Kernels* kernels_of(DeviceType type);

[[noreturn]] void throw_no_kernel(const char* op, const Device& device, bool device_has_table);

// The kernel `entry` of `device`'s table; throws "<op>: no kernel for <device> ..." when the
// build has no table for the device or the table has no such kernel.
template <typename Fn>
Fn kernel(Fn Kernels::*entry, const Device& device, const char* op) {
  const Kernels* table = kernels_of(device.type);
  if (table != nullptr && table->*entry != nullptr) [[likely]] return table->*entry;
  throw_no_kernel(op, device, table != nullptr);
}


}  // namespace lockstep::detail
