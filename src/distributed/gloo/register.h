// How the Gloo backend enters the backend registry.
#pragma once

namespace lockstep::dist {

// Registers "gloo" (ProcessGroupGloo) with register_backend(). Called by the registry's
// built-in list (src/distributed/builtin_backends.cpp), once.
void register_gloo_backend();

}  // namespace lockstep::dist
