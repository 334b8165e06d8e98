// The hook through which the backend registry learns the backends built into the library.
#pragma once

namespace lockstep::dist::detail {

// Registers every built-in backend (register_backend for each). Called once, by the registry on
// its first use; defined in builtin_backends.cpp, the one file that names them.
void register_builtin_backends();

}  // namespace lockstep::dist::detail
