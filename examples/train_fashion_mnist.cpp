// Trains an MLP or a small CNN on Fashion-MNIST in one process: the program a user copies.
//
//   train_fashion_mnist --model cnn --epochs 1 --batch-size 64 --lr 0.05 --momentum 0.9
//
// Each epoch prints the mean training loss, throughput and test accuracy; the last line is
// machine-readable: "final test_accuracy=... train_loss=... steps=... samples_per_s=...", where
// test_accuracy is "none" when no evaluation ran (--no-eval). The flags and their ranges are in
// train_fashion_mnist_flags.h.
//
// It reads top to bottom: run() sets everything up once (the world, the data, the model with
// DataParallel, DDP or neither, the optimizer, its schedule, the loss scaler, a resumed position),
// then each epoch is train_epoch() (train_step after train_step, each followed by its metrics, a
// checkpoint when one is due and the log line), the mean loss, evaluate(), and one line.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "fashion_mnist_models.h"
#include "lockstep/base/env_var.h"
#include "lockstep/base/log.h"
#include "lockstep/base/syscall.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/data/data.h"
#include "lockstep/distributed/checkpoint.h"
#include "lockstep/distributed/fsdp.h"
#include "lockstep/distributed/sync_check.h"
#include "lockstep/distributed/zero.h"
#include "lockstep/io/checkpoint.h"
#include "lockstep/io/metrics.h"
#include "lockstep/io/progress.h"
#include "lockstep/lockstep.h"
#include "lockstep/nn/layers.h"
#include "lockstep/optim/optimizer.h"
#include "test_sample_log.h"
#include "train_fashion_mnist_flags.h"

using namespace lockstep;

namespace {

constexpr int64_t kEvalBatch = 1000;

using Clock = std::chrono::steady_clock;
using examples::Config;
using examples::first_attempt;
using examples::number_text;

// ---------------------------------------------------------------------------------------------
// Choices made once, before training

// The learning rate for an effective batch: the article's rule, more devices -> larger batch ->
// larger rate (linear, or sqrt for adaptive optimizers), relative to the batch `lr` was tuned at.
double scaled_lr(const Config& cfg, int64_t effective_batch) {
  const double ratio = static_cast<double>(effective_batch) / static_cast<double>(cfg.base_batch);
  if (cfg.lr_scaling == "linear") return cfg.lr * ratio;
  if (cfg.lr_scaling == "sqrt") return cfg.lr * std::sqrt(ratio);
  return cfg.lr;
}

// batch x accum x world: each factor is bounded (Note [Numeric flags]), their product is not.
int64_t effective_batch_of(const Config& cfg, int world) {
  int64_t per_rank = 0, all = 0;
  LS_CHECK(!__builtin_mul_overflow(cfg.batch_size, cfg.accum_steps, &per_rank) &&
               !__builtin_mul_overflow(per_rank, static_cast<int64_t>(world), &all),
           "the effective batch --batch-size ", cfg.batch_size, " x --accum-steps ",
           cfg.accum_steps, " x world size ", world, " does not fit in 64 bits");
  return all;
}

// Note [Accumulation window]
// An optimizer step averages the loss over the samples of its window: --accum-steps
// micro-batches, fewer in the last window of an epoch, whose last micro-batch may be short too.
// Each micro-batch's mean loss is weighted by its share of the window's samples, so a step is
// the step on the window's samples as one batch, whatever the window's length (a weight of 1/K
// would shrink a short window's gradient and loss by its length over K). Every rank has as many
// samples per epoch (the sampler pads), so its windows have the same lengths, and DDP's average
// over ranks makes a step the step on all ranks' window samples together.
struct Window {
  int64_t micro_batches = 0;
  int64_t samples = 0;  // this rank's
};

// The window that starts at micro-batch `first` of a pass over `samples` samples of this rank.
Window accumulation_window(int64_t first, int64_t accum_steps, int64_t batch_size,
                           int64_t samples) {
  const int64_t batches = (samples + batch_size - 1) / batch_size;
  const int64_t end = std::min(first + accum_steps, batches);
  return {.micro_batches = end - first,
          .samples = std::min(end * batch_size, samples) - first * batch_size};
}

// Note [Uneven inputs]
// --uneven: the train sampler does not pad, so the first size % world ranks hold one sample more
// than the others and may have one batch more. Each epoch's loop runs inside a dist::Join: a rank
// out of batches calls finish(), which shadows the DDP collectives of the ranks still training
// (each step's gradient is then the mean over the ranks that had a batch) and, when all are out,
// gives every rank the parameters, optimizer and scaler state of a rank of the last step; the
// step count and the schedule then continue from the longest rank's count. With --zero 1 a rank
// out of batches also takes each optimizer step with the others (Note [Join and ZeRO]), and
// keeps its own shard of the optimizer state. Whatever else communicates mid-epoch cannot be
// shadowed, so --uneven excludes it (flags.h): a periodic
// checkpoint, SyncBatchNorm's all-gather, accumulation windows that would end at different
// micro-batches on different ranks, a resumed position (which assumes equal shares).

// Micro-batches per epoch of the rank with the most samples: rank 0's, whether or not the
// sampler pads. The schedule counts these, the same on every rank.
int64_t longest_rank_batches(int64_t size, int world, int64_t batch_size) {
  const int64_t most = (size + world - 1) / world;
  return (most + batch_size - 1) / batch_size;
}

// Optimizer steps in the whole run: --epochs of them, or fewer with --max-steps.
int64_t total_steps_of(const Config& cfg, int64_t steps_per_epoch) {
  const int64_t all = steps_per_epoch * cfg.epochs;
  return cfg.max_steps > 0 ? std::min(all, cfg.max_steps) : all;
}

optim::Schedule schedule_of(const Config& cfg, int64_t total_steps) {
  if (cfg.schedule == "cosine") {
    LS_CHECK(total_steps > cfg.warmup_steps, "--warmup-steps ", cfg.warmup_steps,
             " leaves nothing of the ", total_steps, " optimizer steps for the cosine decay");
    return cfg.warmup_steps > 0 ? optim::warmup_cosine(cfg.warmup_steps, total_steps)
                                : optim::cosine_decay(total_steps);
  }
  if (cfg.warmup_steps > 0) return optim::linear_warmup(cfg.warmup_steps);
  return optim::constant_schedule();
}

dist::CommHook comm_hook_named(const std::string& name) {
  if (name == "bf16") return dist::bf16_compress_hook();
  if (name == "fp16") return dist::fp16_compress_hook();
  return dist::allreduce_hook();
}

// What a checkpoint of this program holds besides model and optimizer: the configuration a
// resumed run is compared with (a different one is a warning; another model is an error).
io::Metadata run_metadata(const Config& cfg) {
  return {{"model", cfg.model}, {"amp", cfg.amp}, {"seed", std::to_string(cfg.seed)}};
}

// Whether rank 0's stdout ends on a terminal, where a progress bar replaces the loss lines: as
// the launcher says when there is one, else as isatty says.
bool stdout_is_terminal() { return env_flag(env::kStdoutIsTty).value_or(::isatty(1) == 1); }

// The model as this process trains it: under --dp K, DataParallel's K replicas on threads; in a
// world of several processes, DDP around this process's copy; else the model alone. The choice
// is made here, once: the training step calls forward_backward and never asks which.
struct Model {
  std::shared_ptr<nn::Module> params;  // what the optimizer steps and a checkpoint holds
  std::unique_ptr<dist::DataParallel> dp;
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  // --zero 2/3: FullyShardedDataParallel in place of DDP; `params` then holds no memory outside
  // the forward and backward, so evaluation runs through `fsdp` and checkpoints read its full
  // state.
  std::shared_ptr<dist::FullyShardedDataParallel> fsdp;
  // What runs the test set: the FSDP wrapper (it gathers unit by unit) or the model.
  nn::Module& eval_module() const { return fsdp ? *fsdp : *params; }
  nn::NamedTensors state_dict() const {
    return fsdp ? fsdp->full_state_dict() : params->state_dict();
  }
  void load_state_dict(const nn::NamedTensors& state) const {
    if (fsdp) {
      fsdp->load_full_state_dict(state);
    } else {
      params->load_state_dict(state);
    }
  }
  double clip_grad_norm(double max_norm) const {
    return fsdp ? fsdp->clip_grad_norm(max_norm)
                : optim::clip_grad_norm(params->parameters(), max_norm);
  }
  // One micro-batch's forward and backward: the loss times `weight` is added into the gradients;
  // returns it. `sync` false: more micro-batches of this step follow, so DDP accumulates locally
  // (no_sync) instead of all-reducing.
  std::function<double(const data::Batch& batch, double weight, bool sync)> forward_backward;
};

// --timeout: unset (0) leaves the choice to LOCKSTEP_TIMEOUT (`lockstep run --timeout`), else the
// library's default.
std::optional<std::chrono::milliseconds> timeout_of(const Config& cfg) {
  if (cfg.timeout <= 0) return std::nullopt;
  return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(cfg.timeout * 1000)));
}

