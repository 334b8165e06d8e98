// The command line of examples/train_fashion_mnist: its settings, every flag with its range, and
// the checks that span several flags.
#pragma once

#include <CLI/CLI.hpp>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <type_traits>

#include "lockstep/data/data.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/preemption.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/cuda.h"

namespace lockstep::examples {

// Exit code for bad command-line input (as CLI11 and most tools use).
constexpr int kUsageError = 2;

struct Config {
  std::string data = data::kDefaultFashionMnistDir;
  std::string model = "mlp";
  int64_t epochs = 1;
  int64_t max_steps = 0;
  int64_t batch_size = 64;
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  uint64_t seed = 0;
  int64_t threads = 0;
  int64_t log_every = 100;
  bool eval = true;
  int64_t workers = 1;
  std::string save;        // checkpoint path (rank 0 writes)
  int64_t save_every = 0;  // optimizer steps between periodic checkpoints (0: only at the end)
  int64_t keep = 0;        // periodic checkpoints kept (0: all)
  std::string resume;      // a checkpoint file, or "auto": the latest beside --save
  std::string stop_signals = "TERM";  // Note [Preemption]: stop after the step, save, exit 128+N
  std::string metrics;                // JSON Lines of per-step metrics (rank 0)
  double bucket_mb = 25.0;
  bool bucket_auto = false;  // --bucket-mb auto: dist::bucket_bytes_from_group's cap
  std::string comm_hook = "none";
  int64_t powersgd_rank = 1;    // --comm-hook powersgd: the rank of each gradient's approximation
  int64_t powersgd_start = 10;  // --comm-hook powersgd: plain all-reduce steps before compressing
  std::string backend;  // empty: LOCKSTEP_BACKEND, else init_process_group's default (auto)
  double timeout = 0;   // collective timeout in seconds; 0: LOCKSTEP_TIMEOUT, else 30 minutes
  bool ddp_stats = false;
  int64_t dp = 1;
  int64_t check_sync_every = 0;     // DDPOptions::check_sync_every: 0 never
  std::string amp = "none";         // none | bf16 | fp16
  std::string device = "cpu";       // cpu | cuda (each rank on its local GPU)
  int64_t accum_steps = 1;          // micro-batches per optimizer step
  std::string lr_scaling = "none";  // linear | sqrt | none, relative to base_batch
  int64_t base_batch = 64;
  int64_t warmup_steps = 0;
  std::string schedule = "constant";  // constant | cosine
  double clip_grad_norm = 0.0;        // 0: no clipping
  int64_t test_crash_at_step = 0;     // testing only: Note [Testing hooks]
  int64_t test_slow_rank = -1;        // testing only: Note [Testing hooks]; -1: none
  std::string test_sample_log;        // testing only: Note [Sample log]
  bool uneven = false;                // no padding in the train sampler; dist::Join evens out
  bool sync_bn = false;               // BatchNorm layers as dist::SyncBatchNorm
  int64_t zero = 0;  // 1: the optimizer state sharded (ZeRO-1); 2, 3: FSDP (ZeRO-2, ZeRO-3)
};

// Note [Numeric flags]
// CLI11 converts "99999999999999999999" into an int64_t by clamping it to INT64_MAX, "-1" into
// a uint64_t by wrapping it, and its range checks print bounds of 309 digits. So each numeric
// flag reads its text itself: the whole text must be a number of the flag's type (base 10, no
// overflow, finite), inside the flag's range, or the run stops with "--epochs must be an integer
// from 1 to 1000000000, got 0". The upper bounds keep the products the program forms (steps per
// epoch x epochs, the effective batch, bucket bytes) inside int64_t.
template <typename T>
struct Range {
  T min;
  T max = std::numeric_limits<T>::max();
  bool min_excluded = false;  // reals only: "above min"

  std::string words() const {
    auto str = [](T v) {
      if constexpr (std::is_floating_point_v<T>) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.15g", v);
        return std::string(buf);
      } else {
        return std::to_string(v);
      }
    };
    const std::string kind = std::is_floating_point_v<T> ? "a number" : "an integer";
    const std::string from = min_excluded ? " above " + str(min) : " of at least " + str(min);
    if (max == std::numeric_limits<T>::max()) return kind + from;
    return kind + (min_excluded ? from + " and at most " : " from " + str(min) + " to ") + str(max);
  }
};

