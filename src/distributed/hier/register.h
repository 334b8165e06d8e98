// How the hier and auto backends enter the backend registry.
#pragma once

#include <string>

namespace lockstep::dist {

namespace detail {
struct MachineLayout;
}

// Registers "hier" (ProcessGroupHier) with register_backend(). Called by the registry's built-in
// list (src/distributed/builtin_backends.cpp), once.
void register_hier_backend();

// Registers "auto" (Note [The auto backend] in auto_backend.cpp), the default backend.
void register_auto_backend();

// What "auto" builds for `layout` of `world` ranks: "shm", "gloo" or "hier".
std::string choose_cpu_backend(const detail::MachineLayout& layout, int world);

}  // namespace lockstep::dist
