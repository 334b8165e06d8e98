// read_dist_env(): this process's place in the job from torchrun's, SLURM's or Open MPI's
// variables.
#include <algorithm>
#include <cctype>
#include <charconv>

#include "lockstep/base/env_var.h"
#include "lockstep/base/error.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/store/tcp_store.h"

namespace lockstep::dist {

namespace {

// Gloo's name for LOCKSTEP_SOCKET_IFNAME, honoured when ours is unset so that torchrun habits
// keep working (read, never set; like the SLURM and Open MPI names below).
constexpr const char* kGlooSocketIfname = "GLOO_SOCKET_IFNAME";

// SLURM jobs that share a machine must not share a port: derive one from the job id (in
// [kSlurmPortBase, kSlurmPortBase + kSlurmPortSpan)) unless MASTER_PORT says otherwise.
constexpr int kSlurmPortBase = 20000;
constexpr int kSlurmPortSpan = 20000;

class Reader {
 public:
  explicit Reader(const EnvLookup& lookup) : lookup_(lookup) {}

  bool has(const std::string& name) const { return lookup_(name).has_value(); }

  // NAME= counts as unset, as everywhere (lockstep/base/env_var.h).
  std::optional<std::string> str(const std::string& name) const {
    return env_string(name, lookup_);
  }

  // A decimal integer in [lo, hi] (within int), or nullopt when unset.
  std::optional<int> integer(const std::string& name, int64_t lo, int64_t hi) const {
    const auto v = env_int(name, lo, hi, {}, lookup_);
    if (!v) return std::nullopt;
    return static_cast<int>(*v);
  }

  std::optional<double> number(const std::string& name, double lo, double hi,
                               const EnvHelp& help) const {
    return env_double(name, lo, hi, help, lookup_);
  }

 private:
  const EnvLookup& lookup_;
};

constexpr long long kMaxRanks = 1 << 24;

// "node[01-04,07]" -> "node01"; "a,b" -> "a"; "host" -> "host".
std::string first_slurm_host(const std::string& list) {
  std::string out;
  for (size_t i = 0; i < list.size(); ++i) {
    const char c = list[i];
    if (c == ',') break;
    if (c == '[') {
      for (size_t j = i + 1; j < list.size() && std::isdigit(static_cast<unsigned char>(list[j]));
           ++j) {
        out += list[j];
      }
      break;
    }
    out += c;
  }
  return out;
}

// "4(x2),3" -> 4: SLURM_TASKS_PER_NODE's count on the first node.
std::optional<int> leading_count(const std::optional<std::string>& s) {
  if (!s) return std::nullopt;
  int x = 0;
  auto [p, ec] = std::from_chars(s->data(), s->data() + s->size(), x);
  if (ec != std::errc() || x < 1) return std::nullopt;
  return x;
}

// LOCKSTEP_RENDEZVOUS_TIMEOUT and LOCKSTEP_TIMEOUT: seconds, fractions allowed.
std::optional<std::chrono::milliseconds> seconds_var(const Reader& vars, const char* name,
                                                     double min_s, double max_s) {
  const auto s = vars.number(name, min_s, max_s, {.unit = "seconds", .note = "a week"});
  if (!s) return std::nullopt;
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(*s * 1000)));
}

void check_consistent(const DistEnv& e, const std::string& vars) {
  LS_CHECK(e.world_size >= 1, vars, ": the world size must be >= 1, got ", e.world_size);
  LS_CHECK(e.rank < e.world_size, vars, ": rank ", e.rank, " must be < world size ", e.world_size);
  LS_CHECK(e.local_world_size >= 1 && e.local_world_size <= e.world_size, vars,
           ": the local world size ", e.local_world_size, " must be in [1, world size ",
           e.world_size, "]");
  LS_CHECK(e.local_rank < e.local_world_size, vars, ": local rank ", e.local_rank,
           " must be < local world size ", e.local_world_size);
}

}  // namespace

