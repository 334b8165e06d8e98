// init_process_group(): the store, the join check, the world group, the process-wide default
// group and new_group().
#include "lockstep/distributed/init.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "distributed/bind_address.h"
#include "distributed/builtin_backends.h"
#include "lockstep/base/env_var.h"
#include "lockstep/base/error.h"
#include "lockstep/base/log.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/distributed/error_file.h"
#include "lockstep/distributed/store/prefix_store.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "lockstep/tensor/cuda.h"

namespace lockstep::dist {

namespace {

using Clock = std::chrono::steady_clock;

// "host pid 1234 (join 9f3a...)": the nonce tells apart two claims from one process (ranks as
// threads), which host and pid alone would not.
std::string identity() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::random_device rd;
  char nonce[17];
  std::snprintf(nonce, sizeof(nonce), "%08x%08x", rd(), rd());
  return lockstep::detail::str_cat(host, " pid ", ::getpid(), " (join ", nonce, ")");
}

// Note [Join check]
// Before any backend connects, every process announces itself through the store:
//   world_size  the first process's WORLD_SIZE (compare_set); a different one is an error;
//   backend     the first process's backend name, likewise (shm on one rank and gloo on
//               another would each wait for peers that connect elsewhere, until the timeout);
//   rank/<r>    who claimed rank r (compare_set); a second claimant is an error;
//   joined      a counter of the processes that got this far.
// A process that finds a problem writes it under `error` before throwing, and every process
// waiting for the others polls that key, so all of them fail with the same message instead of
// the others waiting out the rendezvous timeout for a rank that will never come.
void join(Store& store, const DistEnv& env, const std::string& backend,
          std::chrono::milliseconds timeout) {
  const std::string me = identity();
  auto fail = [&](const std::string& msg) {
    store.set("error", msg);
    LS_THROW(msg);
  };
  const std::string ws = std::to_string(env.world_size);
  const std::string first_ws = store.compare_set("world_size", "", ws);
  if (first_ws != ws) {
    fail(lockstep::detail::str_cat("ranks disagree on the world size: rank ", env.rank, " (", me,
                                   ") has ", env::kWorldSize, "=", ws,
                                   ", the first process to join had ", first_ws));
  }
  const std::string first_backend = store.compare_set("backend", "", backend);
  if (first_backend != backend) {
    fail(lockstep::detail::str_cat(
        "ranks disagree on the backend: rank ", env.rank, " (", me, ") asks for '", backend,
        "', the first process to join asked for '", first_backend, "'; give every rank the same ",
        env::kBackend, " (or --backend)"));
  }
  const std::string key = "rank/" + std::to_string(env.rank);
  const std::string owner = store.compare_set(key, "", me);
  if (owner != me) {
    fail(lockstep::detail::str_cat("rank ", env.rank, " is claimed by two processes: ", owner,
                                   " and ", me, "; every process needs its own ", env::kRank,
                                   " (or one process initialized twice with the same store)"));
  }
  store.add("joined", 1);

  const auto deadline = Clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    if (store.check({"error"})) LS_THROW(store.get_string("error"));
    const int64_t joined = store.add("joined", 0);
    if (joined > env.world_size) {
      fail(lockstep::detail::str_cat(joined, " processes joined a world of ", env::kWorldSize, "=",
                                     env.world_size));
    }
    if (joined == env.world_size) break;
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int r = 0; r < env.world_size; ++r) {
        if (!store.check({"rank/" + std::to_string(r)})) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
      }
      LS_THROW("only ", joined, " of ", env.world_size, " ranks joined within ", timeout.count(),
               " ms; missing rank(s): ", missing);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

// The process-wide default group (the only global mutable state besides the
// per-thread grad/autocast modes).
struct Default {
  std::mutex mu;
  std::optional<World> world;
};
Default& global() {
  static Default d;
  return d;
}

World& default_world_locked(Default& d) {
  LS_CHECK(d.world.has_value(),
           "the default process group is not initialized: call "
           "lockstep::dist::init_process_group() first");
  return *d.world;
}

// Note [A GPU per rank]
// The classic pitfall: every process forgets set_device(local_rank) and all of them allocate
// on GPU 0. connect_world therefore binds the calling thread (the CUDA runtime's current device
// is per thread, like lockstep::cuda's) to cuda:LOCAL_RANK whenever GPUs exist, before the
// backend builds its communicator there. It binds even if the program called set_device before:
// lockstep cannot tell that call from the default device 0, and a binding that depended on it
// would differ between ranks. A program that wants another mapping says so
// (InitOptions::cuda_device: an index, or kKeepDevice), or calls set_device afterwards. With
// more local ranks than GPUs the CPU backends share GPUs round-robin (their cuda tensors are
// staged through host memory), while NCCL, which cannot run two ranks on one GPU, is refused
// before anything connects, with what to do instead.
// Under `lockstep run`, the world group's trace goes to the file the launcher reads (Note
// [Collective trace]). Diagnosis must never stop training: a file that cannot be made is a
// warning.
void export_trace(ProcessGroup& group) {
  const auto path = env_string(env::kTraceFile);
  if (!path) return;
  try {
    group.trace().export_to(*path);
  } catch (const Error& e) {
    lockstep::log_warning("the collective trace stays in memory, the launcher cannot read it: ",
                          e.message());
  }
}

void bind_device(World& w, const InitOptions& opts) {
  if (opts.cuda_device == kKeepDevice) {
    w.cuda_device = cuda::is_available() ? cuda::current_device() : -1;
    return;
  }
  int device = -1;
  if (opts.cuda_device) {
    device = *opts.cuda_device;
  } else {
    const DeviceChoice choice =
        choose_device(w.backend, w.env.local_rank, w.env.local_world_size, cuda::device_count());
    if (!choice.error.empty()) LS_THROW("init_process_group: ", choice.error);
    device = choice.device;
  }
  if (device < 0) return;
  cuda::set_device(device);  // checks the index
  w.cuda_device = device;
  log_debug("rank ", w.env.rank, " (local rank ", w.env.local_rank, ") bound to cuda:", device);
}

}  // namespace