// The device this rank trains on: the CPU, or with --device cuda the GPU init_process_group made
// current (cuda:LOCAL_RANK under the launcher).
Device train_device(const Config& cfg) {
  return cfg.device == "cuda" ? cuda_device(cuda::current_device()) : kCPU;
}

// --test-slow-rank R (Note [Testing hooks]): DDP wraps the model in this on every rank (the
// parameter names must agree), and rank R's forward sleeps kTestSlowRankDelay first, inside the
// time DDP measures (Note [Slow rank] in src/distributed/slow_rank.h).
constexpr auto kTestSlowRankDelay = std::chrono::milliseconds(100);
class TestSlowForward : public nn::Module {
 public:
  TestSlowForward(std::shared_ptr<nn::Module> net, bool slow)
      : nn::Module("TestSlowForward"), slow_(slow) {
    net_ = register_module("net", std::move(net));
  }
  Tensor forward(const Tensor& x) override {
    if (slow_ && is_training()) std::this_thread::sleep_for(kTestSlowRankDelay);
    return net_->forward(x);
  }

 private:
  bool slow_;
  std::shared_ptr<nn::Module> net_;
};

// SGD over the model's parameters; with --zero 1 wrapped so that each rank keeps the state of
// its shard only (Note [ZeRO-1]), with --zero 2/3 over FSDP's shards: the same parameters, bit
// for bit, and a checkpoint that is the same file, loadable with or without --zero and with any
// number of ranks.
std::unique_ptr<optim::Optimizer> build_optimizer(const Config& cfg, double lr,
                                                  const nn::Module& model,
                                                  const std::shared_ptr<dist::ProcessGroup>& pg,
                                                  dist::FullyShardedDataParallel* fsdp) {
  const optim::SGDOptions opts{
      .lr = lr, .momentum = cfg.momentum, .weight_decay = cfg.weight_decay};
  if (cfg.zero == 0) return std::make_unique<optim::SGD>(model.parameters(), opts);
  if (fsdp) {
    return fsdp->wrap_optimizer({optim::ParamGroup{model.parameters()}},
                                [opts](std::vector<optim::ParamGroup> groups) {
                                  return std::make_unique<optim::SGD>(std::move(groups), opts);
                                });
  }
  return std::make_unique<dist::ZeroRedundancyOptimizer>(
      model.parameters(), pg, [opts](std::vector<optim::ParamGroup> groups) {
        return std::make_unique<optim::SGD>(std::move(groups), opts);
      });
}