DistEnv read_dist_env(const EnvLookup& lookup) {
  const Reader vars(lookup);
  DistEnv e;
  e.agent_store = vars.str(env::kUseAgentStore).value_or("0") == "1";
  e.restart_count = vars.integer(env::kRestartCount, 0, 1 << 30).value_or(0);
  e.run_id = vars.str(env::kRunId).value_or("");
  e.rendezvous_timeout =
      seconds_var(vars, env::kRendezvousTimeout, kMinRendezvousTimeoutS, kMaxRendezvousTimeoutS);
  e.timeout = seconds_var(vars, env::kTimeout, kMinTimeoutS, kMaxTimeoutS);
  e.backend = vars.str(env::kBackend).value_or("");
  if (std::string token = store_token_from_env(lookup); !token.empty()) e.store_token = token;
  if (const auto insecure = vars.str(env::kStoreInsecure)) {
    LS_CHECK(*insecure == "0" || *insecure == "1", env::kStoreInsecure,
             ": expected 1 (rank 0's store may listen beyond loopback without a token) or 0, got '",
             *insecure, "'");
    e.store_insecure = *insecure == "1";
  }
  e.socket_ifname = vars.str(env::kSocketIfname).value_or(vars.str(kGlooSocketIfname).value_or(""));
  const auto master_addr = vars.str(env::kMasterAddr);
  const auto master_port = vars.integer(env::kMasterPort, 1, 65535);

  const bool torchrun = vars.str(env::kRank) || vars.str(env::kWorldSize);
  const bool slurm = vars.str("SLURM_PROCID") && vars.str("SLURM_NTASKS");
  const bool ompi = vars.str("OMPI_COMM_WORLD_RANK") && vars.str("OMPI_COMM_WORLD_SIZE");
  if (torchrun) {
    e.source = lockstep::detail::str_cat(env::kRank, "/", env::kWorldSize);
    auto rank = vars.integer(env::kRank, 0, kMaxRanks);
    auto size = vars.integer(env::kWorldSize, 1, kMaxRanks);
    LS_CHECK(rank && size, rank ? env::kRank : env::kWorldSize, " is set but ",
             rank ? env::kWorldSize : env::kRank,
             " is not: set both (a launcher such as `lockstep run` sets every variable)");
    e.rank = *rank;
    e.world_size = *size;
    // Without LOCAL_* the job is taken to run on this one machine.
    e.local_world_size = vars.integer(env::kLocalWorldSize, 1, kMaxRanks).value_or(e.world_size);
    e.local_rank =
        vars.integer(env::kLocalRank, 0, kMaxRanks).value_or(e.rank % e.local_world_size);
    e.group_rank =
        vars.integer(env::kGroupRank, 0, kMaxRanks).value_or(e.rank / e.local_world_size);
    check_consistent(
        e, lockstep::detail::str_cat(e.source, "/", env::kLocalRank, "/", env::kLocalWorldSize));
  } else if (slurm) {
    e.source = "SLURM";
    e.rank = *vars.integer("SLURM_PROCID", 0, kMaxRanks);
    e.world_size = *vars.integer("SLURM_NTASKS", 1, kMaxRanks);
    e.local_rank = vars.integer("SLURM_LOCALID", 0, kMaxRanks).value_or(0);
    e.local_world_size =
        vars.integer("SLURM_NTASKS_PER_NODE", 1, kMaxRanks)
            .value_or(leading_count(vars.str("SLURM_TASKS_PER_NODE")).value_or(e.world_size));
    e.group_rank = vars.integer("SLURM_NODEID", 0, kMaxRanks).value_or(0);
    check_consistent(e, "SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NTASKS_PER_NODE");
  } else if (ompi) {
    e.source = "Open MPI";
    e.rank = *vars.integer("OMPI_COMM_WORLD_RANK", 0, kMaxRanks);
    e.world_size = *vars.integer("OMPI_COMM_WORLD_SIZE", 1, kMaxRanks);
    e.local_rank = vars.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxRanks).value_or(0);
    e.local_world_size =
        vars.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxRanks).value_or(e.world_size);
    e.group_rank = vars.integer("OMPI_COMM_WORLD_NODE_RANK", 0, kMaxRanks).value_or(0);
    check_consistent(e, "OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE");
  } else {
    return e;  // a world of one
  }

  const bool one_machine = e.local_world_size == e.world_size;
  if (master_addr) {
    e.master_addr = *master_addr;
  } else if (e.source == "SLURM" && vars.str("SLURM_NODELIST")) {
    e.master_addr = first_slurm_host(*vars.str("SLURM_NODELIST"));
  } else {
    LS_CHECK(one_machine, env::kMasterAddr, " is not set, but the job spans several machines (",
             e.source, ": world size ", e.world_size, ", ", e.local_world_size,
             " per machine); set ", env::kMasterAddr, " to the host of rank 0");
  }
  if (master_port) {
    e.master_port = static_cast<uint16_t>(*master_port);
  } else if (e.source == "SLURM" && vars.str("SLURM_JOB_ID")) {
    const int job = vars.integer("SLURM_JOB_ID", 0, (1LL << 31) - 1).value_or(0);
    e.master_port = static_cast<uint16_t>(kSlurmPortBase + job % kSlurmPortSpan);
  } else {
    e.master_port = kDefaultStorePort;
  }
  return e;
}

}  // namespace lockstep::dist
