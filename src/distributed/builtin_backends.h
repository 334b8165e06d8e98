// The hook through which the backend registry learns the backends built into the library.
#pragma once

#include <string>

namespace lockstep::dist::detail {

// Registers every built-in backend (register_backend for each). Called once, by the registry on
// its first use; defined in builtin_backends.cpp, the one file that names them.
void register_builtin_backends();

// Why a built-in backend of this name is missing from this build ("nccl" without CUDA), or
// empty when the name is no built-in backend.
std::string why_not_built(const std::string& name);

}  // namespace lockstep::dist::detail