Model build_model(const Config& cfg, const std::shared_ptr<dist::ProcessGroup>& pg, Generator& gen,
                  amp::GradScaler& scaler) {
  Model m;
  m.params = examples::build_fashion_mnist_model(cfg.model, gen);
  // --sync-bn: the BatchNorm layers normalize with the statistics of all ranks' batches.
  if (cfg.sync_bn) m.params = dist::convert_sync_batchnorm(m.params, pg);
  if (cfg.dp > 1 && cfg.device == "cuda") {
    // --dp K --device cuda: one replica per GPU, cuda:0..K-1, the batch split across them and
    // the gradients summed on cuda:0 (the article's DataParallel).
    std::vector<Device> devices;
    for (int k = 0; k < static_cast<int>(cfg.dp); ++k) devices.push_back(cuda_device(k));
    m.dp = std::make_unique<dist::DataParallel>(
        [&cfg] {
          Generator g(cfg.seed);
          return examples::build_fashion_mnist_model(cfg.model, g);
        },
        devices);
    m.params = m.dp->module();
    m.forward_backward = [dp = m.dp.get()](const data::Batch& batch, double weight, bool) {
      return dp->forward_backward(batch.input, batch.target,
                                  [weight](const Tensor& out, const Tensor& t) {
                                    return mul(cross_entropy(out, t), weight);
                                  });
    };
    return m;
  }
  // --device cuda: this rank's GPU, the one init_process_group bound it to (cuda:LOCAL_RANK).
  // The model moves there before DDP wraps it, so DDP's buckets and broadcasts are on the GPU.
  const Device device = train_device(cfg);
  m.params->to(device);
  if (cfg.dp > 1) {
    // --dp K: DataParallel, K replicas on threads in this one process (the baseline).
    LS_CHECK(pg->size() == 1,
             "--dp runs in one process; it cannot be combined with WORLD_SIZE=", pg->size());
    m.dp = std::make_unique<dist::DataParallel>(
        [&cfg] {
          Generator g(cfg.seed);
          return examples::build_fashion_mnist_model(cfg.model, g);
        },
        static_cast<int>(cfg.dp));
    m.params = m.dp->module();
    m.forward_backward = [dp = m.dp.get()](const data::Batch& batch, double weight, bool) {
      return dp->forward_backward(batch.input, batch.target,
                                  [weight](const Tensor& out, const Tensor& t) {
                                    return mul(cross_entropy(out, t), weight);
                                  });
    };
    return m;
  }
  // In this thread, under autocast with --amp; the loss scaler scales what backward starts from.
  const DType amp_dtype = cfg.amp == "fp16" ? kFloat16 : kBFloat16;
  const bool amp_on = cfg.amp != "none";
  auto local = [amp_dtype, amp_on, device, &scaler](nn::Module& net, const data::Batch& batch,
                                                    double weight) {
    Tensor loss;
    {
      amp::autocast ac(amp_dtype, amp_on);
      // To the GPU (asynchronously, through pinned staging) when training there.
      Tensor logits = net.forward(batch.input.to(device));    // (B,10), bf16/f16 under autocast
      loss = cross_entropy(logits, batch.target.to(device));  // () in f32 always
    }
    scaler.scale(mul(loss, weight)).backward();
    return loss.item() * weight;
  };
  if (cfg.zero >= 2) {
    // FSDP at any number of ranks (one shards nothing, but runs the same way); the default wrap
    // policy makes each large Linear a unit.
    m.fsdp = std::make_shared<dist::FullyShardedDataParallel>(
        m.params, pg, dist::FSDPOptions{.reshard_after_forward = cfg.zero == 3});
    m.forward_backward = [local, fsdp = m.fsdp](const data::Batch& batch, double weight,
                                                bool sync) {
      if (sync) return local(*fsdp, batch, weight);  // the step's last: reduce-scatter
      dist::FullyShardedDataParallel::NoSync no_sync(*fsdp);
      return local(*fsdp, batch, weight);
    };
    return m;
  }
  if (pg->size() == 1) {
    m.forward_backward = [local, net = m.params](const data::Batch& batch, double weight, bool) {
      return local(*net, batch, weight);
    };
    return m;
  }
  dist::DDPOptions dopts;
  dopts.bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(cfg.bucket_mb * (1 << 20)));
  dopts.comm_hook = comm_hook_named(cfg.comm_hook);
  dopts.check_sync_every = cfg.check_sync_every;
  m.ddp = std::make_shared<dist::DistributedDataParallel>(
      cfg.test_slow_rank < 0
          ? m.params
          : std::make_shared<TestSlowForward>(m.params, pg->rank() == cfg.test_slow_rank),
      pg, dopts);
  m.forward_backward = [local, ddp = m.ddp](const data::Batch& batch, double weight, bool sync) {
    if (sync) return local(*ddp, batch, weight);  // the step's last: all-reduce during backward
    dist::DistributedDataParallel::NoSync no_sync(*ddp);
    return local(*ddp, batch, weight);
  };
  return m;
}

// Note [Testing hooks]
// --test-crash-at-step N is for the tests alone (tests/examples/train_fashion_mnist_test.sh:
// resume, resume_ddp, metrics): the last rank kills itself with SIGKILL right after optimizer
// step N and that step's periodic checkpoint, as a machine failure would, so that the tests can
// check that --resume and `lockstep run --max-restarts` recover the very same state. Only on the
// first attempt of a run: a group that `lockstep run` restarted goes on past step N. It is armed
// once at setup and called at one moment, after each optimizer step; nothing else in the
// training loop knows of it. --test-sample-log PATH logs the samples of every step (Note
// [Sample log]). --test-slow-rank R (the slow_rank test) makes rank R's forward
// sleep 100 ms in every training step, through a wrapper DDP is built around (TestSlowForward):
// the run must name rank R the slowest in its metrics and warn about it.
class TestCrash {
 public:
  TestCrash(const Config& cfg, const dist::ProcessGroup& pg)
      : at_step_(cfg.test_crash_at_step > 0 && pg.rank() == pg.size() - 1 && first_attempt()
                     ? cfg.test_crash_at_step
                     : 0),
        rank_(pg.rank()) {}

  void after_step(int64_t step) const {
    if (at_step_ == 0 || step != at_step_) return;
    std::fprintf(stderr, "--test-crash-at-step %lld: rank %d kills itself\n",
                 static_cast<long long>(step), rank_);
    ::kill(::getpid(), SIGKILL);
  }

 private:
  int64_t at_step_;  // 0: disarmed
  int rank_;
};

// Each rank evaluates its share of the test set (the non-padding sampler: every sample once over
// all ranks); the counts are summed across ranks.
double test_accuracy(nn::Module& model, const data::MnistDataset& test, dist::ProcessGroup& pg,
                     const Device& device) {
  NoGradGuard no_grad;
  model.eval();
  data::DistributedSampler shard(
      test.size(), {.num_replicas = pg.size(), .rank = pg.rank(), .shuffle = false, .pad = false});
  const std::vector<int64_t> idx = shard.indices();
  Tensor counts = zeros({2}, kInt64);  // correct, seen
  int64_t correct = 0;
  for (size_t start = 0; start < idx.size(); start += kEvalBatch) {
    const size_t n = std::min<size_t>(kEvalBatch, idx.size() - start);
    std::vector<int64_t> rows(idx.begin() + start, idx.begin() + start + n);
    Tensor which = from_vector(rows, {static_cast<int64_t>(n)});
    Tensor logits = model.forward(index_select(test.images(), 0, which).to(device));  // (n,10)
    correct += static_cast<int64_t>(
        sum(eq(argmax(logits, 1).to(kCPU), index_select(test.labels(), 0, which))).item());
  }
  counts.set_at({0}, static_cast<double>(correct));
  counts.set_at({1}, static_cast<double>(idx.size()));
  pg.all_reduce_host(counts);
  model.train();
  return counts.at({0}) / counts.at({1});
}

// ---------------------------------------------------------------------------------------------
// The run

// Where training stands: optimizer steps taken in all; within `epoch`, the samples all ranks
// together consumed and the losses of its optimizer steps so far, which the epoch's train_loss
// averages (so a resumed epoch reports the uninterrupted one's). A checkpoint stores exactly this.
struct Position {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t epoch_consumed = 0;
  double epoch_loss_sum = 0;  // this rank's
  int64_t epoch_loss_steps = 0;
};

// The checkpoint's user metadata that holds Position's loss sums (one per rank, %.17g) and count.
constexpr const char* kLossSumsKey = "epoch_loss_sums";
constexpr const char* kLossStepsKey = "epoch_loss_steps";
// The user metadata that holds the learning rate --lr-scaling gave the writing run's world, before
// the schedule (%.17g): Note [Rescaling].
constexpr const char* kScaledLrKey = "scaled_lr";

