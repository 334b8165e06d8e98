// Mixed precision on the CPU: bf16 GEMM against f32 GEMM at the MLP's shapes, and training-step
// throughput and peak resident memory with --amp none / bf16 / fp16 for both Fashion-MNIST
// models, in one run.
//
//   amp [--steps 60] [--rounds 5] [--threads 2] [--json bench/results/amp.json]
//
// Each training configuration runs in a fresh process (peak RSS is per process), rounds rotate
// the order, and the table shows medians over rounds. Whether OpenBLAS exports cblas_sbgemm is
// reported: lockstep uses it only through the convert-and-call-sgemm path otherwise.
#include <dlfcn.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_ranks.h"
#include "fashion_mnist_models.h"
#include "lockstep/data/data.h"
#include "lockstep/lockstep.h"

using namespace lockstep;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kRoleEnv = "LOCKSTEP_BENCH_AMP";
constexpr int64_t kBatch = 64;
constexpr int64_t kBatchesInMemory = 16;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

DType amp_dtype(const std::string& amp) { return amp == "fp16" ? kFloat16 : kBFloat16; }

// ---- one training configuration, in its own process ----

int run_worker(const std::string& model_kind, const std::string& amp, int64_t steps,
               const std::string& out_path) {
  data::MnistOptions mopts;
  mopts.normalize = true;
  auto train = data::load_mnist(data::kDefaultFashionMnistDir, data::Split::kTrain, mopts);
  data::DataLoader loader(train, std::make_shared<data::DistributedSampler>(train->size(), 1, 0),
                          {.batch_size = kBatch});
  std::vector<data::Batch> batches;
  while (static_cast<int64_t>(batches.size()) < kBatchesInMemory) batches.push_back(*loader.next());
  Generator gen(0);
  auto model = examples::build_fashion_mnist_model(model_kind, gen);
  optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  amp::GradScaler scaler({.enabled = amp == "fp16"});
  auto step = [&](int64_t i) {
    const data::Batch& b = batches[static_cast<size_t>(i % kBatchesInMemory)];
    opt.zero_grad();
    Tensor loss;
    {
      amp::autocast ac(amp_dtype(amp), amp != "none");
      loss = cross_entropy(model->forward(b.input), b.target);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
  };
  for (int64_t i = 0; i < 5; ++i) step(i);
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < steps; ++i) step(5 + i);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  std::ofstream(out_path) << static_cast<double>(steps * kBatch) / secs << " "
                          << secs / static_cast<double>(steps) * 1e3 << " " << ru.ru_maxrss / 1024.0
                          << "\n";
  return 0;
}

// ---- GEMM ----

