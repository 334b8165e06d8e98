// The worker environment: the variables `lockstep run` sets for every worker and the library
// reads, spelled once here (torchrun's names where torchrun has one, so cluster tools work).
// Their values are read and checked by lockstep/base/env_var.h.
#pragma once

#include <array>
#include <string_view>

namespace lockstep::env {

// Where this worker sits in the job (torchrun's names).
inline constexpr const char* kRank = "RANK";
inline constexpr const char* kLocalRank = "LOCAL_RANK";
inline constexpr const char* kWorldSize = "WORLD_SIZE";
inline constexpr const char* kLocalWorldSize = "LOCAL_WORLD_SIZE";
inline constexpr const char* kGroupRank = "GROUP_RANK";  // the node rank
inline constexpr const char* kMasterAddr = "MASTER_ADDR";
inline constexpr const char* kMasterPort = "MASTER_PORT";

// The launcher's own (torchelastic's TORCHELASTIC_* counterparts).
inline constexpr const char* kRestartCount = "LOCKSTEP_RESTART_COUNT";
inline constexpr const char* kMaxRestarts = "LOCKSTEP_MAX_RESTARTS";
inline constexpr const char* kRunId = "LOCKSTEP_RUN_ID";
// "1": the launcher hosts the store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE).
inline constexpr const char* kUseAgentStore = "LOCKSTEP_USE_AGENT_STORE";
// The token a TCP store client presents (docs/LAUNCHER.md).
inline constexpr const char* kStoreToken = "LOCKSTEP_STORE_TOKEN";
// Where init_process_group's terminate handler writes an uncaught error (TORCHELASTIC_ERROR_FILE).
inline constexpr const char* kErrorFile = "LOCKSTEP_ERROR_FILE";
// "1": this worker's stdout reaches the launcher's terminal (progress bars redraw in place).
inline constexpr const char* kStdoutIsTty = "LOCKSTEP_STDOUT_IS_TTY";
// Where init_process_group maps the world group's collective trace, for the launcher to read
// (Note [Collective trace] in lockstep/distributed/trace.h).
inline constexpr const char* kTraceFile = "LOCKSTEP_TRACE_FILE";

// Every variable above: what a launcher sets for each worker, replacing any value it inherited.
inline constexpr std::array<const char*, 15> kLauncherSet = {
    kRank,          kLocalRank,  kWorldSize,    kLocalWorldSize, kGroupRank,
    kMasterAddr,    kMasterPort, kRestartCount, kMaxRestarts,    kRunId,
    kUseAgentStore, kStoreToken, kErrorFile,    kStdoutIsTty,    kTraceFile};

// Read by the library but set by the user, never by the launcher.
// A file holding the store's token (a file of the user's own, mode 0600: on a cluster's shared
// file system every rank reads the same one), for ranks started without the launcher (srun,
// mpirun). The launcher drops it from its workers' environment: its own token replaces it.
inline constexpr const char* kStoreTokenFile = "LOCKSTEP_STORE_TOKEN_FILE";
// "1": rank 0 may host its store on a non-loopback address without a token (a trusted network).
inline constexpr const char* kStoreInsecure = "LOCKSTEP_STORE_INSECURE";
inline constexpr const char* kOmpNumThreads = "OMP_NUM_THREADS";
inline constexpr const char* kSocketIfname = "LOCKSTEP_SOCKET_IFNAME";
// Seconds init_process_group waits to reach the store and for every rank to join.
inline constexpr const char* kRendezvousTimeout = "LOCKSTEP_RENDEZVOUS_TIMEOUT";
// Seconds a collective may wait for the other ranks before it fails (InitOptions::timeout, when
// the program leaves it unset). The exception to the rule above: `lockstep run --timeout` sets
// it, and the launcher reads an inherited LOCKSTEP_TIMEOUT as its --timeout, so both agree.
inline constexpr const char* kTimeout = "LOCKSTEP_TIMEOUT";
// The process group backend init_process_group uses when its options name none ("gloo", "shm").
inline constexpr const char* kBackend = "LOCKSTEP_BACKEND";
// "0": the NCCL backend skips its signature check before each collective (benchmarks only).
inline constexpr const char* kNcclCheck = "LOCKSTEP_NCCL_CHECK";
// A test switch, never for training: N (1-64) makes this process see N emulated CUDA devices,
// host memory behind the device seam, CPU kernels and an NCCL-contract process group (Note
// [Emulated CUDA devices] in src/tensor/cuda_emulated.cpp; docs/GPU.md). Said in the log when on.
inline constexpr const char* kTestEmulateGpus = "LOCKSTEP_TEST_EMULATE_GPUS";
// MiB of freed host memory the CPU allocator keeps for reuse (default 4096; 0 keeps none).
inline constexpr const char* kCpuCacheMb = "LOCKSTEP_CPU_CACHE_MB";
// MiB of CPU tensor memory this process may hold at once (default: no limit): an allocation
// beyond it is an out-of-memory error naming the rank and what was allocated (Note [CPU memory
// limit] in src/tensor/allocator.cpp).
inline constexpr const char* kCpuMemoryLimitMb = "LOCKSTEP_CPU_MEMORY_LIMIT_MB";
// "1": f32 matrix products may use TF32 tensor cores from the start (cuda::set_allow_tf32).
inline constexpr const char* kAllowTf32 = "LOCKSTEP_ALLOW_TF32";
// The network link the gloo backend's cost model assumes (Note [Cost model] in
// src/distributed/cost_model.cpp): microseconds per message round, and Gbit/s per rank.
inline constexpr const char* kNetAlphaUs = "LOCKSTEP_NET_ALPHA_US";
inline constexpr const char* kNetGbps = "LOCKSTEP_NET_GBPS";
// "1": a gloo group of more than two ranks times a few all_reduces when it is made and uses the
// link fitted to them instead (Note [Link calibration] in
// src/distributed/gloo/process_group_gloo.cpp). Default 0.
inline constexpr const char* kNetCalibrate = "LOCKSTEP_NET_CALIBRATE";
// The gloo backend's all_reduce algorithm: auto (the cost model's choice), whole or direct.
inline constexpr const char* kAllReduceAlgo = "LOCKSTEP_ALLREDUCE_ALGO";

}  // namespace lockstep::env
