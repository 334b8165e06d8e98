// Data-parallel training throughput: the Fashion-MNIST MLP and CNN, one process against DDP with
// 2 processes (over the gloo and the shm backend) and DataParallel with 2 replicas, all with the
// same threads per worker, in one run.
//
//   ddp [--models mlp,cnn] [--batch 64] [--steps 40] [--warmup 5] [--rounds 5]
//       [--json bench/results/ddp.json]
//
// Every configuration runs as a fresh job of its own processes (the program re-runs its own
// binary with torchrun's variables), so none inherits another's warm state. Rounds cycle through
// the configurations, rotating which goes first, and the table reports medians over rounds. The
// headline, scaling efficiency, is DDP's 2-process samples/s over twice the 1-process samples/s
// of the same round (both with 1 thread per process), then its median over rounds.
//
// Batches are collated before the clock starts (each rank from its own DistributedSampler
// shard), so the figures are compute and communication, not data loading (bench/train_bench
// measures the loader). Exposed communication is DDPStats' time spent waiting for all-reduces
// after backward ended, per step; "all-reduce alone" is one all_reduce of all gradient bytes,
// timed after training, for what communication would cost with no overlap.
#include <unistd.h>

#include <algorithm>
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
#include "lockstep/distributed/data_parallel.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/zero.h"
#include "lockstep/lockstep.h"

using namespace lockstep;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kRoleEnv = "LOCKSTEP_BENCH_DDP";
// Distinct batches collated up front and cycled through.
constexpr int64_t kBatchesInMemory = 16;

enum class Mode { kSingle, kDDP, kDP };

struct Config {
  std::string name;
  Mode mode;
  int procs;              // processes
  int threads;            // per process (OMP_NUM_THREADS); DataParallel runs one replica per thread
  int64_t batch_factor;   // global batch = batch x this
  std::string hook = "";  // DDP communication hook: "" (all_reduce) or "bf16"
  std::string backend = "gloo";  // LOCKSTEP_BACKEND for the job
  bool zero = false;  // DDP's optimizer sharded (ZeRO-1): each rank steps half the model
};

// The configurations of one model, in table order (kShmDDP: the gloo DDP row's twin over shm;
// kShmZero: that row with ZeRO-1).
constexpr size_t kShmDDP = 5;
constexpr size_t kShmZero = 6;
const std::vector<Config>& configs() {
  static const std::vector<Config> c = {
      {"1 process, 1 thread", Mode::kSingle, 1, 1, 1},
      {"DDP, 2 processes x 1 thread", Mode::kDDP, 2, 1, 2},
      {"DDP, 2 processes x 1 thread, bf16 hook", Mode::kDDP, 2, 1, 2, "bf16"},
      {"DataParallel, 2 replicas x 1 thread", Mode::kDP, 1, 1, 2},
      {"1 process, 2 threads", Mode::kSingle, 1, 2, 2},
      {"DDP over shm, 2 processes x 1 thread", Mode::kDDP, 2, 1, 2, "", "shm"},
      {"DDP shm + ZeRO-1, 2 processes x 1 thread", Mode::kDDP, 2, 1, 2, "", "shm", true},
  };
  return c;
}

