// init_process_group(): the world of this job from the environment (torchrun's variables, SLURM,
// Open MPI, or none), the default process group, and new_group() for subsets of ranks.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/base/env_var.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/distributed/store/store.h"

namespace lockstep::dist {

// The worker environment's names are spelled once, in lockstep/base/worker_env.h; these are the
// spellings this layer has always offered.
// Set by `lockstep run` when its agent hosts the store at MASTER_ADDR:MASTER_PORT (workers then
// connect to it instead of rank 0 starting one), as torchrun's TORCHELASTIC_USE_AGENT_STORE.
inline constexpr const char* kUseAgentStoreEnv = env::kUseAgentStore;
// An interface name ("eth0") or a local address ("10.1.2.3") for the transport to bind to.
// GLOO_SOCKET_IFNAME is honoured as well when this is unset, so torchrun habits keep working.
inline constexpr const char* kSocketIfnameEnv = env::kSocketIfname;

// How long init_process_group waits to reach the store and for every rank to join, unless
// LOCKSTEP_RENDEZVOUS_TIMEOUT or InitOptions::rendezvous_timeout says otherwise (this default is
// cut to InitOptions::timeout when that is shorter).
inline constexpr std::chrono::milliseconds kDefaultRendezvousTimeout{300'000};
// LOCKSTEP_RENDEZVOUS_TIMEOUT's bounds, in seconds.
inline constexpr double kMinRendezvousTimeoutS = 0.001;
inline constexpr double kMaxRendezvousTimeoutS = 7 * 24 * 3600;

// LOCKSTEP_TIMEOUT's bounds, in seconds: a millisecond (tests) to a week (above it a typo, such
// as milliseconds given for seconds, is more likely than a wish).
inline constexpr double kMinTimeoutS = 0.001;
inline constexpr double kMaxTimeoutS = 7 * 24 * 3600;

// Where this process sits in the job, as the environment describes it.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int group_rank = 0;  // the node's rank (GROUP_RANK)
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  bool agent_store = false;
  int restart_count = 0;  // LOCKSTEP_RESTART_COUNT
  std::string run_id;     // LOCKSTEP_RUN_ID
  std::string socket_ifname;
  std::optional<std::chrono::milliseconds> rendezvous_timeout;  // LOCKSTEP_RENDEZVOUS_TIMEOUT
  std::optional<std::chrono::milliseconds> timeout;             // LOCKSTEP_TIMEOUT
  std::string backend;  // LOCKSTEP_BACKEND; empty when unset
  // The store's token: LOCKSTEP_STORE_TOKEN, or read from LOCKSTEP_STORE_TOKEN_FILE.
  std::optional<std::string> store_token;
  bool store_insecure = false;  // LOCKSTEP_STORE_INSECURE=1 (Note [Who may reach rank 0's store])
  // Which variables these came from: "RANK/WORLD_SIZE", "SLURM", "Open MPI" or "none".
  std::string source = "none";
};

// Where read_dist_env's values come from (the environment parser's, lockstep/base/env_var.h).
using lockstep::EnvLookup;
using lockstep::process_env;

// Reads, in this order of preference: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// GROUP_RANK, MASTER_ADDR, MASTER_PORT (what torchrun and `lockstep run` set); SLURM_PROCID,
// SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE, SLURM_NODELIST;
// OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE. With none of them: a world of one.
// Values that are not integers, out of range or inconsistent (RANK >= WORLD_SIZE, RANK without
// WORLD_SIZE, several machines but no MASTER_ADDR) are Errors that name the variables; so is a
// LOCKSTEP_RENDEZVOUS_TIMEOUT or LOCKSTEP_TIMEOUT that is not a number of seconds in range.
DistEnv read_dist_env(const EnvLookup& lookup = process_env);

// The backend when neither InitOptions::backend nor LOCKSTEP_BACKEND names one: the CPU
// backend the ranks' layout over machines calls for (shm on one machine, gloo with one rank per
// machine, hier otherwise; Note [The auto backend] in src/distributed/hier/auto_backend.cpp).
// World::backend keeps "auto" (new_group chooses again for its own ranks); the group's
// backend() names the one chosen.
inline constexpr const char* kDefaultBackend = "auto";

struct InitOptions {
  // A registered backend's name (backend_names()). Empty: LOCKSTEP_BACKEND when set, else
  // kDefaultBackend. A name that is not registered is an Error listing the registered ones.
  std::string backend;
  // Default timeout of the group's collectives and of its store's requests. Unset:
  // LOCKSTEP_TIMEOUT (seconds; what `lockstep run --timeout` sets), else
  // kDefaultCollectiveTimeout (30 minutes). The program's choice wins over the environment's.
  std::optional<std::chrono::milliseconds> timeout;
  // How long to wait to reach the store (rank 0's, or the launcher's) and for every rank to
  // join. Unset: LOCKSTEP_RENDEZVOUS_TIMEOUT (seconds), else the shorter of
  // kDefaultRendezvousTimeout and the collective timeout. The connecting ranks log why they are
  // still waiting every few seconds, and fail at the end naming MASTER_ADDR:MASTER_PORT and the
  // last cause.
  std::optional<std::chrono::milliseconds> rendezvous_timeout;
  // Rendezvous through this store instead of a TCPStore at MASTER_ADDR:MASTER_PORT.
  std::shared_ptr<Store> store;
  // Override the environment's values (both or neither).
  std::optional<int> rank;
  std::optional<int> world_size;
  // The GPU the calling thread is bound to (Note [A GPU per rank] in init.cpp). Unset:
  // cuda:LOCAL_RANK where GPUs exist (choose_device); an index: that GPU; kKeepDevice: leave the
  // thread's current device as it is (a program that chose it itself).
  std::optional<int> cuda_device;
};
inline constexpr int kKeepDevice = -1;

// The GPU a rank binds to, from the numbers alone (so the refusals are tested without a GPU):
// with GPUs, cuda:(local_rank % device_count); without, none (-1). Under NCCL, which cannot put
// two ranks on one GPU, more local ranks than GPUs, or no GPU at all, is an `error` that says
// what to do instead.
struct DeviceChoice {
  int device = -1;
  std::string error;
};
DeviceChoice choose_device(const std::string& backend, int local_rank, int local_world_size,
                           int device_count);

// The world group of `env`, without touching the process-wide default: what
// init_process_group() does, for tests (ranks as threads over a HashStore) and for programs that
// manage several worlds. Every rank first joins through the store, which checks that the ranks
// agree (one WORLD_SIZE, each rank claimed by exactly one process) and fails on every rank,
// naming the problem, when they do not.
struct World {
  ProcessGroupPtr group;
  std::shared_ptr<Store> store;  // namespaced for this world; new groups rendezvous through it
  DistEnv env;
  std::string backend;
  // Where every group of this world binds, chosen once here (BackendConfig): one of the two is
  // set.
  std::string bind_address;
  std::string bind_interface;
  // The GPU connect_world bound the calling thread to, or -1.
  int cuda_device = -1;
  // How many groups of each rank list this process made (new_group's store namespace).
  std::map<std::string, int> groups_made;
};
World connect_world(DistEnv env, const InitOptions& opts = {});

// Builds the default group from the environment (read_dist_env). If the launcher hosts the store
// (LOCKSTEP_USE_AGENT_STORE=1), connects to it; otherwise rank 0 starts a TCPStore at
// MASTER_ADDR:MASTER_PORT and the others connect (presenting LOCKSTEP_STORE_TOKEN when set).
// A world of one needs no store and no network. Calling it twice without
// destroy_process_group() is an Error.
ProcessGroupPtr init_process_group(const InitOptions& opts = {});
// Destroys the default group (after its queued collectives ran); a no-op when none exists.
void destroy_process_group();
bool is_initialized();

// These need init_process_group() first (an Error otherwise).
ProcessGroupPtr default_group();
int rank();
int world_size();
int local_rank();
int local_world_size();
bool is_main_process();  // rank() == 0: the process that logs and saves checkpoints

// A group of the given ranks of the default group (or of `world`): every member calls it with
// the same list, in the same order as its other new_group calls; non-members may call it too and
// get nullptr. In the new group, ranks[i] has rank i.
ProcessGroupPtr new_group(std::vector<int> ranks);
ProcessGroupPtr new_group(World& world, std::vector<int> ranks);

// The local address through which this machine reaches host (the source address the kernel's
// routing picks), e.g. "10.1.2.3", or "127.0.0.1" for a host on loopback. No packet is sent.
std::string local_address_toward(const std::string& host, uint16_t port);

}  // namespace lockstep::dist
