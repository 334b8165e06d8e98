// all_reduce through lockstep's public API: the shm backend side by side with the gloo backend,
// 4 KiB ... 64 MiB of float32, with 2 (and optionally 4) processes, in the same run.
//
//   allreduce [--procs 2] [--min-bytes 4096] [--max-bytes 67108864] [--rounds 7]
//             [--slot-bytes 4194304] [--json bench/results/allreduce.json]
//
// The program starts the ranks itself (it re-runs its own binary with RANK, WORLD_SIZE, ...).
// Every rank holds both groups (gloo through connect_world, shm over the same store). Each rank
// times `iters` back-to-back all_reduces between barriers, alternating shm and gloo round by
// round so that both see the same machine noise; the table reports rank 0's median round, and
// shm/gloo is the median of the per-round ratios (gloo time / shm time: above 1, shm is faster).
// algbw = bytes / time; busbw = algbw x 2(n-1)/n, as nccl-tests define it. The first row,
// "barrier", times barriers: Gloo's is the signature exchange every Gloo collective starts with.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_ranks.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/shm/process_group_shm.h"
#include "lockstep/distributed/store/prefix_store.h"
#include "lockstep/lockstep.h"

using namespace lockstep;
using Clock = std::chrono::steady_clock;

namespace {

// "<min>:<max>:<rounds>:<slot bytes>:<out>"
constexpr const char* kRoleEnv = "LOCKSTEP_BENCH_ALLREDUCE";
// Each round moves about this many bytes (fewer rounds' worth of calls for big messages).
constexpr int64_t kBytesPerRound = 64 << 20;
constexpr int kMinIters = 3;
constexpr int kMaxIters = 200;

struct Row {
  int procs = 0;
  int64_t bytes = 0;
  double shm_s = 0, gloo_s = 0;  // median seconds per all_reduce
  double ratio = 0;              // median over rounds of (gloo time / shm time), paired
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- one rank ----

int run_rank(int64_t min_bytes, int64_t max_bytes, int rounds, int64_t slot_bytes,
             const std::string& out_path) {
  dist::InitOptions io;
  io.backend = "gloo";
  dist::World world = dist::connect_world(dist::read_dist_env(), io);
  auto gloo = world.group;
  const int rank = gloo->rank(), size = gloo->size();
  dist::BackendConfig config;
  config.store = std::make_shared<dist::PrefixStore>("bench-shm", world.store);
  config.rank = rank;
  config.size = size;
  config.timeout = gloo->timeout();
  auto shm = std::make_shared<dist::ProcessGroupShm>(config, dist::ShmOptions{slot_bytes});

  std::ofstream out;
  if (rank == 0) out.open(out_path);
  {
    // A row of 0 bytes: barrier. Gloo's barrier is exactly the signature exchange every Gloo
    // collective begins with (Note [Gloo signature check]), so this is what that check costs.
    constexpr int kBarriers = 200;
    auto timed_barriers = [&](const dist::ProcessGroupPtr& pg) {
      gloo->barrier()->wait();
      const auto t0 = Clock::now();
      for (int i = 0; i < kBarriers; ++i) pg->barrier()->wait();
      return std::chrono::duration<double>(Clock::now() - t0).count() / kBarriers;
    };
    timed_barriers(shm);
    timed_barriers(gloo);
    std::vector<double> shm_t, gloo_t, ratios;
    for (int r = 0; r < rounds; ++r) {
      shm_t.push_back(timed_barriers(shm));
      gloo_t.push_back(timed_barriers(gloo));
      ratios.push_back(gloo_t.back() / shm_t.back());
    }
    if (rank == 0)
      out << 0 << " " << median(shm_t) << " " << median(gloo_t) << " " << median(ratios) << "\n";
  }
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const int64_t n = bytes / 4;
    const int iters =
        static_cast<int>(std::clamp<int64_t>(kBytesPerRound / bytes, kMinIters, kMaxIters));
    Tensor a = full({n}, 1.0, kFloat32), b = full({n}, 1.0, kFloat32);
    auto run_shm = [&] {
      for (int i = 0; i < iters; ++i) shm->all_reduce(a)->wait();
    };
    auto run_gloo = [&] {
      for (int i = 0; i < iters; ++i) gloo->all_reduce(b)->wait();
    };
    auto timed = [&](const std::function<void()>& body) {
      gloo->barrier()->wait();
      const auto t0 = Clock::now();
      body();
      return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
    };
    run_shm();  // warm-up: pages, caches, TCP windows
    run_gloo();
    // Rounds alternate which goes first; the ratio is taken per round (both halves saw the same
    // moment of the machine), then its median.
    std::vector<double> shm_t, gloo_t, ratios;
    for (int r = 0; r < rounds; ++r) {
      if (r % 2 == 0) {
        shm_t.push_back(timed(run_shm));
        gloo_t.push_back(timed(run_gloo));
      } else {
        gloo_t.push_back(timed(run_gloo));
        shm_t.push_back(timed(run_shm));
      }
      ratios.push_back(gloo_t.back() / shm_t.back());
    }
    if (rank == 0) {
      out << bytes << " " << median(shm_t) << " " << median(gloo_t) << " " << median(ratios)
          << "\n";
    }
  }
  gloo->barrier()->wait();
  shm.reset();
  return 0;
}

// ---- the launcher part ----

std::vector<Row> run_job(int procs, int64_t min_bytes, int64_t max_bytes, int rounds,
                         int64_t slot_bytes) {
  const auto tmp =
      std::filesystem::temp_directory_path() /
      ("lockstep_allreduce_" + std::to_string(::getpid()) + "_" + std::to_string(procs));
  std::filesystem::create_directories(tmp);
  const std::string out_path = (tmp / "rank0.txt").string();
  std::ostringstream role;
  role << min_bytes << ":" << max_bytes << ":" << rounds << ":" << slot_bytes << ":" << out_path;
  const bool ok =
      bench::run_ranks(procs, {"OMP_NUM_THREADS=1", std::string(kRoleEnv) + "=" + role.str()});
  if (!ok) {
    std::fprintf(stderr, "allreduce: a rank of the %d-process job failed\n", procs);
    std::exit(1);
  }
  std::vector<Row> rows;
  std::ifstream in(out_path);
  Row row;
  row.procs = procs;
  while (in >> row.bytes >> row.shm_s >> row.gloo_s >> row.ratio) rows.push_back(row);
  std::filesystem::remove_all(tmp);
  return rows;
}

std::string human(int64_t bytes) {
  char buf[32];
  if (bytes >= (1 << 20)) {
    std::snprintf(buf, sizeof(buf), "%lld MiB", static_cast<long long>(bytes >> 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld KiB", static_cast<long long>(bytes >> 10));
  }
  return buf;
}

}  // namespace

// Nanoseconds the trace adds to one collective: the median of `rounds` timings. shm's collectives
// are issued and finished (they run on the caller's thread, complete before wait()); `waited`:
// also started by a communication thread and waited for by the caller (gloo, nccl).
double trace_cost_ns(int rounds, bool waited) {
  const auto path =
      std::filesystem::temp_directory_path() / ("allreduce_trace_" + std::to_string(::getpid()));
  auto trace = std::make_shared<dist::CollectiveTrace>();
  trace->set_identity(0, 2, "shm");
  trace->export_to(path.string());
  constexpr int64_t kCalls = 1'000'000;
  std::vector<double> ns;
  int64_t seq = 0;
  for (int r = 0; r < std::max(rounds, 3); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kCalls; ++i) {
      ++seq;
      trace->record_issue(seq, 1, 0, 0, 0, 1024);
      std::shared_ptr<dist::CollectiveTrace> held = trace;  // as each Work holds the ring
      if (waited) held->record_start(seq);
      if (waited) held->record_wait(seq);
      held->record_finish(seq, true);
      if (waited) held->record_wait(0);
    }
    ns.push_back(
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
        kCalls);
  }
  std::filesystem::remove(path);
  std::sort(ns.begin(), ns.end());
  return ns[ns.size() / 2];
}

int main(int argc, char** argv) {
  if (const char* role = std::getenv(kRoleEnv)) {
    long long mn = 0, mx = 0, slot = 0;
    int rounds = 0;
    char out[4096] = {};
    if (std::sscanf(role, "%lld:%lld:%d:%lld:%4095s", &mn, &mx, &rounds, &slot, out) != 5) return 2;
    try {
      return run_rank(mn, mx, rounds, slot, out);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK"), e.what());
      return 1;
    }
  }

  std::vector<int> procs = {2};
  int64_t min_bytes = 4 << 10, max_bytes = 64 << 20;
  int rounds = 7;
  int64_t slot_bytes = dist::kDefaultShmSlotBytes;
  std::string json = "bench/results/allreduce.json";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "allreduce: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--procs") {
      procs.clear();
      std::stringstream ss(next());
      for (std::string p; std::getline(ss, p, ',');) procs.push_back(std::stoi(p));
    } else if (a == "--min-bytes") {
      min_bytes = std::stoll(next());
    } else if (a == "--max-bytes") {
      max_bytes = std::stoll(next());
    } else if (a == "--rounds") {
      rounds = std::stoi(next());
    } else if (a == "--slot-bytes") {
      slot_bytes = std::stoll(next());
    } else if (a == "--json") {
      json = next();
    } else {
      std::fprintf(stderr,
                   "usage: allreduce [--procs 2,4] [--min-bytes B] [--max-bytes B] [--rounds R] "
                   "[--slot-bytes B] [--json PATH]\nunknown argument: %s\n",
                   a.c_str());
      return 2;
    }
  }

  double load[3] = {};
  ::getloadavg(load, 3);
  std::printf(
      "all_reduce sum, float32, public API, %ld cores (load %.2f), shm slot %lld bytes; median "
      "of %d rounds (rank 0)\n",
      sysconf(_SC_NPROCESSORS_ONLN), load[0], static_cast<long long>(slot_bytes), rounds);
  std::printf("%5s %9s | %10s %10s | %10s %10s | %9s\n", "procs", "size", "shm us", "algbw GB/s",
              "gloo us", "algbw GB/s", "gloo/shm");
  std::vector<Row> all;
  for (int p : procs) {
    for (const Row& r : run_job(p, min_bytes, max_bytes, rounds, slot_bytes)) {
      if (r.bytes == 0) {
        std::printf("%5d %9s | %10.1f %10s | %10.1f %10s | %9.2f\n", r.procs, "barrier",
                    r.shm_s * 1e6, "", r.gloo_s * 1e6, "", r.ratio);
        all.push_back(r);
        continue;
      }
      std::printf("%5d %9s | %10.1f %10.3f | %10.1f %10.3f | %9.2f\n", r.procs,
                  human(r.bytes).c_str(), r.shm_s * 1e6, r.bytes / r.shm_s / 1e9, r.gloo_s * 1e6,
                  r.bytes / r.gloo_s / 1e9, r.ratio);
      std::fflush(stdout);
      all.push_back(r);
    }
  }
  // The collective trace's cost (Note [Collective trace]): what one collective adds (issue,
  // start, the caller's wait and its end, finish, and the Work's reference to the ring), in a
  // ring mapped from a file as under `lockstep run`, against the smallest shm all_reduce timed.
  const double trace_ns = trace_cost_ns(rounds, false);
  const double trace_waited_ns = trace_cost_ns(rounds, true);
  const Row* small = nullptr;
  for (const Row& r : all) {
    if (r.bytes > 0 && (small == nullptr || r.bytes < small->bytes)) small = &r;
  }
  if (small != nullptr) {
    std::printf(
        "trace: %.1f ns per collective = %.2f%% of the %d-process %s shm all_reduce; %.1f ns "
        "with a blocking wait() = %.3f%% of gloo's\n",
        trace_ns, trace_ns / (small->shm_s * 1e9) * 100, small->procs, human(small->bytes).c_str(),
        trace_waited_ns, trace_waited_ns / (small->gloo_s * 1e9) * 100);
  }
  if (!json.empty()) {
    std::filesystem::create_directories(std::filesystem::path(json).parent_path());
    std::ofstream j(json);
    j << "{\"benchmark\": \"allreduce\", \"dtype\": \"f32\", \"trace_ns\": " << trace_ns
      << ", \"trace_waited_ns\": " << trace_waited_ns << ", \"rounds\": " << rounds
      << ", \"shm_slot_bytes\": " << slot_bytes << ", \"rows\": [\n";
    for (size_t i = 0; i < all.size(); ++i) {
      const Row& r = all[i];
      if (r.bytes == 0) {
        j << "  {\"procs\": " << r.procs << ", \"barrier\": true, \"shm_s\": " << r.shm_s
          << ", \"gloo_s\": " << r.gloo_s << ", \"ratio\": " << r.ratio << "}"
          << (i + 1 < all.size() ? "," : "") << "\n";
        continue;
      }
      const double factor = 2.0 * (r.procs - 1) / r.procs;
      j << "  {\"procs\": " << r.procs << ", \"bytes\": " << r.bytes << ", \"shm_s\": " << r.shm_s
        << ", \"gloo_s\": " << r.gloo_s << ", \"shm_algbw_gbs\": " << r.bytes / r.shm_s / 1e9
        << ", \"gloo_algbw_gbs\": " << r.bytes / r.gloo_s / 1e9
        << ", \"shm_busbw_gbs\": " << r.bytes / r.shm_s / 1e9 * factor
        << ", \"gloo_busbw_gbs\": " << r.bytes / r.gloo_s / 1e9 * factor
        << ", \"ratio\": " << r.ratio << "}" << (i + 1 < all.size() ? "," : "") << "\n";
    }
    j << "]}\n";
  }
  return 0;
}
