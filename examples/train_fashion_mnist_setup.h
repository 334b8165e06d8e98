// train_fashion_mnist's setup from its flags: the learning rate and schedule for the effective
// batch, the accumulation window and uneven inputs, the model with its wrapper (DataParallel, DDP,
// ZeRO-1, FSDP) and optimizer, the data splits, and the check that every rank was started with the
// same settings (Note [Same settings]).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fashion_mnist_models.h"
#include "lockstep/base/env_var.h"
#include "lockstep/data/data.h"
#include "lockstep/distributed/fsdp.h"
#include "lockstep/distributed/powersgd.h"
#include "lockstep/distributed/sync_check.h"
#include "lockstep/distributed/zero.h"
#include "lockstep/io/checkpoint.h"
#include "lockstep/lockstep.h"
#include "lockstep/nn/layers.h"
#include "lockstep/optim/optimizer.h"
#include "train_fashion_mnist_flags.h"

namespace lockstep::examples {

// ---------------------------------------------------------------------------------------------
// Choices made once, before training

// The learning rate for an effective batch: the usual rule, more devices -> larger batch ->
// larger rate (linear, or sqrt for adaptive optimizers), relative to the batch `lr` was tuned at.
inline double scaled_lr(const Config& cfg, int64_t effective_batch) {
  const double ratio = static_cast<double>(effective_batch) / static_cast<double>(cfg.base_batch);
  if (cfg.lr_scaling == "linear") return cfg.lr * ratio;
  if (cfg.lr_scaling == "sqrt") return cfg.lr * std::sqrt(ratio);
  return cfg.lr;
}

// batch x accum x world: each factor is bounded (Note [Numeric flags]), their product is not.
inline int64_t effective_batch_of(const Config& cfg, int world) {
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
inline Window accumulation_window(int64_t first, int64_t accum_steps, int64_t batch_size,
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
// keeps its own shard of the optimizer state; with --zero 2 or 3 it also runs the model on its
// last batch to take part in the units' gathers and reductions (Note [Join and FSDP]). Whatever
// else communicates mid-epoch cannot be shadowed, so --uneven excludes it (flags.h): a periodic
// checkpoint, SyncBatchNorm's all-gather, accumulation windows that would end at different
// micro-batches on different ranks, a resumed position (which assumes equal shares).

// Micro-batches per epoch of the rank with the most samples: rank 0's, whether or not the
// sampler pads. The schedule counts these, the same on every rank.
inline int64_t longest_rank_batches(int64_t size, int world, int64_t batch_size) {
  const int64_t most = (size + world - 1) / world;
  return (most + batch_size - 1) / batch_size;
}

// Optimizer steps in the whole run: --epochs of them, or fewer with --max-steps.
inline int64_t total_steps_of(const Config& cfg, int64_t steps_per_epoch) {
  const int64_t all = steps_per_epoch * cfg.epochs;
  return cfg.max_steps > 0 ? std::min(all, cfg.max_steps) : all;
}

inline optim::Schedule schedule_of(const Config& cfg, int64_t total_steps) {
  if (cfg.schedule == "cosine") {
    LS_CHECK(total_steps > cfg.warmup_steps, "--warmup-steps ", cfg.warmup_steps,
             " leaves nothing of the ", total_steps, " optimizer steps for the cosine decay");
    return cfg.warmup_steps > 0 ? optim::warmup_cosine(cfg.warmup_steps, total_steps)
                                : optim::cosine_decay(total_steps);
  }
  if (cfg.warmup_steps > 0) return optim::linear_warmup(cfg.warmup_steps);
  return optim::constant_schedule();
}

inline dist::CommHook comm_hook_of(const Config& cfg) {
  if (cfg.comm_hook == "bf16") return dist::bf16_compress_hook();
  if (cfg.comm_hook == "fp16") return dist::fp16_compress_hook();
  if (cfg.comm_hook == "powersgd") {
    return dist::powersgd_hook({.matrix_approximation_rank = cfg.powersgd_rank,
                                .start_powersgd_iter = cfg.powersgd_start,
                                .seed = cfg.seed});
  }
  return dist::allreduce_hook();
}

// What a checkpoint of this program holds besides model and optimizer: the configuration a
// resumed run is compared with (a different one is a warning; another model is an error).
inline io::Metadata run_metadata(const Config& cfg) {
  return {{"model", cfg.model}, {"amp", cfg.amp}, {"seed", std::to_string(cfg.seed)}};
}

// Whether rank 0's stdout ends on a terminal, where a progress bar replaces the loss lines: as
// the launcher says when there is one, else as isatty says.
inline bool stdout_is_terminal() { return env_flag(env::kStdoutIsTty).value_or(::isatty(1) == 1); }

// The model as this process trains it: under --dp K, DataParallel's K replicas on threads; in a
// world of several processes, DDP around this process's copy, or with --zero 2/3 FSDP (at any
// number of processes); else the model alone. The choice is made here, once: the training step
// calls forward_backward and the methods below and never asks which.
struct Model {
  std::shared_ptr<nn::Module> params;  // what the optimizer steps and a checkpoint holds
  std::unique_ptr<dist::DataParallel> dp;
  // DDP or FSDP, through the interface they share (dist::ParallelModule); null in one process.
  // Under FSDP `params` holds no memory outside the forward and backward, so evaluation runs
  // through `parallel` and checkpoints read its full state.
  std::shared_ptr<dist::ParallelModule> parallel;
  dist::DistributedDataParallel* ddp = nullptr;    // `parallel`, when DDP: for its stats
  dist::FullyShardedDataParallel* fsdp = nullptr;  // `parallel`, when FSDP: its shards' layout
  nn::Module& eval_module() const { return parallel ? *parallel : *params; }
  nn::NamedTensors state_dict() const {
    return parallel ? parallel->full_state_dict() : params->state_dict();
  }
  void load_state_dict(const nn::NamedTensors& state) const {
    if (parallel) {
      parallel->load_full_state_dict(state);
    } else {
      params->load_state_dict(state);
    }
  }
  double clip_grad_norm(double max_norm) const {
    return parallel ? parallel->clip_grad_norm(max_norm)
                    : optim::clip_grad_norm(params->parameters(), max_norm);
  }
  // One micro-batch's forward and backward: the loss times `weight` is added into the gradients;
  // returns it. `sync` false: more micro-batches of this step follow, so DDP accumulates locally
  // (no_sync) instead of all-reducing.
  std::function<double(const data::Batch& batch, double weight, bool sync)> forward_backward;
};

// --timeout: unset (0) leaves the choice to LOCKSTEP_TIMEOUT (`lockstep run --timeout`), else the
// library's default.
inline std::optional<std::chrono::milliseconds> timeout_of(const Config& cfg) {
  if (cfg.timeout <= 0) return std::nullopt;
  return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(cfg.timeout * 1000)));
}

// The device this rank trains on: the CPU, or with --device cuda the GPU init_process_group made
// current (cuda:LOCAL_RANK under the launcher).
inline Device train_device(const Config& cfg) {
  return cfg.device == "cuda" ? cuda_device(cuda::current_device()) : kCPU;
}

// --test-slow-rank R (Note [Testing hooks]): on rank R a forward pre-hook of the model sleeps
// kTestSlowRankDelay in training, inside the time DDP measures (Note [Slow rank] in
// src/distributed/diagnosis/slow_rank.h).
inline constexpr auto kTestSlowRankDelay = std::chrono::milliseconds(100);
inline void test_slow_forward(nn::Module& model) {
  model.register_forward_pre_hook([](nn::Module& m) {
    if (m.is_training()) std::this_thread::sleep_for(kTestSlowRankDelay);
  });
}

// SGD over the model's parameters; with --zero 1 wrapped so that each rank keeps the state of
// its shard only (Note [ZeRO-1]), with --zero 2/3 over FSDP's shards: the same parameters, bit
// for bit, and a checkpoint that is the same file, loadable with or without --zero and with any
// number of ranks.
inline std::unique_ptr<optim::Optimizer> build_optimizer(
    const Config& cfg, double lr, const nn::Module& model,
    const std::shared_ptr<dist::ProcessGroup>& pg, dist::FullyShardedDataParallel* fsdp) {
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

inline Model build_model(const Config& cfg, const std::shared_ptr<dist::ProcessGroup>& pg,
                         Generator& gen, amp::GradScaler& scaler) {
  Model m;
  m.params = examples::build_fashion_mnist_model(cfg.model, gen);
  // --sync-bn: the BatchNorm layers normalize with the statistics of all ranks' batches.
  if (cfg.sync_bn) m.params = dist::convert_sync_batchnorm(m.params, pg);
  if (cfg.dp > 1 && cfg.device == "cuda") {
    // --dp K --device cuda: one replica per GPU, cuda:0..K-1, the batch split across them and
    // the gradients summed on cuda:0 (DataParallel as PyTorch does it).
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
    auto fsdp = std::make_shared<dist::FullyShardedDataParallel>(
        m.params, pg, dist::FSDPOptions{.reshard_after_forward = cfg.zero == 3});
    m.fsdp = fsdp.get();
    m.parallel = std::move(fsdp);
  } else if (pg->size() == 1) {
    m.forward_backward = [local, net = m.params](const data::Batch& batch, double weight, bool) {
      return local(*net, batch, weight);
    };
    return m;
  } else {
    dist::DDPOptions dopts;
    dopts.bucket_bytes =
        cfg.bucket_auto ? dist::kBucketBytesFromGroup
                        : std::max<int64_t>(1, static_cast<int64_t>(cfg.bucket_mb * (1 << 20)));
    dopts.comm_hook = comm_hook_of(cfg);
    dopts.check_sync_every = cfg.check_sync_every;
    if (pg->rank() == cfg.test_slow_rank) test_slow_forward(*m.params);
    auto ddp = std::make_shared<dist::DistributedDataParallel>(m.params, pg, dopts);
    m.ddp = ddp.get();
    m.parallel = std::move(ddp);
  }
  // The step's last micro-batch (sync) reduces during its backward (DDP's all-reduce, FSDP's
  // reduce-scatter); the others accumulate locally.
  m.forward_backward = [local, parallel = m.parallel](const data::Batch& batch, double weight,
                                                      bool sync) {
    if (sync) return local(*parallel, batch, weight);
    dist::ParallelModule::NoSync no_sync(*parallel);
    return local(*parallel, batch, weight);
  };
  return m;
}

// One split of --data, refused when it holds no samples: an empty training set would "train"
// zero steps and exit 0, an empty test set divide by zero. Before the process group forms, so
// that every rank says so at once instead of waiting for the others.
inline std::shared_ptr<data::MnistDataset> load_split(const Config& cfg, data::Split split) {
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
inline bool check_job_settings(const Config& cfg, dist::ProcessGroup& pg,
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
       {"--stop-signals", stop_signals_text(cfg.stop_signals)},  // the stop check: a collective
       {"--resume", cfg.resume},
       {"--check-sync-every", text(cfg.check_sync_every)},
       {"--bucket-mb", cfg.bucket_auto ? std::string("auto") : number_text(cfg.bucket_mb)},
       {"--comm-hook", cfg.comm_hook},
       {"--powersgd-rank", text(cfg.powersgd_rank)},
       {"--powersgd-start", text(cfg.powersgd_start)},
       {"the training data (--data)",
        std::to_string(train.size()) + " samples, hash " +
            std::to_string(dist::tensor_hash(train.images()) ^
                           (dist::tensor_hash(train.labels()) * 31))}},
      "Every rank must train with the same settings: start every rank with the same flags and "
      "data (a rank-dependent --seed, say, shuffles each rank's data its own way, so that some "
      "samples are trained twice and others never).");
  return true;
}

}  // namespace lockstep::examples