struct Result {
  double samples_per_s = 0;
  double step_ms = 0;
  double fwd_ms = 0, bwd_ms = 0, opt_ms = 0;  // medians over steps; backward includes exposed
  double exposed_ms = 0;                      // DDP only
  double allreduce_ms = 0;                    // DDP only: all gradient bytes in one all_reduce
  int64_t grad_bytes = 0;
  int64_t buckets = 0;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- one worker ----

struct Role {
  int config = 0;
  std::string model;
  int64_t batch = 0, warmup = 0, steps = 0;
  std::string out;
};

int run_worker(const Role& role) {
  const Config& cfg = configs().at(static_cast<size_t>(role.config));
  set_num_threads(cfg.threads);
  auto pg = dist::init_process_group();
  const int rank = pg->rank(), world = pg->size();

  data::MnistOptions mopts;
  mopts.normalize = true;
  auto train = data::load_mnist(data::kDefaultFashionMnistDir, data::Split::kTrain, mopts);
  const int64_t local_batch = cfg.mode == Mode::kDP ? role.batch * 2 : role.batch;
  data::DataLoader loader(train,
                          std::make_shared<data::DistributedSampler>(train->size(), world, rank),
                          {.batch_size = local_batch});
  std::vector<data::Batch> batches;
  while (static_cast<int64_t>(batches.size()) < kBatchesInMemory) batches.push_back(*loader.next());

  Generator gen(0);
  auto model = examples::build_fashion_mnist_model(role.model, gen);
  std::unique_ptr<dist::DataParallel> dp;
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  if (cfg.mode == Mode::kDP) {
    dp = std::make_unique<dist::DataParallel>(
        [&] {
          Generator g(0);
          return examples::build_fashion_mnist_model(role.model, g);
        },
        2);
    model = dp->module();
  } else if (cfg.mode == Mode::kDDP) {
    dist::DDPOptions opts;
    if (cfg.hook == "bf16") opts.comm_hook = dist::bf16_compress_hook();
    ddp = std::make_shared<dist::DistributedDataParallel>(model, pg, opts);
  }
  nn::Module& net = ddp ? static_cast<nn::Module&>(*ddp) : *model;
  const optim::SGDOptions sgd{.lr = 0.05, .momentum = 0.9};
  std::unique_ptr<optim::Optimizer> optimizer;
  if (cfg.zero) {
    optimizer = std::make_unique<dist::ZeroRedundancyOptimizer>(
        model->parameters(), pg, [sgd](std::vector<optim::ParamGroup> groups) {
          return std::make_unique<optim::SGD>(std::move(groups), sgd);
        });
  } else {
    optimizer = std::make_unique<optim::SGD>(model->parameters(), sgd);
  }
  optim::Optimizer& opt = *optimizer;
  // Per-step phase times (ms); DataParallel's forward and backward are one call, counted as
  // backward.
  std::vector<double> fwd_ms, bwd_ms, opt_ms;
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  auto step = [&](int64_t i) {
    const data::Batch& b = batches[static_cast<size_t>(i % kBatchesInMemory)];
    opt.zero_grad();
    auto t = Clock::now();
    if (dp) {
      fwd_ms.push_back(0);
      dp->forward_backward(b.input, b.target, [](const Tensor& out, const Tensor& t) {
        return cross_entropy(out, t);
      });
    } else {
      Tensor loss = cross_entropy(net.forward(b.input), b.target);
      fwd_ms.push_back(ms_since(t));
      t = Clock::now();
      loss.backward();
    }
    bwd_ms.push_back(ms_since(t));
    t = Clock::now();
    opt.step();
    opt_ms.push_back(ms_since(t));
  };

  for (int64_t i = 0; i < role.warmup; ++i) step(i);
  fwd_ms.clear();
  bwd_ms.clear();
  opt_ms.clear();
  const double exposed0 = ddp ? ddp->stats().exposed_comm_seconds_total : 0;
  pg->barrier()->wait();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < role.steps; ++i) step(role.warmup + i);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();

  Result r;
  r.samples_per_s = static_cast<double>(role.steps * role.batch * cfg.batch_factor) / secs;
  r.step_ms = secs / static_cast<double>(role.steps) * 1e3;
  r.fwd_ms = median(fwd_ms);
  r.bwd_ms = median(bwd_ms);
  r.opt_ms = median(opt_ms);
  if (ddp) {
    const dist::DDPStats st = ddp->stats();
    r.exposed_ms = (st.exposed_comm_seconds_total - exposed0) / role.steps * 1e3;
    r.grad_bytes = st.bytes_reduced_last_step;
    r.buckets = static_cast<int64_t>(st.bucket_bytes.size());
    // What the gradients' communication costs with nothing to hide it behind (in bf16 when the
    // hook sends bf16).
    Tensor flat = zeros({r.grad_bytes / 4}, cfg.hook == "bf16" ? kBFloat16 : kFloat32);
    std::vector<double> t;
    for (int i = 0; i < 7; ++i) {
      pg->barrier()->wait();
      const auto a = Clock::now();
      pg->all_reduce(flat)->wait();
      t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
    }
    r.allreduce_ms = median(t) * 1e3;
  }
  if (rank == 0) {
    std::ofstream out(role.out);
    out << r.samples_per_s << " " << r.step_ms << " " << r.fwd_ms << " " << r.bwd_ms << " "
        << r.opt_ms << " " << r.exposed_ms << " " << r.allreduce_ms << " " << r.grad_bytes << " "
        << r.buckets << "\n";
  }
  pg->barrier()->wait();
  dist::destroy_process_group();
  return 0;
}

// ---- the driver ----