// What one optimizer step ran with.
struct StepResult {
  double loss = 0;        // the mean over its micro-batches
  double lr = 0;          // before the scheduler moved on
  double loss_scale = 0;  // before the scaler's update
  std::optional<double> grad_norm;
};

// What one epoch (or the part of it this run trained) did.
struct EpochResult {
  int64_t steps = 0;    // optimizer steps
  int64_t samples = 0;  // all ranks together
  double seconds = 0;
  bool finished = false;  // its last batch was trained (not stopped early by --max-steps)
};

// The whole run's, for the final line.
struct Totals {
  int64_t samples = 0;
  double seconds = 0;
  double loss = 0;                 // the last epoch's mean over all ranks
  std::optional<double> accuracy;  // the last evaluation's; none without --eval
};

// One split of --data, refused when it holds no samples: an empty training set would "train"
// zero steps and exit 0, an empty test set divide by zero. Before the process group forms, so
// that every rank says so at once instead of waiting for the others.
std::shared_ptr<data::MnistDataset> load_split(const Config& cfg, data::Split split) {
  auto set = data::load_mnist(cfg.data, split, {.normalize = true});
  LS_CHECK(set->size() > 0, "--data ", cfg.data, ": the ", data::split_name(split),
           " split holds no samples; ",
           split == data::Split::kTrain ? "there is nothing to train on"
                                        : "there is nothing to evaluate on (or pass --no-eval)");
  return set;
}

// Note [Same settings] for this program: what every rank must agree on (the flags that decide the
// data each rank reads, the model, the optimization and the collectives each rank calls), and the
// training data itself (its size and a hash of every image and label): ranks started by hand or by
// a scheduler may name it by another path on each machine. Flags that may differ per rank
// (--threads, --workers, --metrics, --timeout) are not compared. Returns true so that it can run as
// a member's initializer, right after the process group forms and before the model is broadcast.
bool check_job_settings(const Config& cfg, dist::ProcessGroup& pg,
                        const data::MnistDataset& train) {
  const auto text = [](auto v) { return std::to_string(v); };
  const auto yes_no = [](bool b) { return std::string(b ? "yes" : "no"); };
  dist::check_same_settings(
      pg,
      {{"--seed", text(cfg.seed)},
       {"--model", cfg.model},
       {"--batch-size", text(cfg.batch_size)},
       {"--accum-steps", text(cfg.accum_steps)},
       {"--epochs", text(cfg.epochs)},
       {"--max-steps", text(cfg.max_steps)},
       {"--lr", number_text(cfg.lr)},
       {"--momentum", number_text(cfg.momentum)},
       {"--weight-decay", number_text(cfg.weight_decay)},
       {"--lr-scaling", cfg.lr_scaling},
       {"--base-batch", text(cfg.base_batch)},
       {"--warmup-steps", text(cfg.warmup_steps)},
       {"--schedule", cfg.schedule},
       {"--clip-grad-norm", number_text(cfg.clip_grad_norm)},
       {"--amp", cfg.amp},
       {"--device", cfg.device},
       {"--zero", text(cfg.zero)},
       {"--uneven", yes_no(cfg.uneven)},
       {"--sync-bn", yes_no(cfg.sync_bn)},
       {"--eval", yes_no(cfg.eval)},
       {"--save (given or not)", yes_no(!cfg.save.empty())},
       {"--save-every", text(cfg.save_every)},
       {"--resume", cfg.resume},
       {"--check-sync-every", text(cfg.check_sync_every)},
       {"--bucket-mb", number_text(cfg.bucket_mb)},
       {"--comm-hook", cfg.comm_hook},
       {"the training data (--data)",
        std::to_string(train.size()) + " samples, hash " +
            std::to_string(dist::tensor_hash(train.images()) ^
                           (dist::tensor_hash(train.labels()) * 31))}},
      "Every rank must train with the same settings: start every rank with the same flags and "
      "data (a rank-dependent --seed, say, shuffles each rank's data its own way, so that some "
      "samples are trained twice and others never).");
  return true;
}

class Trainer {
 public:
  // Setup, in the order the members are declared: the data, the world, the model, the
  // optimizer, the data loader, the schedule. Only rank 0 prints and saves.
  explicit Trainer(const Config& cfg)
      : cfg_(cfg),
        train_data_(load_split(cfg, data::Split::kTrain)),
        test_data_(cfg.eval ? load_split(cfg, data::Split::kTest) : nullptr),
        // A world of one without launcher variables; under `lockstep run` (or torchrun's
        // variables) one rank of a DDP job, each on its own shard of the data.
        pg_(dist::init_process_group({.backend = cfg.backend, .timeout = timeout_of(cfg)})),
        world_(pg_->size()),
        main_rank_(pg_->rank() == 0),
        settings_agree_(check_job_settings(cfg, *pg_, *train_data_)),
        gen_(cfg.seed),
        // f16 needs loss scaling (its range ends at 65504); bf16 has f32's range and does without.
        scaler_({.enabled = cfg.amp == "fp16"}),
        model_(build_model(cfg, pg_, gen_, scaler_)),
        effective_batch_(effective_batch_of(cfg, world_)),
        lr_(scaled_lr(cfg, effective_batch_)),
        opt_(build_optimizer(cfg, lr_, *model_.params, pg_, model_.fsdp.get())),
        // --uneven: no padding, so the ranks' shares differ (Note [Uneven inputs]).
        sampler_(std::make_shared<data::DistributedSampler>(
            train_data_->size(), data::DistributedSamplerOptions{.num_replicas = world_,
                                                                 .rank = pg_->rank(),
                                                                 .shuffle = true,
                                                                 .seed = cfg.seed,
                                                                 .pad = !cfg.uneven})),
        loader_(train_data_, sampler_,
                {.batch_size = cfg.batch_size,
                 .num_workers = cfg.workers,
                 .prefetch = 4,
                 .pin_memory = cfg.device == "cuda"}),
        // The schedule counts optimizer steps (a step is accum_steps micro-batches).
        full_epoch_batches_(cfg.uneven
                                ? longest_rank_batches(train_data_->size(), world_, cfg.batch_size)
                                : loader_.num_batches()),
        steps_per_epoch_((full_epoch_batches_ + cfg.accum_steps - 1) / cfg.accum_steps),
        total_steps_(total_steps_of(cfg, steps_per_epoch_)),
        scheduler_(*opt_, schedule_of(cfg, total_steps_)),
        // On a terminal, rank 0 draws a progress bar in place of the periodic loss lines.
        progress_({.terminal = true, .enabled = main_rank_ && stdout_is_terminal()}),
        test_crash_(cfg, *pg_),
        sample_log_(cfg.test_sample_log, pg_->rank(), pg_->size()) {
    for (const auto& [name, p] : model_.params->named_parameters()) param_names_.push_back(name);
  }