// `text` as a T inside `range`, or a ValidationError that names `flag` and the range in words.
template <typename T>
T parse_flag_number(const std::string& flag, const std::string& text, const Range<T>& range) {
  const auto bad = [&] {
    return CLI::ValidationError(flag + " must be " + range.words() + ", got '" + text + "'");
  };
  T v{};
  if constexpr (std::is_floating_point_v<T>) {
    char* end = nullptr;
    errno = 0;
    v = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(v))
      throw bad();
  } else {
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size()) throw bad();
  }
  if (v < range.min || v > range.max || (range.min_excluded && v == range.min)) throw bad();
  return v;
}

// A numeric flag, read as Note [Numeric flags] says; --help shows its range and default.
template <typename T>
CLI::Option* add_number(CLI::App& app, const std::string& flag, T& into, const Range<T>& range,
                        const std::string& help) {
  const std::string default_text = CLI::detail::to_string(into);
  CLI::Option* opt = app.add_option(
      flag,
      [flag, &into, range](const CLI::results_t& res) {
        into = parse_flag_number(flag, res.at(0), range);
        return true;
      },
      help + " (" + range.words() + ")");
  opt->type_name(std::is_floating_point_v<T> ? "FLOAT" : "INT")->default_str(default_text);
  return opt;
}

// Upper bounds of the counting flags (Note [Numeric flags]).
constexpr int64_t kMaxCount = 1'000'000'000;
constexpr int64_t kMaxThreads = 4096;
constexpr double kMaxBucketMb = 1 << 20;  // 1 TiB
constexpr int64_t kMaxPowerSGDRank = 1024;

