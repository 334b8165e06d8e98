// How the emulated NCCL backend enters the backend registry (every build; used only when
// LOCKSTEP_TEST_EMULATE_GPUS is set).
#pragma once

namespace lockstep::dist {

// Registers "nccl" as EmulatedNcclGroup (Note [Emulated NCCL] in emulated_nccl.cpp) in place of
// ProcessGroupNCCL. Called by the registry's built-in list when cuda::emulated().
void register_emulated_nccl_backend();

}  // namespace lockstep::dist