  // --save: rank 0 can write there, checked before the run whose result it is to hold.
  void check_save_path();
  // --resume: continue from a checkpoint file, or with "auto" from the newest beside --save
  // that verifies.
  void resume();
  // The two header lines; then the per-step record (--metrics) opens.
  void start();
  bool done() const { return pos_.epoch >= cfg_.epochs || reached_max_steps(); }

  // The training loop's pieces, in the order run() calls them.
  EpochResult train_epoch();
  double mean_loss();
  bool evaluates() const { return test_data_ != nullptr; }
  double evaluate();
  void report_epoch(const EpochResult& e, double loss, std::optional<double> accuracy) const;
  void next_epoch(const EpochResult& e);
  void save_final();
  void report_final(const Totals& totals) const;

 private:
  std::optional<StepResult> train_step(const data::Batch& batch, int64_t pass_samples);
  void optimizer_step(StepResult* s);
  void finish_uneven_epoch(dist::Join& join);
  void record_step(const StepResult& s, double samples_per_s);
  void save_if_due(bool epoch_end);
  void print_step(const StepResult& s) const;
  io::TrainingCheckpoint checkpoint(const Position& at);
  bool spared(const std::string& path) const;
  void load(const std::string& path);
  void load_epoch_loss(const io::TrainingCheckpoint& ckpt, const std::string& path);
  void report_rescaled_lr(const io::TrainingCheckpoint& ckpt, const std::string& path) const;
  void warn_about_later_checkpoints() const;
  bool reached_max_steps() const { return cfg_.max_steps > 0 && pos_.step >= cfg_.max_steps; }

  const Config& cfg_;
  std::shared_ptr<data::MnistDataset> train_data_, test_data_;
  std::shared_ptr<dist::ProcessGroup> pg_;
  const int world_;
  const bool main_rank_;
  const bool settings_agree_;  // check_job_settings, before anything else is collective
  Generator gen_;
  amp::GradScaler scaler_;
  Model model_;
  const int64_t effective_batch_;
  const double lr_;
  std::unique_ptr<optim::Optimizer> opt_;
  std::shared_ptr<data::DistributedSampler> sampler_;
  data::DataLoader loader_;
  const int64_t full_epoch_batches_, steps_per_epoch_, total_steps_;
  optim::LRScheduler scheduler_;
  io::Progress progress_;
  const TestCrash test_crash_;
  examples::TestSampleLog sample_log_;
  std::vector<std::string> param_names_;
  std::optional<io::MetricsWriter> metrics_;
  Position pos_;
  // Checkpoints --resume auto found corrupt: never written over nor pruned (Trainer::spared).
  std::vector<std::string> spare_;
  // Gradient accumulation within the current optimizer step: Note [Accumulation window].
  Window window_;
  int64_t micro_ = 0;
  double step_loss_ = 0;
};

// ---- Setup: where the run starts

void Trainer::check_save_path() {
  if (!cfg_.save.empty()) dist::check_checkpoint_path(*pg_, "--save", cfg_.save);
}

void Trainer::resume() {
  if (!cfg_.resume.empty()) {
    const io::CheckpointChoice choice = dist::resolve_resume(*pg_, cfg_.resume, cfg_.save);
    for (const auto& skipped : choice.skipped) spare_.push_back(skipped.path);
    if (choice.path.empty()) {
      log_rank0(LogLevel::kInfo, "resume: no checkpoint beside ", cfg_.save,
                " yet, starting from step 0");
    } else {
      load(choice.path);
    }
  }
  warn_about_later_checkpoints();
}

void Trainer::load(const std::string& path) {
  io::TrainingCheckpoint ckpt = dist::load_checkpoint(*pg_, path);
  try {
    model_.load_state_dict(ckpt.model);
  } catch (const Error& e) {
    LS_THROW("--resume ", path, " holds another model than --model ", cfg_.model, ": ",
             e.message());
  }
  for (const auto& [key, value] : run_metadata(cfg_)) {
    auto it = ckpt.user.find(key);
    if (main_rank_ && (it == ckpt.user.end() || it->second != value))
      log_warning("--resume ", path, " was written with --", key, " ",
                  it == ckpt.user.end() ? "(unset)" : it->second, ", this run has --", key, " ",
                  value);
  }
  opt_->load_state_dict(ckpt.optimizer);
  if (scaler_.is_enabled()) scaler_.load_state_dict(ckpt.scaler);
  if (auto it = ckpt.rng.find("init"); it != ckpt.rng.end()) {
    gen_.manual_seed(it->second.seed);
    gen_.set_offset(it->second.offset);
  }
  pos_ = {.step = ckpt.step, .epoch = ckpt.epoch, .epoch_consumed = ckpt.epoch_samples};
  load_epoch_loss(ckpt, path);
  // The optimizer state brought back the writing run's learning rate; this puts this world's
  // (Note [Rescaling]).
  scheduler_.set_step(pos_.step);
  log_rank0(LogLevel::kInfo, "resumed ", path, ": step ", pos_.step, ", epoch ", pos_.epoch,
            " after ", pos_.epoch_consumed, " of its samples (written by ", ckpt.world_size,
            " ranks, now ", world_, ")");
  report_rescaled_lr(ckpt, path);
}

// Note [Rescaling]
// A checkpoint resumed with another number of ranks continues the epoch exactly: the sampler
// deals out the rest of the epoch's order to the new ranks (DistributedSampler::set_start_index),
// so no sample is skipped or seen twice (but for the padding when the rest does not split evenly
// over the new ranks), and the learning rate is the one --lr-scaling gives the new world's
// effective batch. The optimizer's state dict holds each group's learning rate
// ("group.<g>.lr"), so loading it brings back the writing run's; the scheduler then sets this
// run's base rate (scaled_lr() of this world, taken when it was built, before the load) times
// the schedule at the resumed step, and every step from there on uses it. The checkpoint
// records the writing run's base rate (user.scaled_lr), so that rank 0 can say that the rate
// changed and by how much: "learning rate rescaled from 0.05 to 0.075 (world size 2 -> 3,
// --lr-scaling linear)". The metrics' train records carry world_size, so the change shows there
// too. What stays approximate: the schedule counts optimizer steps, and a step covers another
// number of samples in the new world (a cosine decay reaches its end at this world's count of
// steps per epoch, from the resumed step on).

