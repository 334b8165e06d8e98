// What the launcher can find out about why a worker died (docs/LAUNCHER.md, "When a job goes
// wrong"): whether the kernel's out-of-memory killer was active in the launcher's memory cgroup
// during the run (its oom_kill count) or, when the kernel log is readable, named the worker;
// and the memory the machine has available.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

namespace lockstep::launch {

// Note [Out-of-memory evidence]
// A worker killed by the out-of-memory killer ends with SIGKILL like any other SIGKILL, so the
// launcher looks for evidence elsewhere:
//   - the memory cgroup the launcher (and so every worker) is in counts the processes the OOM
//     killer ended in it: cgroup v2's memory.events "oom_kill N" (hierarchical), cgroup v1's
//     memory.oom_control "oom_kill N". The count is read when the workers start and again when
//     one dies by a signal; a rise means the OOM killer acted in the job's cgroup meanwhile.
//   - the kernel log (/dev/kmsg, readable by root or where dmesg_restrict is 0) has a
//     "Killed process <pid>" line for every OOM kill, which names the very worker.
// Either is enough; neither is certain to exist (a container may hide both), in which case the
// summary says only the signal, the peak memory and the available memory.
struct OomCounter {
  std::string file;  // /sys/fs/cgroup/.../memory.events or .../memory.oom_control
};
// The counter of this process's memory cgroup, from /proc/self/cgroup; nullopt if none is found.
std::optional<OomCounter> find_oom_counter();
// Its "oom_kill" value now; nullopt when it cannot be read.
std::optional<int64_t> read_oom_kills(const OomCounter& c);

// The kernel log's line about the OOM killer ending `pid` ("Out of memory: Killed process 1234
// (name) ..."), or empty when the log has none or cannot be read.
std::string kernel_log_oom_line(pid_t pid);

// MemAvailable of /proc/meminfo, in KiB; nullopt when it cannot be read.
std::optional<int64_t> mem_available_kib();

// "812 KiB", "45.3 MiB", "1.25 GiB".
std::string format_kib(int64_t kib);

}  // namespace lockstep::launch
