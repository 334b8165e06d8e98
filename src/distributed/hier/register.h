// How the hier backend enters the backend registry.
#pragma once

namespace lockstep::dist {

// Registers "hier" (ProcessGroupHier) with register_backend(). Called by the registry's built-in
// list (src/distributed/builtin_backends.cpp), once.
void register_hier_backend();

}  // namespace lockstep::dist