// Rank 0 says when the base learning rate differs from the checkpoint's run's (Note
// [Rescaling]). A checkpoint without user.scaled_lr (written before it was recorded) is taken to
// have been written with this run's flags at its own world size.
void Trainer::report_rescaled_lr(const io::TrainingCheckpoint& ckpt,
                                 const std::string& path) const {
  if (!main_rank_) return;
  double before = scaled_lr(cfg_, effective_batch_of(cfg_, static_cast<int>(ckpt.world_size)));
  if (auto it = ckpt.user.find(kScaledLrKey); it != ckpt.user.end()) {
    char* end = nullptr;
    before = std::strtod(it->second.c_str(), &end);
    LS_CHECK(!it->second.empty() && end == it->second.c_str() + it->second.size(), "--resume ",
             path, ": metadata user.", kScaledLrKey, " should be a number, found '", it->second,
             "'");
  }
  if (before == lr_) return;
  if (ckpt.world_size != world_) {
    log_info("learning rate rescaled from ", before, " to ", lr_, " (world size ", ckpt.world_size,
             " -> ", world_, ", --lr-scaling ", cfg_.lr_scaling, ")");
  } else {
    log_info("learning rate ", lr_, " differs from the checkpoint's ", before, " (the same world",
             " size ", world_, "; another --lr, --batch-size, --accum-steps, --lr-scaling or ",
             "--base-batch)");
  }
}

// Position's loss sums: each rank its own when the world size is the checkpoint's, else each the
// mean of them (the epoch's train_loss is their mean either way). A checkpoint written before
// they were recorded has none: the epoch's train_loss then covers the steps from here on.
void Trainer::load_epoch_loss(const io::TrainingCheckpoint& ckpt, const std::string& path) {
  const auto sums_it = ckpt.user.find(kLossSumsKey);
  const auto steps_it = ckpt.user.find(kLossStepsKey);
  if (sums_it == ckpt.user.end() || steps_it == ckpt.user.end()) {
    if (pos_.epoch_consumed > 0)
      log_rank0(LogLevel::kInfo, "--resume ", path, " records no losses of epoch ", pos_.epoch,
                " (an older checkpoint): its train_loss will cover the steps from here on");
    return;
  }
  // strtod, not operator>>: a run whose loss diverged has written "nan" or "inf".
  std::vector<double> sums;
  std::istringstream in(sums_it->second);
  bool numbers = true;
  for (std::string word; in >> word;) {
    char* end = nullptr;
    sums.push_back(std::strtod(word.c_str(), &end));
    numbers = numbers && end == word.c_str() + word.size();
  }
  int64_t steps = -1;
  const std::string& steps_text = steps_it->second;
  const auto [end, ec] =
      std::from_chars(steps_text.data(), steps_text.data() + steps_text.size(), steps);
  LS_CHECK(numbers && !sums.empty() && ec == std::errc() &&
               end == steps_text.data() + steps_text.size() && steps >= 0,
           "--resume ", path, ": metadata user.", kLossSumsKey, " should be numbers and user.",
           kLossStepsKey, " a count, found '", sums_it->second, "' and '", steps_text, "'");
  double mean = 0;
  for (double v : sums) mean += v;
  mean /= static_cast<double>(sums.size());
  pos_.epoch_loss_sum = static_cast<int>(sums.size()) == world_ ? sums[pg_->rank()] : mean;
  pos_.epoch_loss_steps = steps;
}

// Periodic checkpoints of later steps (another run's, or an older checkpoint resumed on purpose)
// would win over this run's in a later --resume auto; corrupt ones were reported by the resume.
void Trainer::warn_about_later_checkpoints() const {
  if (!main_rank_ || cfg_.save.empty() || cfg_.save_every <= 0) return;
  for (const auto& [step, path] : io::list_checkpoints(cfg_.save))
    if (step > pos_.step && !spared(path))
      log_warning(path, " is of step ", step, ", later than this run's step ", pos_.step,
                  ": --resume auto would pick it over this run's checkpoints until this run "
                  "passes that step; remove it if it belongs to another run");
}

void Trainer::start() {
  if (main_rank_) {
    std::printf(
        "model=%s params=%lld threads=%d train=%lld test=%lld batch=%lld world_size=%d "
        "global_batch=%lld backend=%s device=%s\n",
        cfg_.model.c_str(), static_cast<long long>(model_.params->num_parameters()),
        get_num_threads(), static_cast<long long>(train_data_->size()),
        static_cast<long long>(test_data_ ? test_data_->size() : 0),
        static_cast<long long>(cfg_.batch_size), world_,
        static_cast<long long>(cfg_.batch_size * world_), std::string(pg_->backend()).c_str(),
        model_.dp ? model_.dp->devices().front().str().c_str() : train_device(cfg_).str().c_str());
    std::printf(
        "amp=%s accum_steps=%lld effective_batch=%lld lr=%g (scaling %s from base batch %lld) "
        "schedule=%s warmup_steps=%lld optimizer_steps=%lld\n",
        cfg_.amp.c_str(), static_cast<long long>(cfg_.accum_steps),
        static_cast<long long>(effective_batch_), lr_, cfg_.lr_scaling.c_str(),
        static_cast<long long>(cfg_.base_batch), cfg_.schedule.c_str(),
        static_cast<long long>(cfg_.warmup_steps), static_cast<long long>(total_steps_));
  }
  // Rank 0 records every optimizer step and evaluation.
  if (main_rank_ && !cfg_.metrics.empty()) {
    const auto dir = std::filesystem::path(cfg_.metrics).parent_path();
    std::error_code ec;
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);  // else open says why
    metrics_.emplace(cfg_.metrics);
  }
}

// ---- The training loop

EpochResult Trainer::train_epoch() {
  loader_.set_epoch(pos_.epoch);
  sampler_->set_start_index(pos_.epoch_consumed);  // 0 but in the epoch a checkpoint resumes
  const int64_t micro_batches = loader_.num_batches();
  const int64_t pass_samples = sampler_->num_samples();  // this rank's, as many on every rank
  // This epoch's optimizer steps taken before a resume.
  const int64_t steps_before =
      cfg_.uneven ? 0 : (full_epoch_batches_ - micro_batches) / cfg_.accum_steps;
  // --uneven: Note [Uneven inputs].
  std::optional<dist::Join> join;
  if (cfg_.uneven && model_.ddp) {
    join.emplace(*model_.ddp, dist::JoinOptions{.optimizer = opt_.get(),
                                                .scaler = &scaler_,
                                                .step = [this] { optimizer_step(nullptr); }});
  }
  EpochResult e;
  e.finished = micro_batches == 0;
  micro_ = 0;
  step_loss_ = 0;
  progress_.start_epoch(pos_.epoch, steps_per_epoch_);
  const auto start = Clock::now();
  auto last_step_end = start;
  int64_t step_samples = 0;
  for (data::Batch& batch : loader_) {
    const bool epoch_end = batch.index + 1 == micro_batches;
    sample_log_.add(batch.indices);  // testing only: Note [Sample log]
    const std::optional<StepResult> step = train_step(batch, pass_samples);
    const int64_t samples = batch.input.size(0) * world_;  // every rank read a batch as large
    e.samples += samples;
    pos_.epoch_consumed += samples;
    step_samples += samples;
    if (!step) continue;  // a micro-batch of gradient accumulation: no optimizer step yet
    sample_log_.after_step(pos_.step, pos_.epoch);  // before the step's checkpoint

    ++e.steps;
    pos_.epoch_loss_sum += step->loss;
    ++pos_.epoch_loss_steps;
    e.finished = epoch_end;
    const auto now = Clock::now();
    record_step(*step, step_samples / std::chrono::duration<double>(now - last_step_end).count());
    progress_.update(steps_before + e.steps, step->loss, step_samples);
    last_step_end = now;
    step_samples = 0;
    save_if_due(epoch_end);
    test_crash_.after_step(pos_.step);  // testing only: Note [Testing hooks]
    print_step(*step);
    if (reached_max_steps()) break;
  }
  if (join) finish_uneven_epoch(*join);
  progress_.finish();
  e.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return e;
}

