// What a checkpoint costs the training step it happens in, 2 processes on one machine, each
// holding its half of a model's state as sharded-checkpoint slices: a step of fixed compute
// alone, with a synchronous sharded save (dist::save_sharded_checkpoint) and with an
// asynchronous one (dist::AsyncShardedSaver::save: the snapshot in the step, the writing in the
// background, waited for outside the timed step). Rounds alternate the order; medians.
//
//   build/release/bench/sharded_save [--rounds 7] [--state-mb 64] [--dir DIR]
//
// The step's compute is matrix products for about as long as the synchronous save takes, so the
// background writing has a step to hide behind.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_ranks.h"
#include "lockstep/distributed/sharded_checkpoint.h"
#include "lockstep/lockstep.h"

using namespace lockstep;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// About `seconds` of matrix products on this rank's thread.
struct Compute {
  Tensor a, b;
  int reps = 1;
  void run() const {
    for (int k = 0; k < reps; ++k) (void)matmul(a, b);
  }
};

int rank_main(int rounds, int64_t state_mb, const std::string& dir) {
  auto pg = dist::init_process_group({.backend = "shm"});
  const int rank = pg->rank(), world = pg->size();
  Generator gen(1 + static_cast<uint64_t>(rank));
  // This rank's half of one tensor of state_mb MiB (f32), as FSDP's pieces would be.
  const int64_t total = state_mb * (int64_t{1} << 20) / 4;
  const int64_t per = total / world;
  std::vector<io::TensorSlice> slices = {
      {"model.weight", Dims{total}, rank * per, randn({per}, gen)}};
  io::TrainingCheckpoint meta;
  meta.world_size = world;
  Compute compute{randn({256, 256}, gen), randn({256, 256}, gen)};
  // Calibrate the step to about the synchronous save's time.
  auto t0 = Clock::now();
  dist::save_sharded_checkpoint(*pg, dir + "/calibrate", slices, meta);
  const double save_s = seconds_since(t0);
  compute.reps = 10;
  compute.run();  // warm
  t0 = Clock::now();
  compute.run();
  const double one = std::max(1e-6, seconds_since(t0) / compute.reps);
  compute.reps = std::max(1, static_cast<int>(save_s / one));
  Tensor reps = full({1}, compute.reps, kFloat64);
  pg->all_reduce_host(reps, {.op = dist::ReduceOp::max});
  compute.reps = static_cast<int>(reps.item());

  dist::AsyncShardedSaver saver(*pg);
  std::vector<double> plain, sync, async, call;
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 3; ++k) {
      const int which = (k + r) % 3;
      meta.step = r * 3 + k;
      const std::string path = dir + "/ck" + std::to_string(which);
      pg->barrier()->wait();
      t0 = Clock::now();
      if (which == 1) dist::save_sharded_checkpoint(*pg, path, slices, meta);
      double called = 0;
      if (which == 2) {
        const auto c0 = Clock::now();
        saver.save(path, slices, meta);
        called = seconds_since(c0);
      }
      compute.run();
      pg->barrier()->wait();
      const double dt = seconds_since(t0);
      if (which == 2) saver.wait();  // outside the step: the next save would wait for it anyway
      (which == 0 ? plain : which == 1 ? sync : async).push_back(dt);
      if (which == 2) call.push_back(called);
    }
  }
  if (rank == 0) {
    const double p = median(plain), s = median(sync), a = median(async);
    std::printf(
        "state %lld MiB over %d ranks, %d rounds, step compute %.1f ms\n"
        "  step alone %.1f ms, with a synchronous save %.1f ms (+%.1f), with an asynchronous one "
        "%.1f ms (+%.1f; its save() call %.2f ms)\n"
        "  the asynchronous save adds %.1f%% of the synchronous save's time to its step\n",
        static_cast<long long>(state_mb), world, rounds, one * compute.reps * 1e3, p * 1e3, s * 1e3,
        (s - p) * 1e3, a * 1e3, (a - p) * 1e3, median(call) * 1e3,
        100.0 * std::max(0.0, a - p) / std::max(1e-9, s - p));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 7;
  int64_t state_mb = 64;
  std::string dir = std::filesystem::temp_directory_path().string() + "/lockstep-sharded-save";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--rounds") rounds = std::atoi(argv[i + 1]);
    if (flag == "--state-mb") state_mb = std::atoll(argv[i + 1]);
    if (flag == "--dir") dir = argv[i + 1];
  }
  try {
    // The ranks are this program again, without arguments: the settings travel in variables.
    if (std::getenv("RANK") != nullptr) {
      return rank_main(std::atoi(std::getenv("BENCH_ROUNDS")),
                       std::atoll(std::getenv("BENCH_STATE_MB")), std::getenv("BENCH_DIR"));
    }
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const bool ok = bench::run_ranks(
        2, {"BENCH_ROUNDS=" + std::to_string(rounds), "BENCH_STATE_MB=" + std::to_string(state_mb),
            "BENCH_DIR=" + dir, "OMP_NUM_THREADS=1"});
    std::filesystem::remove_all(dir);
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sharded_save: %s\n", e.what());
    return 1;
  }
}
