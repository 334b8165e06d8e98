// The backends built into the library: the one place above the registry that names them.
#include "distributed/builtin_backends.h"

#include "distributed/emulated_nccl/register.h"
#include "distributed/gloo/register.h"
#include "distributed/hier/register.h"
#include "distributed/shm/register.h"
#include "lockstep/tensor/cuda.h"
#ifdef LOCKSTEP_WITH_CUDA
#include "distributed/nccl/register.h"
#endif

namespace lockstep::dist::detail {

void register_builtin_backends() {
  register_gloo_backend();
  register_shm_backend();
  register_hier_backend();
  register_auto_backend();
  // Emulated GPUs (a test switch) get NCCL's contract over the CPU transport instead of NCCL.
  if (cuda::emulated()) {
    register_emulated_nccl_backend();
    return;
  }
#ifdef LOCKSTEP_WITH_CUDA
  register_nccl_backend();
#endif
}

std::string why_not_built(const std::string& name) {
#ifndef LOCKSTEP_WITH_CUDA
  if (name == "nccl") {
    return "this build of lockstep has no CUDA support, so it has no NCCL backend (configure it "
           "where the CUDA toolkit and NCCL are installed, with -DLOCKSTEP_CUDA=AUTO or ON); on "
           "CPUs use gloo";
  }
#endif
  return "";
}

}  // namespace lockstep::dist::detail
