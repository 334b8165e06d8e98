// all_reduce between machines: one rank of a job started by `lockstep run` (or any launcher that
// sets torchrun's variables) times the default group's all_reduce of float32 from 4 KiB to
// 64 MiB and rank 0 prints, per size, the median time per call, the algorithm bandwidth, and
// the time a bandwidth-optimal ring needs on links of --gbps (2 (n - 1) / n x bytes / rate, no
// latency): "of limit" is the ring's time over the measured one (1.0: as fast as the link allows).
// Then the cost model (Note [Cost model]), per size: the algorithm the group ran (the model's
// choice, or LOCKSTEP_ALLREDUCE_ALGO) and measured / predicted, first for the link the group
// runs with (the settings LOCKSTEP_NET_ALPHA_US and LOCKSTEP_NET_GBPS, or its calibration), then
// for alpha and beta fitted to these rows. Under the hier backend (several ranks per machine) the
// prediction is the hierarchical one, with shared memory at kShmLink; no fit is made there.
//
//   lockstep run ... net_allreduce [--gbps 1] [--min-bytes 4096] [--max-bytes 67108864]
//                                  [--rounds 5] [--json PATH]
//
// bench/shaped_net.sh runs it across emulated machines with rate-limited links.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "lockstep/distributed/cost_model.h"
#include "lockstep/distributed/init.h"
#include "lockstep/lockstep.h"

using namespace lockstep;
using Clock = std::chrono::steady_clock;