DeviceChoice choose_device(const std::string& backend, int local_rank, int local_world_size,
                           int device_count) {
  const bool nccl = backend == "nccl";
  if (device_count <= 0) {
    if (!nccl) return {};
    return {-1, lockstep::detail::str_cat(
                    "the nccl backend needs a CUDA GPU per rank, but this machine shows none "
                    "(no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them); on CPUs use the "
                    "gloo backend")};
  }
  if (nccl && local_world_size > device_count) {
    return {-1, lockstep::detail::str_cat(
                    env::kLocalWorldSize, "=", local_world_size, " ranks on this machine, but ",
                    device_count, device_count == 1 ? " GPU is" : " GPUs are",
                    " visible: under nccl two local ranks would share one GPU, which NCCL cannot "
                    "do; start at most ",
                    device_count,
                    " ranks per machine (lockstep run --nproc-per-node gpu), or use the gloo "
                    "backend, which moves cuda tensors through host memory")};
  }
  return {local_rank % device_count, ""};
}

World connect_world(DistEnv env, const InitOptions& opts) {
  LS_CHECK(opts.rank.has_value() == opts.world_size.has_value(),
           "InitOptions: set both rank and world_size, or neither");
  if (opts.world_size) {
    env.world_size = *opts.world_size;
    env.rank = *opts.rank;
    LS_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
             "InitOptions: rank ", env.rank, " is outside [0, world_size ", env.world_size, ")");
    if (env.local_world_size > env.world_size) env.local_world_size = env.world_size;
    if (env.local_rank >= env.local_world_size) env.local_rank = env.rank % env.local_world_size;
  }
  // The API's choice wins over the environment's, which wins over the default.
  std::string backend = opts.backend, from = "InitOptions::backend";
  if (backend.empty() && !env.backend.empty()) {
    backend = env.backend;
    from = env::kBackend;
  }
  if (backend.empty()) backend = kDefaultBackend;
  if (!has_backend(backend)) {
    const std::string why = detail::why_not_built(backend);
    if (!why.empty()) {
      LS_THROW("init_process_group: backend '", backend, "' (from ", from,
               ") is not available: ", why);
    }
    std::string known;
    for (const auto& name : backend_names()) known += (known.empty() ? "" : ", ") + name;
    LS_THROW("init_process_group: unknown backend '", backend, "' (from ", from,
             "): expected one of the registered backends: ", known);
  }
  // The collective timeout, likewise: the API's, LOCKSTEP_TIMEOUT's (`lockstep run --timeout`),
  // the default.
  const std::chrono::milliseconds timeout =
      opts.timeout.value_or(env.timeout.value_or(kDefaultCollectiveTimeout));
  LS_CHECK(timeout.count() > 0, "InitOptions: expected a positive timeout, got ", timeout.count(),
           " ms");
  World w;
  w.env = env;
  w.backend = backend;
  if (env.world_size == 1 && opts.store == nullptr) {
    bind_device(w, opts);
    // NCCL's contract holds at one rank too: a host tensor fails here as it would at two.
    std::optional<Device> only;
    if (backend == "nccl" && w.cuda_device >= 0) only = cuda_device(w.cuda_device);
    w.group = std::make_shared<WorldOfOneGroup>(timeout, only);
    return w;
  }

  const auto rendezvous_timeout = opts.rendezvous_timeout.value_or(
      env.rendezvous_timeout.value_or(std::min(timeout, kDefaultRendezvousTimeout)));
  LS_CHECK(rendezvous_timeout.count() > 0,
           "InitOptions: expected a positive rendezvous_timeout, got ", rendezvous_timeout.count(),
           " ms");
  std::shared_ptr<Store> store = opts.store;
  if (!store) {
    TCPStoreOptions so;
    so.host = env.master_addr;
    so.port = env.master_port;
    so.is_server = env.rank == 0 && !env.agent_store;
    so.token = env.store_token;
    // Every rank decides alike, so that all fail at once where the store would be open.
    const std::string listen = env.agent_store ? "" : detail::store_listen_address(env);
    if (so.is_server) so.server.bind_address = listen;
    so.wait_for_workers = false;
    so.timeout = rendezvous_timeout;  // connecting (Note [Waiting for the store])
    try {
      store = std::make_shared<TCPStore>(so);
    } catch (const Error& e) {
      std::string what = " cannot reach rank 0's rendezvous store";
      if (so.is_server) what = " cannot host the rendezvous store";
      if (env.agent_store) what = " cannot reach the launcher's rendezvous store";
      LS_THROW("rank ", env.rank, " of ", env.world_size, what, " at ", env::kMasterAddr, ":",
               env::kMasterPort, " = ", env.master_addr, ":", env.master_port, ": ", e.message(),
               " (the rendezvous timeout is set by ", env::kRendezvousTimeout, ", in seconds)");
    }
    store->set_timeout(timeout);
  }
  // A launcher's store outlives restarts: each generation joins under its own keys.
  w.store = std::make_shared<PrefixStore>(
      lockstep::detail::str_cat("lockstep/", env.run_id.empty() ? "default" : env.run_id, "/gen",
                                env.restart_count),
      store);
  // Local choices first; a mistake here is reported to the other ranks through the join's error
  // key, so that they fail at once too (Note [Join check]). The bind address is chosen here once
  // for the world and every group made from it (new_group).
  try {
    const detail::BindChoice bind = detail::choose_bind(env);
    w.bind_address = bind.address;
    w.bind_interface = bind.interface;
    bind_device(w, opts);
  } catch (const Error& e) {
    w.store->set("error", lockstep::detail::str_cat("rank ", env.rank, ": ", e.message()));
    throw;
  }
  join(*w.store, env, backend, rendezvous_timeout);

  BackendConfig config;
  config.store = std::make_shared<PrefixStore>("group/world", w.store);
  config.rank = env.rank;
  config.size = env.world_size;
  config.timeout = timeout;
  config.bind_address = w.bind_address;
  config.bind_interface = w.bind_interface;
  w.group = create_process_group(backend, config);
  lockstep::set_log_rank(env.rank);
  export_trace(*w.group);
  return w;
}