// Median seconds of matmul(a, b) over `reps` calls.
double time_matmul(const Tensor& a, const Tensor& b, int reps) {
  std::vector<double> t;
  for (int i = 0; i < reps + 3; ++i) {
    const auto t0 = Clock::now();
    Tensor c = matmul(a, b);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i >= 3) t.push_back(s);  // warm-up
  }
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* role = std::getenv(kRoleEnv)) {
    std::stringstream ss(role);
    std::string model, amp, steps, out;
    std::getline(ss, model, ':');
    std::getline(ss, amp, ':');
    std::getline(ss, steps, ':');
    std::getline(ss, out);
    try {
      return run_worker(model, amp, std::stoll(steps), out);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "amp worker: %s\n", e.what());
      return 1;
    }
  }
  int64_t steps = 60;
  int rounds = 5, threads = 2;
  std::string json = "bench/results/amp.json";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "usage: amp [--steps N] [--rounds R] [--threads T] [--json PATH]\n");
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--steps") {
      steps = std::stoll(v);
    } else if (a == "--rounds") {
      rounds = std::stoi(v);
    } else if (a == "--threads") {
      threads = std::stoi(v);
    } else if (a == "--json") {
      json = v;
    } else {
      std::fprintf(stderr, "amp: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  set_num_threads(threads);
  const bool sbgemm = ::dlsym(RTLD_DEFAULT, "cblas_sbgemm") != nullptr;
  std::printf("mixed precision, %d threads, %ld cores; OpenBLAS %s cblas_sbgemm\n", threads,
              ::sysconf(_SC_NPROCESSORS_ONLN), sbgemm ? "exports" : "does not export");
  std::ostringstream js;
  js << "{\"benchmark\": \"amp\", \"threads\": " << threads
     << ", \"cblas_sbgemm\": " << (sbgemm ? "true" : "false") << ", \"gemm\": [\n";

  // The MLP's forward products: (64 x 784) @ (784 x 1024) and (64 x 1024) @ (1024 x 1024).
  std::printf("\n%-28s %10s %10s %10s %10s %8s\n", "GEMM", "f32 us", "bf16 us", "f16 us",
              "f32 GF/s", "bf16/f32");
  const std::vector<std::array<int64_t, 3>> shapes = {{64, 784, 1024}, {64, 1024, 1024}};
  for (size_t si = 0; si < shapes.size(); ++si) {
    const auto [m, k, n] = shapes[si];
    Generator gen(1);
    const Tensor a = randn({m, k}, gen), b = randn({k, n}, gen);
    const Tensor ab = a.to(kBFloat16), bb = b.to(kBFloat16), ah = a.to(kFloat16),
                 bh = b.to(kFloat16);
    std::vector<double> f32, bf16, f16;
    for (int r = 0; r < rounds; ++r) {
      f32.push_back(time_matmul(a, b, 20));
      bf16.push_back(time_matmul(ab, bb, 20));
      f16.push_back(time_matmul(ah, bh, 20));
    }
    const double tf = median(f32), tb = median(bf16), th = median(f16);
    const double gflops = 2.0 * m * k * n / tf / 1e9;
    char name[64];
    std::snprintf(name, sizeof name, "[%lld,%lld]x[%lld,%lld]", static_cast<long long>(m),
                  static_cast<long long>(k), static_cast<long long>(k), static_cast<long long>(n));
    std::printf("%-28s %10.1f %10.1f %10.1f %10.1f %7.2fx\n", name, tf * 1e6, tb * 1e6, th * 1e6,
                gflops, tf / tb);
    js << "  {\"shape\": \"" << name << "\", \"f32_us\": " << tf * 1e6
       << ", \"bf16_us\": " << tb * 1e6 << ", \"f16_us\": " << th * 1e6 << "}"
       << (si + 1 < shapes.size() ? "," : "") << "\n";
  }
  js << "], \"training\": [\n";

  // Training steps, each configuration a fresh process.
  const std::vector<std::string> models = {"mlp", "cnn"}, amps = {"none", "bf16", "fp16"};
  const auto out = std::filesystem::temp_directory_path() /
                   ("lockstep_bench_amp_" + std::to_string(::getpid()) + ".txt");
  std::printf("\n%-6s %-6s %12s %10s %12s %12s\n", "model", "amp", "samples/s", "step ms",
              "peak RSS MB", "vs none");
  bool first_row = true;
  for (const auto& model : models) {
    std::vector<std::vector<double>> sps(amps.size()), ms(amps.size()), rss(amps.size());
    for (int r = 0; r < rounds; ++r) {
      for (size_t k = 0; k < amps.size(); ++k) {
        const size_t c = (k + static_cast<size_t>(r)) % amps.size();
        const std::string role =
            model + ":" + amps[c] + ":" + std::to_string(steps) + ":" + out.string();
        if (!bench::run_ranks(1, {"OMP_NUM_THREADS=" + std::to_string(threads),
                                  std::string(kRoleEnv) + "=" + role})) {
          std::fprintf(stderr, "amp: the %s --amp %s run failed\n", model.c_str(), amps[c].c_str());
          return 1;
        }
        double s = 0, m = 0, x = 0;
        std::ifstream in(out);
        in >> s >> m >> x;
        sps[c].push_back(s);
        ms[c].push_back(m);
        rss[c].push_back(x);
      }
    }
    for (size_t c = 0; c < amps.size(); ++c) {
      std::printf("%-6s %-6s %12.0f %10.2f %12.1f %11.2fx\n", model.c_str(), amps[c].c_str(),
                  median(sps[c]), median(ms[c]), median(rss[c]), median(sps[c]) / median(sps[0]));
      js << (first_row ? "" : ",\n") << "  {\"model\": \"" << model << "\", \"amp\": \"" << amps[c]
         << "\", \"samples_per_s\": " << median(sps[c]) << ", \"step_ms\": " << median(ms[c])
         << ", \"peak_rss_mb\": " << median(rss[c]) << "}";
      first_row = false;
    }
  }
  std::filesystem::remove(out);
  js << "\n]}\n";
  if (!json.empty()) {
    const auto parent = std::filesystem::path(json).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    std::ofstream(json) << js.str();
  }
  return 0;
}