namespace {

// Each round moves about this many bytes per rank (fewer calls for big messages).
constexpr int64_t kBytesPerRound = 16 << 20;
constexpr int kMaxIters = 100;
// Shared memory between the ranks of one machine, for the hier prediction: about 5 us a round and
// 5 GB/s, the 2-process shm all_reduce of docs/PERFORMANCE.md on the 2-core VM.
constexpr dist::LinkModel kShmLink{.alpha = 5e-6, .beta = 0.2e-9};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int usage(const char* why) {
  std::fprintf(stderr,
               "usage: net_allreduce [--gbps G] [--min-bytes B] [--max-bytes B] [--rounds R] "
               "[--json PATH]\n%s\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  double gbps = 1;
  int64_t min_bytes = 4 << 10, max_bytes = 64 << 20;
  int rounds = 5;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage(("a value is missing after " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--gbps") {
      gbps = std::stod(v);
    } else if (a == "--min-bytes") {
      min_bytes = std::stoll(v);
    } else if (a == "--max-bytes") {
      max_bytes = std::stoll(v);
    } else if (a == "--rounds") {
      rounds = std::stoi(v);
    } else if (a == "--json") {
      json = v;
    } else {
      return usage(("unknown argument: " + a).c_str());
    }
  }
  if (gbps <= 0 || min_bytes < 4 || max_bytes < min_bytes || rounds < 1) {
    return usage("expected --gbps > 0, 4 <= --min-bytes <= --max-bytes, --rounds >= 1");
  }
  auto pg = dist::init_process_group();
  const int rank = pg->rank(), size = pg->size();
  const double ring_factor = 2.0 * (size - 1) / size;
  std::ofstream out;
  if (rank == 0) {
    std::printf("all_reduce sum, float32, backend %s, %d ranks, links %.3g Gbit/s; median of %d\n",
                std::string(pg->backend()).c_str(), size, gbps, rounds);
    std::printf("%10s %12s %12s %12s %9s\n", "bytes", "us/call", "algbw GB/s", "ring us",
                "of limit");
    if (!json.empty()) {
      out.open(json);
      out << "{\"benchmark\": \"net_allreduce\", \"backend\": \"" << pg->backend()
          << "\", \"ranks\": " << size << ", \"gbps\": " << gbps << ", \"rows\": [";
    }
  }
  bool first = true;
  // The algorithm each size ran: the gloo group's own choice (rank 0's link and setting); for
  // another backend, what a gloo group would choose from this process's settings.
  const auto* gloo = dynamic_cast<const dist::ProcessGroupGloo*>(pg.get());
  const dist::LinkModel settings = dist::link_from_env();
  const dist::AlgorithmSetting forced = dist::algorithm_setting_from_env();
  auto algorithm_of = [&](int64_t bytes) {
    if (gloo != nullptr) return gloo->all_reduce_algorithm(bytes);
    return dist::gloo_all_reduce_algorithm(bytes, size, settings, forced);
  };
  std::vector<dist::LinkSample> samples;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const int iters = static_cast<int>(std::clamp<int64_t>(kBytesPerRound / bytes, 1, kMaxIters));
    Tensor t = full({bytes / 4}, 1.0, kFloat32);
    pg->all_reduce(t)->wait();  // warm-up: scratch pages, TCP windows
    std::vector<double> per_call;
    for (int r = 0; r < rounds; ++r) {
      pg->barrier()->wait();
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) pg->all_reduce(t)->wait();
      per_call.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
    }
    if (rank != 0) continue;
    const double s = median(per_call);
    samples.push_back({bytes, s, algorithm_of(bytes)});
    const double ring_s = ring_factor * static_cast<double>(bytes) * 8 / (gbps * 1e9);
    std::printf("%10lld %12.1f %12.3f %12.1f %9.2f\n", static_cast<long long>(bytes), s * 1e6,
                bytes / s / 1e9, ring_s * 1e6, ring_s / s);
    std::fflush(stdout);
    if (out.is_open()) {
      out << (first ? "\n" : ",\n") << "  {\"bytes\": " << bytes << ", \"seconds\": " << s
          << ", \"ring_seconds\": " << ring_s << "}";
      first = false;
    }
  }
  const bool hier = pg->backend() == "hier";
  const int local = dist::local_world_size();
  const dist::LinkModel group_link = gloo != nullptr ? gloo->link() : settings;
  if (rank == 0 && size > 1 && !samples.empty()) {
    auto predict = [&](const dist::LinkSample& x, const dist::LinkModel& link) {
      if (hier && local > 1 && size % local == 0)
        return dist::predict_hier_all_reduce(x.bytes, size / local, local, kShmLink, link);
      return dist::predict_all_reduce(x.algorithm, x.bytes, size, link);
    };
    std::printf("cost model with the group's link: alpha %.1f us, %.3g Gbit/s%s\n",
                group_link.alpha * 1e6, 8 / group_link.beta / 1e9,
                hier ? (", hier: " + std::to_string(size / local) + " machines x " +
                        std::to_string(local) + " ranks, shm 5 us and 5 GB/s").c_str()
                     : "");
    std::printf("%10s %10s %12s %12s %9s\n", "bytes", "algorithm", "us/call", "model us",
                "measured/model");
    for (const dist::LinkSample& x : samples) {
      const double p = predict(x, group_link);
      std::printf("%10lld %10s %12.1f %12.1f %9.2f\n", static_cast<long long>(x.bytes),
                  hier ? "hier" : std::string(dist::algorithm_name(x.algorithm)).c_str(),
                  x.seconds * 1e6, p * 1e6, x.seconds / p);
    }
  }
  if (rank == 0 && size > 1 && samples.size() >= 2 && !hier) {
    const dist::LinkModel fit = dist::fit_link(size, samples);
    std::printf("cost model fitted to these rows: alpha %.1f us, beta %.3f ns/byte (%.3g Gbit/s)\n",
                fit.alpha * 1e6, fit.beta * 1e9, fit.beta > 0 ? 8 / fit.beta / 1e9 : 0.0);
    std::printf("%10s %10s %12s %12s %9s\n", "bytes", "algorithm", "us/call", "model us",
                "measured/model");
    for (const dist::LinkSample& x : samples) {
      const double p = dist::predict_all_reduce(x.algorithm, x.bytes, size, fit);
      std::printf("%10lld %10s %12.1f %12.1f %9.2f\n", static_cast<long long>(x.bytes),
                  std::string(dist::algorithm_name(x.algorithm)).c_str(), x.seconds * 1e6, p * 1e6,
                  x.seconds / p);
    }
    if (out.is_open()) {
      out << "\n], \"alpha\": " << fit.alpha << ", \"beta\": " << fit.beta << "}\n";
    }
  } else if (out.is_open()) {
    out << "\n]}\n";
  }
  pg->barrier()->wait();
  dist::destroy_process_group();
  return 0;
}