// This rank is out of batches: shadow the others until all are (Note [Uneven inputs]); then the
// step count and the schedule continue from the longest rank's.
void Trainer::finish_uneven_epoch(dist::Join& join) {
  join.finish();
  if (join.steps_shadowed() > 0)
    log_info("--uneven: rank ", pg_->rank(), " ran out of batches after ", join.steps_taken(),
             " forwards and shadowed ", join.steps_shadowed(), " of the others'");
  Tensor steps = full({1}, static_cast<double>(pos_.step), kFloat64);
  pg_->all_reduce_host(steps, {.op = dist::ReduceOp::max});
  pos_.step = static_cast<int64_t>(steps.item());
  scheduler_.set_step(pos_.step);
}

// One micro-batch: forward and backward, its gradients added into .grad. The last micro-batch of
// a step (--accum-steps of them, or fewer at the end of an epoch) reduces the gradients across
// ranks and takes the optimizer step, whose result it returns. Each micro-batch weighs by its
// share of its window's samples (Note [Accumulation window]); `pass_samples` is this rank's
// samples in this pass over the epoch.
std::optional<StepResult> Trainer::train_step(const data::Batch& batch, int64_t pass_samples) {
  if (micro_ == 0)
    window_ = accumulation_window(batch.index, cfg_.accum_steps, cfg_.batch_size, pass_samples);
  const bool last = ++micro_ == window_.micro_batches;
  const double weight =
      static_cast<double>(batch.input.size(0)) / static_cast<double>(window_.samples);
  const double loss = model_.forward_backward(batch, weight, /*sync=*/last);
  // With --amp fp16 the scaler skips a step whose loss or gradients overflowed.
  if (!scaler_.is_enabled())
    optim::check_loss_is_finite(loss, pos_.step + 1,
                                "Lower --lr, or clip the gradients with --clip-grad-norm.");
  step_loss_ += loss;
  if (!last) return std::nullopt;
  micro_ = 0;

  StepResult s;
  s.loss = std::exchange(step_loss_, 0.0);
  optimizer_step(&s);
  ++pos_.step;
  return s;
}

// After a synchronized backward: clipping, the (scaled) step, the scaler's and the schedule's
// updates. With --uneven and --zero 1 a rank out of data runs it too, over the others' averaged
// gradients, so that its shard of the parameters moves with theirs (Note [Join and ZeRO]).
void Trainer::optimizer_step(StepResult* s) {
  double grad_norm = 0;
  if (cfg_.clip_grad_norm > 0) {
    scaler_.unscale_(*opt_);
    grad_norm = model_.clip_grad_norm(cfg_.clip_grad_norm);
  }
  if (s != nullptr) {
    if (cfg_.clip_grad_norm > 0) s->grad_norm = grad_norm;
    // What this step ran with, before update() and the scheduler move on to the next.
    s->loss_scale = scaler_.get_scale();
    s->lr = scheduler_.last_lr();
  }
  scaler_.step(*opt_);
  scaler_.update();
  scheduler_.step();
  opt_->zero_grad();
}

void Trainer::record_step(const StepResult& s, double samples_per_s) {
  if (!metrics_) return;
  std::optional<dist::DDPStats> ddp;
  if (model_.ddp && model_.ddp->stats().slowest_rank >= 0) ddp = model_.ddp->stats();
  metrics_->write(io::TrainRecord{
      .step = pos_.step,
      .epoch = pos_.epoch,
      .world_size = world_,
      .loss = s.loss,
      .lr = s.lr,
      .samples_per_s = samples_per_s,
      .loss_scale = scaler_.is_enabled() ? std::optional<double>(s.loss_scale) : std::nullopt,
      .grad_norm = s.grad_norm,
      .peak_rss_mib = io::peak_rss_mib(),
      // Note [Slow rank]: DDP measured every rank's compute time of this step.
      .slowest_rank = ddp ? std::optional<int64_t>(ddp->slowest_rank) : std::nullopt,
      .slowest_rank_ms = ddp ? std::optional<double>(ddp->slowest_rank_ms) : std::nullopt,
      .median_rank_ms = ddp ? std::optional<double>(ddp->median_rank_ms) : std::nullopt});
}

// --save-every N: a checkpoint after every N-th optimizer step, beside --save. A path that
// holds a checkpoint the resume found corrupt is left as it is: that step's checkpoint is not
// written (the next one is), and a warning says so.
void Trainer::save_if_due(bool epoch_end) {
  if (cfg_.save_every <= 0 || pos_.step % cfg_.save_every != 0) return;
  const std::string path = io::checkpoint_path_for_step(cfg_.save, pos_.step);
  if (spared(path)) {
    log_rank0(LogLevel::kWarning, "not saving step ", pos_.step, " to ", path,
              ": it holds the corrupt checkpoint --resume auto skipped, left for you to inspect; "
              "remove or move it to let this run write there");
    return;
  }
  // At the end of an epoch, the position is the next epoch's start.
  const Position at = epoch_end ? Position{.step = pos_.step, .epoch = pos_.epoch + 1} : pos_;
  dist::save_checkpoint(*pg_, path, checkpoint(at), cfg_.keep, spare_);
  log_rank0(LogLevel::kInfo, "saved ", path);
}

bool Trainer::spared(const std::string& path) const {
  return std::find(spare_.begin(), spare_.end(), path) != spare_.end();
}

// --log-every N: the loss every N optimizer steps, where no progress bar shows it.
void Trainer::print_step(const StepResult& s) const {
  if (!main_rank_ || progress_.enabled() || cfg_.log_every <= 0 || pos_.step % cfg_.log_every != 0)
    return;
  std::printf(
      "epoch %lld step %lld loss %.4f lr %.5g%s\n", static_cast<long long>(pos_.epoch),
      static_cast<long long>(pos_.step), s.loss, s.lr,
      scaler_.is_enabled() ? (" loss_scale " + std::to_string(scaler_.get_scale())).c_str() : "");
}