Result run_config(int config, const std::string& model, int64_t batch, int64_t warmup,
                  int64_t steps) {
  const Config& cfg = configs()[static_cast<size_t>(config)];
  const auto out = std::filesystem::temp_directory_path() /
                   ("lockstep_bench_ddp_" + std::to_string(::getpid()) + ".txt");
  std::ostringstream role;
  role << config << ":" << model << ":" << batch << ":" << warmup << ":" << steps << ":"
       << out.string();
  if (!bench::run_ranks(cfg.procs, {"OMP_NUM_THREADS=" + std::to_string(cfg.threads),
                                    "LOCKSTEP_BACKEND=" + cfg.backend,
                                    std::string(kRoleEnv) + "=" + role.str()})) {
    std::fprintf(stderr, "ddp: the job '%s' (%s) failed\n", cfg.name.c_str(), model.c_str());
    std::exit(1);
  }
  Result r;
  std::ifstream in(out);
  if (!(in >> r.samples_per_s >> r.step_ms >> r.fwd_ms >> r.bwd_ms >> r.opt_ms >> r.exposed_ms >>
        r.allreduce_ms >> r.grad_bytes >> r.buckets)) {
    std::fprintf(stderr, "ddp: the job '%s' (%s) wrote no result to %s\n", cfg.name.c_str(),
                 model.c_str(), out.c_str());
    std::exit(1);
  }
  std::filesystem::remove(out);
  return r;
}