// A number as the user would write it: the shortest text that reads back as the same double
// (for messages that quote a flag's value, e.g. the settings check's).
inline std::string number_text(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

// --stop-signals as the signals it names ("SIGTERM,SIGUSR1", "none"), so that "15" and "TERM"
// read the same.
inline std::string stop_signals_text(const std::string& flag) {
  std::string text;
  for (int sig : dist::parse_signals(flag))
    text += (text.empty() ? "" : ",") + dist::signal_name(sig);
  return text.empty() ? "none" : text;
}

inline int usage_error(const std::string& what) {
  std::fprintf(stderr, "error: %s\n", what.c_str());
  return kUsageError;
}

// Reads the command line into `cfg`. Returns -1 when the program should run, else the exit code
// --device and --backend together, for both examples: -1 when they make sense, else the usage
// error printed (nccl without cuda; cuda where no GPU is visible or the build has no CUDA).
inline int check_device_flags(const std::string& device, const std::string& backend) {
  if (backend == "nccl" && device != "cuda") {
    return usage_error(
        "--backend nccl reduces CUDA tensors only: add --device cuda (on CPUs "
        "use gloo, shm or hier)");
  }
  bool available = false;
  try {
    available = cuda::is_available();
  } catch (const Error& e) {  // a malformed LOCKSTEP_TEST_EMULATE_GPUS
    return usage_error(e.message());
  }
  if (device == "cuda" && !available) {
    return usage_error(cuda::compiled_with_cuda()
                           ? "--device cuda: no GPU is visible to this process"
                           : "--device cuda: this build of lockstep has no CUDA support "
                             "(build it where the CUDA toolkit is installed)");
  }
  return -1;
}

// (0 after --help; kUsageError with the reason printed).
inline int parse_flags(int argc, char** argv, Config& cfg) {
  using I = Range<int64_t>;
  using R = Range<double>;
  CLI::App app{"Train an MLP or a CNN on Fashion-MNIST with lockstep."};
  app.add_option("--data", cfg.data, "Directory with the Fashion-MNIST IDX files")
      ->capture_default_str();
  app.add_option("--model", cfg.model,
                 "Model: mlp, cnn, or cnn-bn (the CNN with BatchNorm after each convolution and "
                 "the hidden linear layer)")
      ->check(CLI::IsMember({"mlp", "cnn", "cnn-bn"}))
      ->capture_default_str();
  add_number(app, "--epochs", cfg.epochs, I{1, kMaxCount}, "Epochs");
  add_number(app, "--max-steps", cfg.max_steps, I{0},
             "Stop after N optimizer steps of the run, those before a resumed checkpoint "
             "included (0 = no limit)");
  add_number(app, "--batch-size", cfg.batch_size, I{1, kMaxCount}, "Batch size per process");
  add_number(app, "--lr", cfg.lr, R{0}, "Learning rate");
  add_number(app, "--momentum", cfg.momentum, R{0}, "SGD momentum");
  add_number(app, "--weight-decay", cfg.weight_decay, R{0}, "SGD weight decay");
  add_number(app, "--seed", cfg.seed, Range<uint64_t>{0}, "Seed for initialisation and shuffling");
  add_number(app, "--threads", cfg.threads, I{0, kMaxThreads},
             "Intra-op threads (0 = OMP_NUM_THREADS or all cores)");
  add_number(app, "--log-every", cfg.log_every, I{0}, "Print the loss every N steps (0 = never)");
  app.add_flag("--eval,!--no-eval", cfg.eval, "Evaluate on the test set after each epoch")
      ->capture_default_str();
  add_number(app, "--workers", cfg.workers, I{0, kMaxThreads}, "DataLoader worker threads");
  app.add_option("--save", cfg.save,
                 "Checkpoint file (safetensors: model, optimizer, scaler, position), written by "
                 "rank 0 at the end and, with --save-every, beside it as <name>.step<N>.<ext>; "
                 "its directory is created and checked for writing before training starts");
  add_number(app, "--save-every", cfg.save_every, I{0},
             "Checkpoint every N optimizer steps (0 = at the end only)");
  add_number(app, "--keep", cfg.keep, I{0}, "Keep the newest N periodic checkpoints (0 = all)");
  app.add_option("--resume", cfg.resume,
                 "Continue from a checkpoint file, or 'auto': the newest beside --save that "
                 "verifies, if any");
  app.add_option("--stop-signals", cfg.stop_signals,
                 "On these signals (comma-separated names or numbers; 'none' for none) every "
                 "rank finishes its step, the job saves a checkpoint beside --save that "
                 "--resume auto finds, and exits with 128 + the signal (143 for TERM): a "
                 "cluster's preemption or requeue loses no work. Not with --uneven")
      ->capture_default_str();
  app.add_option("--metrics", cfg.metrics,
                 "Append per-step metrics as JSON Lines here (rank 0; `lockstep plot` draws them)");
  add_number(app, "--test-crash-at-step", cfg.test_crash_at_step, I{0},
             "Testing only (the crash-recovery tests): the last rank kills itself (SIGKILL) "
             "after this optimizer step and its checkpoint, on the first attempt of a "
             "`lockstep run` only");
  add_number(app, "--test-slow-rank", cfg.test_slow_rank, I{0, kMaxCount},
             "Testing only (the slow-rank test): this rank's forward sleeps 100 ms in every "
             "training step, so that DDP names it the slowest");
  app.add_option("--test-sample-log", cfg.test_sample_log,
                 "Testing only (the rescale test): every rank appends to this file, after each "
                 "optimizer step, one line 'restart=R step=S epoch=E rank=K world_size=W "
                 "samples=I,J,...' (R is LOCKSTEP_RESTART_COUNT or 0; the dataset indices of the "
                 "step's micro-batches on that rank, in order), each line one O_APPEND write, so "
                 "all ranks and restarts share the file")
      ->type_name("PATH");
  // A number as add_number reads it, or "auto".
  const R bucket_range{0, kMaxBucketMb, true};
  app.add_option(
         "--bucket-mb",
         [&cfg, bucket_range](const CLI::results_t& res) {
           const std::string& v = res.at(0);
           cfg.bucket_auto = v == "auto";
           if (cfg.bucket_auto) return true;
           try {
             cfg.bucket_mb = parse_flag_number("--bucket-mb", v, bucket_range);
           } catch (const CLI::ValidationError&) {
             throw CLI::ValidationError("--bucket-mb must be auto or " + bucket_range.words() +
                                        ", got '" + v + "'");
           }
           return true;
         },
         "DDP gradient bucket size in MiB (" + bucket_range.words() +
             "), or auto: the size whose all-reduce latency stays under 5% on a gloo group's "
             "link (its cost model), from 1 to 25 MiB; 25 on other backends")
      ->type_name("FLOAT|auto")
      ->default_str(CLI::detail::to_string(cfg.bucket_mb));
  app.add_option("--comm-hook", cfg.comm_hook,
                 "DDP gradient compression on the wire: bf16 or fp16 halves the bytes; "
                 "powersgd sends a low-rank approximation of each weight's gradient, with error "
                 "feedback (dist::powersgd_hook)")
      ->check(CLI::IsMember({"none", "bf16", "fp16", "powersgd"}))
      ->capture_default_str();
  add_number(app, "--powersgd-rank", cfg.powersgd_rank, I{1, kMaxPowerSGDRank},
             "With --comm-hook powersgd: the rank of each gradient's approximation (higher: "
             "closer to the uncompressed gradient, more bytes)");
  add_number(app, "--powersgd-start", cfg.powersgd_start, I{0, kMaxCount},
             "With --comm-hook powersgd: optimizer steps reduced uncompressed before "
             "compression starts (the library's default, as PyTorch's, is 1000)");
  app.add_option("--backend", cfg.backend,
                 "DDP's process group backend (default: LOCKSTEP_BACKEND, else auto: shm on one "
                 "machine, gloo with one rank per machine, hier across machines of several)")
      ->check(CLI::IsMember(dist::backend_names()));
  add_number(app, "--timeout", cfg.timeout, R{0, dist::kMaxTimeoutS, true},
             "Seconds a collective waits for the other ranks before the run fails (default: "
             "LOCKSTEP_TIMEOUT, which `lockstep run --timeout` sets, else 1800)");
  add_number(app, "--check-sync-every", cfg.check_sync_every, I{0, kMaxCount},
             "Every N training forwards (steps, without --accum-steps), check that every rank "
             "still holds the same parameters and "
             "buffers (a hash of each, all-gathered; a difference stops the run naming the "
             "tensor and the ranks); 0: never");
  add_number(app, "--dp", cfg.dp, I{1, kMaxThreads},
             "DataParallel with K replicas on threads (one process)");
  app.add_flag("--ddp-stats", cfg.ddp_stats, "Print DDP's bucket and communication statistics");
  app.add_option("--device", cfg.device,
                 "Where the model trains: cpu, or cuda (each rank on its local GPU, "
                 "cuda:LOCAL_RANK; with --dp K, replicas on cuda:0..K-1)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--amp", cfg.amp, "Mixed precision: autocast to bf16, or fp16 with loss scaling")
      ->check(CLI::IsMember({"none", "bf16", "fp16"}))
      ->capture_default_str();
  add_number(app, "--accum-steps", cfg.accum_steps, I{1, kMaxCount},
             "Micro-batches per optimizer step (gradient accumulation)");
  app.add_option("--lr-scaling", cfg.lr_scaling,
                 "Scale --lr with the effective batch (batch x accum x world) / --base-batch")
      ->check(CLI::IsMember({"linear", "sqrt", "none"}))
      ->capture_default_str();
  add_number(app, "--base-batch", cfg.base_batch, I{1}, "The batch size --lr was tuned for");
  add_number(app, "--warmup-steps", cfg.warmup_steps, I{0},
             "Linear learning-rate warmup (optimizer steps)");
  app.add_option("--schedule", cfg.schedule, "Learning-rate schedule after warmup")
      ->check(CLI::IsMember({"constant", "cosine"}))
      ->capture_default_str();
  add_number(app, "--clip-grad-norm", cfg.clip_grad_norm, R{0}, "Clip the gradient norm (0 = off)");
  app.add_flag("--uneven", cfg.uneven,
               "DDP or FSDP on uneven inputs: the train sampler does not pad, so ranks may get "
               "different numbers of batches; a rank that runs out shadows the others' steps "
               "(dist::Join), each step's gradient is the mean over the ranks that had a batch. "
               "Not with --accum-steps above 1, --save-every, --resume, --dp or --sync-bn");
  app.add_flag("--sync-bn", cfg.sync_bn,
               "BatchNorm statistics over the whole batch of all ranks (dist::SyncBatchNorm), "
               "so N ranks of --batch-size B normalize as one process of N x B; needs a model "
               "with BatchNorm (--model cnn-bn). Not with --dp");
  add_number(app, "--zero", cfg.zero, I{0, 3},
             "ZeRO stage: 1 shards the optimizer state across the ranks "
             "(dist::ZeroRedundancyOptimizer; each rank keeps 1/world of it, the parameters are "
             "bitwise those of 0); 2: FSDP, the parameters, gradients and optimizer state "
             "sharded, a layer gathered whole from its forward to its backward; 3: FSDP that "
             "frees each layer's parameters after its forward; 0: every rank keeps all of it. "
             "Not with --dp");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kUsageError;
  }
  if (cfg.dp > 1 && cfg.amp != "none") {
    return usage_error(
        "--amp runs in the calling thread's autocast scope; DataParallel's replica "
        "threads have none, so --amp cannot be combined with --dp " +
        std::to_string(cfg.dp));
  }
  if (const int rc = check_device_flags(cfg.device, cfg.backend); rc >= 0) return rc;
  if (cfg.device == "cuda" && cfg.dp > cuda::device_count()) {
    return usage_error("--dp " + std::to_string(cfg.dp) + " with --device cuda needs " +
                       std::to_string(cfg.dp) + " GPUs, but " +
                       std::to_string(cuda::device_count()) + " are visible");
  }
  if (cfg.uneven) {
    // Note [Uneven inputs] in train_fashion_mnist.cpp: what a rank out of data cannot take part in.
    const char* other = cfg.accum_steps > 1   ? "--accum-steps above 1 (the ranks' last windows "
                                                "would end at different micro-batches)"
                        : cfg.save_every > 0  ? "--save-every (a checkpoint is a collective of "
                                                "all ranks, mid-epoch)"
                        : !cfg.resume.empty() ? "--resume (a position mid-epoch assumes equal "
                                                "shares)"
                        : cfg.dp > 1          ? "--dp (one process: no rank runs out)"
                        : cfg.sync_bn ? "--sync-bn (its all-gather needs every rank's batch)"
                                      : nullptr;
    if (other != nullptr)
      return usage_error(std::string("--uneven cannot be combined with ") + other);
  }
  try {
    dist::parse_signals(cfg.stop_signals);
  } catch (const std::exception& e) {
    return usage_error(std::string("--stop-signals: ") + e.what());
  }
  if (cfg.uneven && app.count("--stop-signals") > 0 &&
      stop_signals_text(cfg.stop_signals) != "none") {
    return usage_error(
        "--stop-signals cannot be combined with --uneven: the ranks agree to stop after the "
        "same step, and under --uneven they take different numbers of steps");
  }
  if (cfg.uneven) cfg.stop_signals = "none";
  if (cfg.sync_bn && cfg.model != "cnn-bn") {
    return usage_error("--sync-bn synchronizes BatchNorm layers, and --model " + cfg.model +
                       " has none: use --model cnn-bn");
  }
  if (cfg.zero > 0 && cfg.dp > 1) {
    return usage_error("--zero " + std::to_string(cfg.zero) + " shards across ranks; --dp " +
                       std::to_string(cfg.dp) + " runs replicas on threads of one process");
  }
  if (cfg.zero >= 2 && (cfg.comm_hook != "none" || cfg.check_sync_every > 0)) {
    return usage_error(std::string(cfg.comm_hook != "none" ? "--comm-hook" : "--check-sync-every") +
                       " belongs to DDP; --zero " + std::to_string(cfg.zero) +
                       " trains with FSDP, which reduce-scatters full-width gradients and keeps "
                       "no replica to compare");
  }
  if (cfg.comm_hook != "powersgd" &&
      (app.count("--powersgd-rank") > 0 || app.count("--powersgd-start") > 0)) {
    return usage_error(std::string(app.count("--powersgd-rank") > 0 ? "--powersgd-rank"
                                                                     : "--powersgd-start") +
                       " applies to --comm-hook powersgd, and --comm-hook is " + cfg.comm_hook);
  }
  if (cfg.sync_bn && cfg.dp > 1) {
    return usage_error("--sync-bn needs a process group of ranks; --dp " + std::to_string(cfg.dp) +
                       " runs replicas on threads of one process");
  }
  if ((cfg.save_every > 0 || cfg.resume == "auto") && cfg.save.empty()) {
    return usage_error(std::string(cfg.save_every > 0 ? "--save-every" : "--resume auto") +
                       " needs --save PATH (where the checkpoints go)");
  }
  if (!std::filesystem::is_directory(cfg.data)) {
    return usage_error(
        "--data " + cfg.data +
        " is not a directory; install the Debian package dataset-fashion-mnist or pass "
        "the directory holding the IDX files");
  }
  return -1;
}

}  // namespace lockstep::examples