ProcessGroupPtr init_process_group(const InitOptions& opts) {
  install_error_handler();  // an uncaught exception reaches the launcher's summary
  auto& d = global();
  std::lock_guard<std::mutex> lock(d.mu);
  LS_CHECK(!d.world.has_value(), "init_process_group: the default group already exists (rank ",
           d.world ? d.world->env.rank : 0,
           "); call destroy_process_group() before initializing again");
  d.world = connect_world(read_dist_env(), opts);
  return d.world->group;
}

void destroy_process_group() {
  std::optional<World> old;
  {
    auto& d = global();
    std::lock_guard<std::mutex> lock(d.mu);
    old.swap(d.world);
  }
  // `old` goes out of scope here, outside the lock: a group drains its queue when destroyed.
}

bool is_initialized() {
  auto& d = global();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.world.has_value();
}

ProcessGroupPtr default_group() {
  auto& d = global();
  std::lock_guard<std::mutex> lock(d.mu);
  return default_world_locked(d).group;
}

int rank() { return default_group()->rank(); }
int world_size() { return default_group()->size(); }

int local_rank() {
  auto& d = global();
  std::lock_guard<std::mutex> lock(d.mu);
  return default_world_locked(d).env.local_rank;
}

int local_world_size() {
  auto& d = global();
  std::lock_guard<std::mutex> lock(d.mu);
  return default_world_locked(d).env.local_world_size;
}

