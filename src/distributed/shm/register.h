// How the shm backend enters the backend registry.
#pragma once

namespace lockstep::dist {

// Registers "shm" (ProcessGroupShm) with register_backend(). Called by the registry's built-in
// list (src/distributed/builtin_backends.cpp), once.
void register_shm_backend();

}  // namespace lockstep::dist
