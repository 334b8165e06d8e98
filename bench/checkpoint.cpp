// Checkpoint save and load with 2 processes on one machine: rank 0's atomic save (SHA-256, fsync,
// rename) and the two ways every rank can get a checkpoint, each rank reading the file itself
// (memory-mapped) against rank 0 reading it and broadcasting, at the size of the example's MLP
// checkpoint and larger. Rounds alternate which load goes first; medians.
//
//   build/release/bench/checkpoint [--rounds 5] [--sizes-mb 15,128,512] [--dir DIR]
//
// The file sits in the page cache after rank 0 wrote it, as after a restart on the same node;
// a cold read from disk would cost every way the same one read on rank 0's node.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_ranks.h"
#include "lockstep/distributed/checkpoint.h"
#include "lockstep/lockstep.h"

using namespace lockstep;

namespace {

constexpr const char* kRoleEnv = "LOCKSTEP_BENCH_CHECKPOINT";  // "<rounds>:<sizes>:<dir>:<out>"
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A checkpoint of about `mb` MiB shaped like a training one: model tensors and as many bytes of
// optimizer state (SGD momentum).
io::TrainingCheckpoint make_checkpoint(int64_t mb) {
  Generator gen(1);
  io::TrainingCheckpoint c;
  const int64_t per = (mb << 20) / 2 / 4 / 4;  // 4 tensors of f32 per half
  for (int i = 0; i < 4; ++i) {
    c.model.emplace_back("layer" + std::to_string(i) + ".weight", randn({per}, gen));
    c.optimizer.emplace_back(std::to_string(i) + ".momentum_buffer", randn({per}, gen));
  }
  c.step = 100;
  return c;
}

int run_rank(int rounds, const std::vector<int64_t>& sizes, const std::string& dir,
             const std::string& out_path) {
  auto pg = dist::init_process_group();
  std::ofstream out;
  if (pg->rank() == 0) out.open(out_path);
  for (int64_t mb : sizes) {
    const io::TrainingCheckpoint ckpt = make_checkpoint(mb);
    const std::string path = dir + "/ck" + std::to_string(mb) + ".safetensors";
    auto timed = [&](const std::function<void()>& body) {
      pg->barrier()->wait();
      const auto t0 = Clock::now();
      body();
      pg->barrier()->wait();
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    auto save = [&] { dist::save_checkpoint(*pg, path, ckpt); };
    auto every = [&] { dist::load_checkpoint(*pg, path, dist::CheckpointLoad::every_rank); };
    auto bcast = [&] { dist::load_checkpoint(*pg, path, dist::CheckpointLoad::broadcast); };
    auto automatic = [&] { dist::load_checkpoint(*pg, path); };
    save();  // warm-up: page cache, TCP windows
    every();
    bcast();
    std::vector<double> t_save, t_every, t_bcast, t_auto, ratio;
    for (int r = 0; r < rounds; ++r) {
      t_save.push_back(timed(save));
      if (r % 2 == 0) {
        t_every.push_back(timed(every));
        t_bcast.push_back(timed(bcast));
      } else {
        t_bcast.push_back(timed(bcast));
        t_every.push_back(timed(every));
      }
      t_auto.push_back(timed(automatic));
      ratio.push_back(t_bcast.back() / t_every.back());
    }
    if (pg->rank() == 0) {
      const double bytes = static_cast<double>(std::filesystem::file_size(path));
      out << bytes << " " << median(t_save) << " " << median(t_every) << " " << median(t_bcast)
          << " " << median(t_auto) << " " << median(ratio) << "\n";
    }
    pg->barrier()->wait();
    if (pg->rank() == 0) std::filesystem::remove(path);
  }
  dist::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* role = std::getenv(kRoleEnv)) {
    std::vector<std::string> parts;
    std::stringstream ss(role);
    for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
    if (parts.size() != 4) return 2;
    std::vector<int64_t> sizes;
    std::stringstream sz(parts[1]);
    for (std::string p; std::getline(sz, p, ',');) sizes.push_back(std::stoll(p));
    try {
      return run_rank(std::stoi(parts[0]), sizes, parts[2], parts[3]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK"), e.what());
      return 1;
    }
  }
  int rounds = 5;
  std::string sizes = "15,128,512";
  std::string dir = std::filesystem::temp_directory_path().string();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 < argc && a == "--rounds") {
      rounds = std::stoi(argv[++i]);
    } else if (i + 1 < argc && a == "--sizes-mb") {
      sizes = argv[++i];
    } else if (i + 1 < argc && a == "--dir") {
      dir = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: checkpoint [--rounds R] [--sizes-mb 15,128,512] [--dir DIR]\n"
                   "unknown or incomplete argument: %s\n",
                   a.c_str());
      return 2;
    }
  }
  const std::string work = dir + "/lockstep_ckpt_bench_" + std::to_string(::getpid());
  std::filesystem::create_directories(work);
  const std::string out_path = work + "/rank0.txt";
  const std::string role = std::to_string(rounds) + ":" + sizes + ":" + work + ":" + out_path;
  const bool ok = bench::run_ranks(2, {"OMP_NUM_THREADS=1", std::string(kRoleEnv) + "=" + role});
  if (!ok) {
    std::fprintf(stderr, "checkpoint: a rank failed\n");
    std::filesystem::remove_all(work);
    return 1;
  }
  std::printf("checkpoint save and load, 2 processes, %ld cores, median of %d rounds\n",
              sysconf(_SC_NPROCESSORS_ONLN), rounds);
  std::printf("%9s | %9s %9s | %12s %12s %12s | %10s\n", "size MiB", "save ms", "save MB/s",
              "every ms", "bcast ms", "auto ms", "bcast/every");
  std::ifstream in(out_path);
  double bytes, save, every, bcast, automatic, ratio;
  while (in >> bytes >> save >> every >> bcast >> automatic >> ratio) {
    std::printf("%9.1f | %9.1f %9.0f | %12.1f %12.1f %12.1f | %10.2f\n", bytes / (1 << 20),
                save * 1e3, bytes / save / 1e6, every * 1e3, bcast * 1e3, automatic * 1e3, ratio);
  }
  std::filesystem::remove_all(work);
  return 0;
}