// The model, the optimizer, the scaler and the position `at`, as --resume reads them back. Every
// rank calls it: each contributes its loss sum (an exact gather: a sum of one value and zeros).
io::TrainingCheckpoint Trainer::checkpoint(const Position& at) {
  Tensor sums = zeros({world_}, kFloat64);
  sums.set_at({pg_->rank()}, at.epoch_loss_sum);
  pg_->all_reduce_host(sums);
  io::TrainingCheckpoint ckpt;
  ckpt.model = model_.state_dict();
  ckpt.optimizer = opt_->state_dict();
  ckpt.optimizer_param_names = param_names_;
  if (scaler_.is_enabled()) ckpt.scaler = scaler_.state_dict();
  ckpt.step = at.step;
  ckpt.epoch = at.epoch;
  ckpt.epoch_samples = at.epoch_consumed;
  ckpt.world_size = world_;
  ckpt.rng["init"] = {gen_.seed(), gen_.offset()};
  ckpt.user = run_metadata(cfg_);
  std::string text;
  for (int r = 0; r < world_; ++r) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.17g", r ? " " : "", sums.at({r}));
    text += buf;
  }
  ckpt.user[kLossSumsKey] = text;
  ckpt.user[kLossStepsKey] = std::to_string(at.epoch_loss_steps);
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.17g", lr_);
  ckpt.user[kScaledLrKey] = lr;
  return ckpt;
}

// The epoch's mean training loss (all its steps, those before a resume included), averaged over
// all ranks.
double Trainer::mean_loss() {
  const double steps = static_cast<double>(pos_.epoch_loss_steps);
  Tensor mean = full({1}, steps > 0 ? pos_.epoch_loss_sum / steps : 0.0, kFloat64);
  pg_->all_reduce_host(mean, {.op = dist::ReduceOp::avg});
  return mean.item();
}

// Test accuracy over all ranks' shares of the test set, recorded with --metrics.
double Trainer::evaluate() {
  const Device device = model_.dp ? model_.dp->devices().front() : train_device(cfg_);
  const double accuracy = test_accuracy(model_.eval_module(), *test_data_, *pg_, device);
  if (metrics_)
    metrics_->write(
        io::EvalRecord{.step = pos_.step, .epoch = pos_.epoch, .test_accuracy = accuracy});
  return accuracy;
}

// "0.8712", or "none" where no evaluation ran (--no-eval): a field a reader can tell apart.
std::string accuracy_text(std::optional<double> accuracy) {
  if (!accuracy) return "none";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4f", *accuracy);
  return buf;
}

void Trainer::report_epoch(const EpochResult& e, double loss,
                           std::optional<double> accuracy) const {
  if (!main_rank_) return;
  std::printf("epoch %lld train_loss %.4f samples/s %.1f test_accuracy %s data_wait %.1f%%\n",
              static_cast<long long>(pos_.epoch), loss, e.samples / e.seconds,
              accuracy_text(accuracy).c_str(), 100.0 * loader_.wait_seconds() / e.seconds);
}

void Trainer::next_epoch(const EpochResult& e) {
  loader_.reset_wait_seconds();  // data_wait is per epoch
  // The next epoch starts at its first sample, with no losses yet.
  if (e.finished) pos_ = {.step = pos_.step, .epoch = pos_.epoch + 1};
}

// --save: the end-of-run checkpoint (rank 0 writes, the others wait). When --save holds the
// corrupt checkpoint --resume auto skipped, it is left as it is and the checkpoint goes beside
// it as the periodic file of its step, which --resume auto finds as well.
void Trainer::save_final() {
  if (cfg_.save.empty()) return;
  std::string path = cfg_.save;
  if (spared(path)) {
    path = io::checkpoint_path_for_step(cfg_.save, pos_.step);
    LS_CHECK(!spared(path), "--save ", cfg_.save, " and ", path,
             " both hold corrupt checkpoints that this run leaves for you to inspect; remove or "
             "move one to let the run save its result");
    log_rank0(LogLevel::kWarning, "--save ", cfg_.save,
              " holds the corrupt checkpoint --resume auto skipped, left for you to inspect; "
              "saving to ",
              path, " instead");
  }
  dist::save_checkpoint(*pg_, path, checkpoint(pos_));
  log_rank0(LogLevel::kInfo, "saved ", path);
}

void Trainer::report_final(const Totals& totals) const {
  if (model_.ddp && cfg_.ddp_stats && main_rank_)
    std::printf("ddp: %s\n", model_.ddp->stats().str().c_str());
  if (!main_rank_) return;
  if (const auto* zero = dynamic_cast<const dist::ZeroRedundancyOptimizer*>(opt_.get())) {
    const dist::ZeroStats z = zero->stats();
    std::printf(
        "zero: rank 0 keeps %lld bytes of optimizer state, for its shard of %lld of the %lld "
        "parameter elements (%lld stepped on every rank)\n",
        static_cast<long long>(z.state_bytes), static_cast<long long>(z.shard_elements),
        static_cast<long long>(z.total_elements), static_cast<long long>(z.replicated_elements));
  }
  if (totals.samples == 0)
    log_info("nothing left to train: step ", pos_.step, " reached --max-steps / --epochs");
  std::printf("final test_accuracy=%s train_loss=%.4f steps=%lld samples_per_s=%.1f\n",
              accuracy_text(totals.accuracy).c_str(), totals.loss,
              static_cast<long long>(pos_.step),
              totals.seconds > 0 ? totals.samples / totals.seconds : 0.0);
}

int run(const Config& cfg) {
  // Setup: threads, then the data, the world, the model, the optimizer and the schedule; then
  // where a resumed run stands.
  if (cfg.threads > 0) set_num_threads(static_cast<int>(cfg.threads));
  Trainer trainer(cfg);
  trainer.check_save_path();
  trainer.resume();
  trainer.start();

  // Each epoch: its optimizer steps (metrics, checkpoints and log lines as they fall due), the
  // mean training loss over all ranks, an evaluation on the test set, one line.
  Totals totals;
  while (!trainer.done()) {
    const EpochResult epoch = trainer.train_epoch();
    totals.samples += epoch.samples;
    totals.seconds += epoch.seconds;
    totals.loss = trainer.mean_loss();
    if (trainer.evaluates()) totals.accuracy = trainer.evaluate();
    trainer.report_epoch(epoch, totals.loss, totals.accuracy);
    trainer.next_epoch(epoch);
  }

  trainer.save_final();
  trainer.report_final(totals);
  dist::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line even into a pipe (`lockstep run`), so a killed run loses no printed line.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Config cfg;
  try {
    if (const int rc = examples::parse_flags(argc, argv, cfg); rc >= 0) return rc;
    return run(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    dist::record_error(e.what());  // for `lockstep run`'s failure summary
    return 1;
  }
}