bool parse_role(const char* s, Role& role) {
  std::stringstream ss(s);
  std::string field;
  std::vector<std::string> f;
  while (std::getline(ss, field, ':')) f.push_back(field);
  if (f.size() != 6) return false;
  role.config = std::stoi(f[0]);
  role.model = f[1];
  role.batch = std::stoll(f[2]);
  role.warmup = std::stoll(f[3]);
  role.steps = std::stoll(f[4]);
  role.out = f[5];
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* env = std::getenv(kRoleEnv)) {
    Role role;
    try {
      if (!parse_role(env, role)) {
        std::fprintf(stderr, "ddp: malformed %s='%s'\n", kRoleEnv, env);
        return 2;
      }
      return run_worker(role);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK"), e.what());
      return 1;
    }
  }

  std::vector<std::string> models = {"mlp", "cnn"};
  int64_t batch = 64, steps = 40, warmup = 5;
  int rounds = 5;
  std::string json = "bench/results/ddp.json";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ddp: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (a == "--models") {
        models.clear();
        std::stringstream ss(next());
        for (std::string m; std::getline(ss, m, ',');) {
          if (m != "mlp" && m != "cnn") throw std::invalid_argument("model '" + m + "'");
          models.push_back(m);
        }
      } else if (a == "--batch") {
        batch = std::stoll(next());
      } else if (a == "--steps") {
        steps = std::stoll(next());
      } else if (a == "--warmup") {
        warmup = std::stoll(next());
      } else if (a == "--rounds") {
        rounds = std::stoi(next());
      } else if (a == "--json") {
        json = next();
      } else {
        throw std::invalid_argument("argument '" + a + "'");
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "usage: ddp [--models mlp,cnn] [--batch B] [--steps N] [--warmup N] "
                   "[--rounds R] [--json PATH]\nunknown or bad %s\n",
                   e.what());
      return 2;
    }
  }
  if (batch < 2 || steps < 1 || warmup < 0 || rounds < 1) {
    std::fprintf(stderr, "ddp: need --batch >= 2, --steps >= 1, --warmup >= 0, --rounds >= 1\n");
    return 2;
  }

  const size_t nc = configs().size();
  std::printf(
      "Fashion-MNIST training, batch %lld per process, SGD momentum, %ld cores; %lld timed steps "
      "after %lld warm-up, median of %d rounds\n",
      static_cast<long long>(batch), sysconf(_SC_NPROCESSORS_ONLN), static_cast<long long>(steps),
      static_cast<long long>(warmup), rounds);
  std::ostringstream js;
  js << "{\"benchmark\": \"ddp\", \"batch_per_process\": " << batch << ", \"steps\": " << steps
     << ", \"rounds\": " << rounds << ", \"models\": [\n";
  for (size_t mi = 0; mi < models.size(); ++mi) {
    const std::string& model = models[mi];
    std::vector<std::vector<Result>> res(nc);
    std::vector<double> efficiency, dp_ratio, shm_efficiency, shm_over_gloo, shm_dp, zero_dp,
        zero_efficiency;
    for (int r = 0; r < rounds; ++r) {
      std::vector<Result> round(nc);
      for (size_t k = 0; k < nc; ++k) {
        const size_t c = (k + static_cast<size_t>(r)) % nc;  // rotate who goes first
        round[c] = run_config(static_cast<int>(c), model, batch, warmup, steps);
      }
      for (size_t c = 0; c < nc; ++c) res[c].push_back(round[c]);
      efficiency.push_back(round[1].samples_per_s / (2 * round[0].samples_per_s));
      dp_ratio.push_back(round[1].samples_per_s / round[3].samples_per_s);
      shm_efficiency.push_back(round[kShmDDP].samples_per_s / (2 * round[0].samples_per_s));
      shm_over_gloo.push_back(round[kShmDDP].samples_per_s / round[1].samples_per_s);
      shm_dp.push_back(round[kShmDDP].samples_per_s / round[3].samples_per_s);
      zero_efficiency.push_back(round[kShmZero].samples_per_s / (2 * round[0].samples_per_s));
      zero_dp.push_back(round[kShmZero].samples_per_s / round[3].samples_per_s);
    }
    std::printf("\n%s\n%-40s %6s %10s %8s %7s %7s %7s %8s %9s\n", model.c_str(), "configuration",
                "global", "samples/s", "step ms", "fwd", "bwd", "opt", "exposed", "vs 1 proc");
    js << "  {\"model\": \"" << model << "\", \"configs\": [\n";
    const double base = [&] {
      std::vector<double> v;
      for (auto& x : res[0]) v.push_back(x.samples_per_s);
      return median(v);
    }();
    for (size_t c = 0; c < nc; ++c) {
      std::vector<double> sps, ms, fwd, bwd, opt, exp, ar;
      for (auto& x : res[c]) {
        sps.push_back(x.samples_per_s);
        ms.push_back(x.step_ms);
        fwd.push_back(x.fwd_ms);
        bwd.push_back(x.bwd_ms);
        opt.push_back(x.opt_ms);
        exp.push_back(x.exposed_ms);
        ar.push_back(x.allreduce_ms);
      }
      const Config& cfg = configs()[c];
      const bool is_ddp = cfg.mode == Mode::kDDP;
      char exposed[32] = "-";
      if (is_ddp) std::snprintf(exposed, sizeof(exposed), "%.2f", median(exp));
      std::printf("%-40s %6lld %10.0f %8.2f %7.2f %7.2f %7.2f %8s %8.2fx\n", cfg.name.c_str(),
                  static_cast<long long>(batch * cfg.batch_factor), median(sps), median(ms),
                  median(fwd), median(bwd), median(opt), exposed, median(sps) / base);
      js << "    {\"name\": \"" << cfg.name << "\", \"global_batch\": " << batch * cfg.batch_factor
         << ", \"samples_per_s\": " << median(sps) << ", \"step_ms\": " << median(ms)
         << ", \"forward_ms\": " << median(fwd) << ", \"backward_ms\": " << median(bwd)
         << ", \"optimizer_ms\": " << median(opt);
      if (is_ddp) {
        js << ", \"exposed_comm_ms\": " << median(exp) << ", \"allreduce_alone_ms\": " << median(ar)
           << ", \"grad_bytes\": " << res[c][0].grad_bytes
           << ", \"buckets\": " << res[c][0].buckets;
      }
      js << "}" << (c + 1 < nc ? "," : "") << "\n";
      if (is_ddp) {
        std::printf(
            "    %lld buckets, %.2f MB of f32 gradients per step; one all_reduce of them "
            "alone (%s) %.2f ms\n",
            static_cast<long long>(res[c][0].buckets), res[c][0].grad_bytes / 1e6,
            cfg.hook == "bf16" ? "bf16" : "f32", median(ar));
      }
    }
    std::printf(
        "scaling efficiency (DDP 2 procs / (2 x 1 proc)): %.2f; DDP / DataParallel: %.2fx\n",
        median(efficiency), median(dp_ratio));
    std::printf(
        "over shm: scaling efficiency %.2f; DDP shm / DDP gloo: %.2fx; DDP shm / DataParallel: "
        "%.2fx\n",
        median(shm_efficiency), median(shm_over_gloo), median(shm_dp));
    std::printf("over shm with ZeRO-1: scaling efficiency %.2f; / DataParallel: %.2fx\n",
                median(zero_efficiency), median(zero_dp));
    js << "  ], \"scaling_efficiency\": " << median(efficiency)
       << ", \"shm_scaling_efficiency\": " << median(shm_efficiency)
       << ", \"shm_over_gloo\": " << median(shm_over_gloo)
       << ", \"shm_over_dataparallel\": " << median(shm_dp)
       << ", \"zero1_scaling_efficiency\": " << median(zero_efficiency)
       << ", \"zero1_over_dataparallel\": " << median(zero_dp)
       << ", \"ddp_over_dataparallel\": " << median(dp_ratio) << "}"
       << (mi + 1 < models.size() ? "," : "") << "\n";
    std::fflush(stdout);
  }
  js << "]}\n";
  if (!json.empty()) {
    const auto parent = std::filesystem::path(json).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    std::ofstream(json) << js.str();
  }
  return 0;
}
