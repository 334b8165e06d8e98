// Open MPI's MPI_Allreduce on the sizes bench/allreduce measures lockstep on, timed the same way:
// float32 sums in place, iters back-to-back calls between barriers, rounds of them, rank 0's
// median round. Built only where MPI is installed (`apt-get install openmpi-bin libopenmpi-dev`,
// for this benchmark only); run it with scripts/bench-allreduce.sh, which puts its column beside
// bench/allreduce's shm and gloo columns.
//
//   mpirun -np 2 mpi_allreduce [--min-bytes 4096] [--max-bytes 67108864] [--rounds 7]
//                              [--json PATH]
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

// The same schedule as bench/allreduce.cpp: about 64 MiB per round, 3 to 200 calls.
constexpr long long kBytesPerRound = 64LL << 20;
constexpr int kMinIters = 3;
constexpr int kMaxIters = 200;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  long long min_bytes = 4 << 10, max_bytes = 64LL << 20;
  int rounds = 7;
  std::string json;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--min-bytes") {
      min_bytes = std::atoll(argv[i + 1]);
    } else if (a == "--max-bytes") {
      max_bytes = std::atoll(argv[i + 1]);
    } else if (a == "--rounds") {
      rounds = std::atoi(argv[i + 1]);
    } else if (a == "--json") {
      json = argv[i + 1];
    } else {
      if (rank == 0) std::fprintf(stderr, "mpi_allreduce: unknown argument %s\n", a.c_str());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  if (rank == 0) {
    std::printf("Open MPI MPI_Allreduce, %d processes, float32 sum in place, median of %d rounds\n",
                size, rounds);
    std::printf("%10s %12s %12s\n", "bytes", "time (us)", "algbw GB/s");
  }
  std::string rows;
  for (long long bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const long long n = bytes / 4;
    const int iters =
        static_cast<int>(std::clamp<long long>(kBytesPerRound / bytes, kMinIters, kMaxIters));
    std::vector<float> x(static_cast<size_t>(n), 1.0f);
    auto run = [&] {
      for (int i = 0; i < iters; ++i) {
        MPI_Allreduce(MPI_IN_PLACE, x.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                      MPI_COMM_WORLD);
      }
    };
    run();  // warm-up
    std::vector<double> t;
    for (int r = 0; r < rounds; ++r) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      run();
      t.push_back((MPI_Wtime() - t0) / iters);
    }
    const double s = median(t);
    if (rank == 0) {
      std::printf("%10lld %12.1f %12.3f\n", bytes, s * 1e6, static_cast<double>(bytes) / s / 1e9);
      char row[160];
      std::snprintf(row, sizeof(row),
                    "%s{\"bytes\": %lld, \"seconds\": %.9g, \"algbw_gbps\": %.6g}",
                    rows.empty() ? "" : ", ", bytes, s, static_cast<double>(bytes) / s / 1e9);
      rows += row;
    }
  }
  if (rank == 0 && !json.empty()) {
    std::ofstream(json) << "{\"benchmark\": \"mpi_allreduce\", \"procs\": " << size
                        << ", \"rows\": [" << rows << "]}\n";
  }
  MPI_Finalize();
  return 0;
}
