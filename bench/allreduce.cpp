// all_reduce bandwidth on loopback: lockstep's Gloo process group side by side with raw Gloo
// calls, 4 KiB ... 64 MiB of float32, with 2 and 4 processes, in the same run.
//
//   allreduce [--procs 2,4] [--min-bytes 4096] [--max-bytes 67108864] [--rounds 7]
//             [--json bench/results/allreduce.json]
//
// The program starts the ranks itself (it re-runs its own binary with RANK, WORLD_SIZE, ...).
// Each rank times `iters` back-to-back all_reduces between barriers, alternating lockstep and raw
// Gloo round by round so that both see the same machine noise; the table reports rank 0's median
// round, and ours/gloo is the median of the per-round ratios (bandwidth ours / bandwidth gloo).
// algbw = bytes / time; busbw = algbw x 2(n-1)/n, as nccl-tests define it.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include "bench_ranks.h"
#include "lockstep/distributed/init.h"
#include "lockstep/lockstep.h"

using namespace lockstep;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kRoleEnv = "LOCKSTEP_BENCH_ALLREDUCE";  // "<min>:<max>:<rounds>:<out>"
constexpr const char* kFileStoreEnv = "LOCKSTEP_BENCH_FILESTORE";
// Each round moves about this many bytes (fewer rounds' worth of calls for big messages).
constexpr int64_t kBytesPerRound = 64 << 20;
constexpr int kMinIters = 3;
constexpr int kMaxIters = 200;

struct Row {
  int procs = 0;
  int64_t bytes = 0;
  double ours_s = 0, raw_s = 0;  // median seconds per all_reduce
  double ratio = 0;              // median over rounds of (gloo time / our time), paired
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- one rank ----

int run_rank(int64_t min_bytes, int64_t max_bytes, int rounds, const std::string& out_path) {
  auto pg = dist::init_process_group();
  const int rank = pg->rank(), size = pg->size();

  // Raw Gloo: its own file store, device and context, on the same loopback address.
  gloo::rendezvous::FileStore file_store(std::getenv(kFileStoreEnv));
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto raw = std::make_shared<gloo::rendezvous::Context>(rank, size);
  raw->connectFullMesh(file_store, device);

  std::ofstream out;
  if (rank == 0) out.open(out_path);
  uint32_t tag = 1;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const int64_t n = bytes / 4;
    const int iters =
        static_cast<int>(std::clamp<int64_t>(kBytesPerRound / bytes, kMinIters, kMaxIters));
    Tensor ours = full({n}, 1.0, kFloat32);
    std::vector<float> theirs(static_cast<size_t>(n), 1.0f);
    auto run_ours = [&] {
      for (int i = 0; i < iters; ++i) pg->all_reduce(ours)->wait();
    };
    auto run_raw = [&] {
      for (int i = 0; i < iters; ++i) {
        gloo::AllreduceOptions o(raw);
        o.setOutput(theirs.data(), theirs.size());
        o.setReduceFunction(
            static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
        o.setTag(tag++);
        gloo::allreduce(o);
      }
    };
    auto timed = [&](const std::function<void()>& body) {
      pg->barrier()->wait();
      const auto t0 = Clock::now();
      body();
      return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
    };
    run_ours();  // warm-up: buffers, caches, TCP windows
    run_raw();
    // Rounds alternate which goes first; the ratio is taken per round (both halves saw the same
    // moment of the machine), then its median.
    std::vector<double> ours_t, raw_t, ratios;
    for (int r = 0; r < rounds; ++r) {
      if (r % 2 == 0) {
        ours_t.push_back(timed(run_ours));
        raw_t.push_back(timed(run_raw));
      } else {
        raw_t.push_back(timed(run_raw));
        ours_t.push_back(timed(run_ours));
      }
      ratios.push_back(raw_t.back() / ours_t.back());
    }
    if (rank == 0) {
      out << bytes << " " << median(ours_t) << " " << median(raw_t) << " " << median(ratios)
          << "\n";
    }
  }
  pg->barrier()->wait();
  raw.reset();
  dist::destroy_process_group();
  return 0;
}

// ---- the launcher part ----

std::vector<Row> run_job(int procs, int64_t min_bytes, int64_t max_bytes, int rounds) {
  const auto tmp =
      std::filesystem::temp_directory_path() /
      ("lockstep_allreduce_" + std::to_string(::getpid()) + "_" + std::to_string(procs));
  std::filesystem::create_directories(tmp / "filestore");
  const std::string out_path = (tmp / "rank0.txt").string();
  std::ostringstream role;
  role << min_bytes << ":" << max_bytes << ":" << rounds << ":" << out_path;
  const bool ok = bench::run_ranks(
      procs, {"OMP_NUM_THREADS=1", std::string(kFileStoreEnv) + "=" + (tmp / "filestore").string(),
              std::string(kRoleEnv) + "=" + role.str()});
  if (!ok) {
    std::fprintf(stderr, "allreduce: a rank of the %d-process job failed\n", procs);
    std::exit(1);
  }
  std::vector<Row> rows;
  std::ifstream in(out_path);
  Row row;
  row.procs = procs;
  while (in >> row.bytes >> row.ours_s >> row.raw_s >> row.ratio) rows.push_back(row);
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

int main(int argc, char** argv) {
  if (const char* role = std::getenv(kRoleEnv)) {
    long long mn = 0, mx = 0;
    int rounds = 0;
    char out[4096] = {};
    if (std::sscanf(role, "%lld:%lld:%d:%4095s", &mn, &mx, &rounds, out) != 4) return 2;
    try {
      return run_rank(mn, mx, rounds, out);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK"), e.what());
      return 1;
    }
  }

  std::vector<int> procs = {2, 4};
  int64_t min_bytes = 4 << 10, max_bytes = 64 << 20;
  int rounds = 7;
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
    } else if (a == "--json") {
      json = next();
    } else {
      std::fprintf(stderr,
                   "usage: allreduce [--procs 2,4] [--min-bytes B] [--max-bytes B] [--rounds R] "
                   "[--json PATH]\nunknown argument: %s\n",
                   a.c_str());
      return 2;
    }
  }

