// The backends built into the library: the one place above the registry that names them.
#include "distributed/builtin_backends.h"

#include "distributed/gloo/register.h"
#include "distributed/hier/register.h"
#include "distributed/shm/register.h"

namespace lockstep::dist::detail {

void register_builtin_backends() {
  register_gloo_backend();
  register_shm_backend();
  register_hier_backend();
}

}  // namespace lockstep::dist::detail
