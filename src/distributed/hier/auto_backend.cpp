// The "auto" backend: the CPU backend a group's layout over machines calls for.
#include <memory>

#include "distributed/hier/register.h"
#include "distributed/machine.h"
#include "lockstep/base/error.h"
#include "lockstep/base/log.h"
#include "lockstep/distributed/gloo/process_group_gloo.h"
#include "lockstep/distributed/hier/process_group_hier.h"
#include "lockstep/distributed/shm/process_group_shm.h"

namespace lockstep::dist {

// Note [The auto backend]
// init_process_group's default. Every rank publishes its machine identity through the group's
// store; all of them then see the same layout and choose alike:
//   - every rank on one machine: shm (shared memory, no sockets at all);
//   - one rank on each machine: gloo (nothing to share inside a machine);
//   - several machines with the same number of ranks each, contiguous (what `lockstep run`
//     gives): hier (shm inside each machine, Gloo across; Note [Hierarchical all_reduce]);
//   - anything else (ranks of a machine interleaved, machines of different sizes): gloo, with a
//     warning from rank 0 naming the layout, since hier cannot compose it.
// The group made is that backend's own (its backend() says which); "auto" is only the choice.
// Forcing one (InitOptions::backend, LOCKSTEP_BACKEND, the example's --backend) skips it.
// CUDA tensors go through the chosen CPU backend's staging; nccl is chosen by name.
std::string choose_cpu_backend(const detail::MachineLayout& layout, int world) {
  if (layout.machines == 1) return "shm";
  if (layout.machines == world) return "gloo";
  return layout.regular ? "hier" : "gloo";
}

void register_auto_backend() {
  register_backend("auto", [](const BackendConfig& config) -> ProcessGroupPtr {
    const std::string who =
        lockstep::detail::str_cat("rank ", config.rank, "/", config.size, " (auto)");
    LS_CHECK(config.store != nullptr, who, ": a store to rendezvous through is required");
    const auto layout = detail::machine_layout(detail::exchange_machine_identities(
        *config.store, "auto/machine/", config.rank, config.size, detail::machine_identity(),
        config.timeout, who + ": choosing a backend"));
    const std::string chosen = choose_cpu_backend(layout, config.size);
    if (!layout.regular && config.rank == 0) {
      log_warning("backend auto: the ranks' layout over machines (", layout.found,
                  ") is not the same number of contiguous ranks per machine, so the hier "
                  "backend cannot compose it; using gloo for every byte");
    }
    if (chosen == "shm") return std::make_shared<ProcessGroupShm>(config);
    if (chosen == "hier") return std::make_shared<ProcessGroupHier>(config);
    return std::make_shared<ProcessGroupGloo>(config);
  });
}

}  // namespace lockstep::dist