  std::printf("all_reduce sum, float32, loopback, %ld cores; median of %d rounds (rank 0)\n",
              sysconf(_SC_NPROCESSORS_ONLN), rounds);
  std::printf("%5s %9s | %10s %10s %10s | %10s %10s | %6s\n", "procs", "size", "ours us",
              "algbw GB/s", "busbw GB/s", "gloo us", "busbw GB/s", "ours/gloo");
  std::vector<Row> all;
  for (int p : procs) {
    for (const Row& r : run_job(p, min_bytes, max_bytes, rounds)) {
      const double factor = 2.0 * (r.procs - 1) / r.procs;
      const double ours_alg = r.bytes / r.ours_s / 1e9, raw_alg = r.bytes / r.raw_s / 1e9;
      std::printf("%5d %9s | %10.1f %10.3f %10.3f | %10.1f %10.3f | %6.3f\n", r.procs,
                  human(r.bytes).c_str(), r.ours_s * 1e6, ours_alg, ours_alg * factor,
                  r.raw_s * 1e6, raw_alg * factor, r.ratio);
      std::fflush(stdout);
      all.push_back(r);
    }
  }
  if (!json.empty()) {
    std::filesystem::create_directories(std::filesystem::path(json).parent_path());
    std::ofstream j(json);
    j << "{\"benchmark\": \"allreduce\", \"dtype\": \"f32\", \"rounds\": " << rounds
      << ", \"rows\": [\n";
    for (size_t i = 0; i < all.size(); ++i) {
      const Row& r = all[i];
      const double factor = 2.0 * (r.procs - 1) / r.procs;
      j << "  {\"procs\": " << r.procs << ", \"bytes\": " << r.bytes << ", \"ours_s\": " << r.ours_s
        << ", \"gloo_s\": " << r.raw_s
        << ", \"ours_busbw_gbs\": " << r.bytes / r.ours_s / 1e9 * factor
        << ", \"gloo_busbw_gbs\": " << r.bytes / r.raw_s / 1e9 * factor
        << ", \"ratio\": " << r.ratio << "}" << (i + 1 < all.size() ? "," : "") << "\n";
    }
    j << "]}\n";
  }
  return 0;
}
