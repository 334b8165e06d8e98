// How the NCCL backend enters the backend registry (CUDA builds only).
#pragma once

namespace lockstep::dist {

// Registers "nccl" (ProcessGroupNCCL) with register_backend(). Called by the registry's built-in
// list (src/distributed/builtin_backends.cpp), once, in builds with CUDA.
void register_nccl_backend();

}  // namespace lockstep::dist