bool is_main_process() { return rank() == 0; }

namespace {

ProcessGroupPtr make_group(World& w, const std::vector<int>& ranks, int nth) {
  const int size = w.group->size();
  LS_CHECK(!ranks.empty(), "new_group: expected at least one rank, got none");
  for (size_t i = 0; i < ranks.size(); ++i) {
    LS_CHECK(ranks[i] >= 0 && ranks[i] < size, "new_group: rank ", ranks[i],
             " is outside the world [0, ", size, ")");
    LS_CHECK(i == 0 || ranks[i] > ranks[i - 1],
             "new_group: ranks must be increasing and "
             "distinct, got [",
             join_ranks(ranks), "]");
  }
  auto it = std::find(ranks.begin(), ranks.end(), w.group->rank());
  if (it == ranks.end()) return nullptr;
  const int my_rank = static_cast<int>(it - ranks.begin());
  if (ranks.size() == 1) return std::make_shared<WorldOfOneGroup>(w.group->timeout());
  BackendConfig config;
  config.store = std::make_shared<PrefixStore>(
      lockstep::detail::str_cat("group/", join_ranks(ranks), "/", nth), w.store);
  config.rank = my_rank;
  config.size = static_cast<int>(ranks.size());
  config.timeout = w.group->timeout();
  config.bind_address = w.bind_address;
  config.bind_interface = w.bind_interface;
  return create_process_group(w.backend, config);
}

}  // namespace

// Members agree on the store namespace of their nth group of one rank list by the order of their
// calls; non-members need not call at all.
ProcessGroupPtr new_group(World& world, std::vector<int> ranks) {
  const int nth = world.groups_made[join_ranks(ranks)]++;
  return make_group(world, ranks, nth);
}

ProcessGroupPtr new_group(std::vector<int> ranks) {
  auto& d = global();
  std::unique_lock<std::mutex> lock(d.mu);
  World& w = default_world_locked(d);
  const int nth = w.groups_made[join_ranks(ranks)]++;
  World copy = w;
  lock.unlock();  // the rendezvous below may take long
  return make_group(copy, ranks, nth);
}

}  // namespace lockstep::dist
