// The CPU's kernel table: every entry points to a kernel in src/ops/cpu/.
#include "ops/cpu/kernels.h"

namespace lockstep::cpu {

namespace {
Kernels make_table() {
  Kernels t;
  // One section per area, in the order of Kernels' sections (src/ops/kernels.h).
  return t;
}
}  // namespace

const Kernels& kernels() {
  static const Kernels table = make_table();
  return table;
}

}  // namespace lockstep::cpu
