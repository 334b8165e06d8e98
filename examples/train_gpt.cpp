// Trains a GPT-2 style byte-level language model (examples/gpt_model.h) on token files.
//
//   train_gpt --prepare [FILES...] --out DIR    text -> DIR/train.tokens, DIR/val.tokens
//   train_gpt --data DIR --max-steps 2000 ...   training, one process or under `lockstep run`
//   train_gpt --preset gpt2-124m --plan          GPT-2 small's size and cost, nothing trained
//
// --prepare checks every file (missing, empty, not UTF-8: an error naming the file), splits the
// concatenated bytes 90/10 (Note [Text corpus]) and prints the unigram entropy of the training
// bytes, the loss a model must beat. Its last line is machine-readable: "prepared files=...
// train_tokens=... val_tokens=... entropy_bits=... entropy_nats=...".
//
// Training reads top to bottom as train_fashion_mnist.cpp does: run() sets up once (the world,
// the data, the model with DDP when there are several ranks, AdamW with its two groups, the
// warmup + cosine schedule, a resumed position), then optimizer step after optimizer step, each
// of --accum-steps micro-batches; every --eval-every steps rank 0 prints the training and
// validation loss, tokens/s and the model FLOPs utilisation (Note [MFU]). At the end, --sample N
// prints N bytes the model generates on rank 0, then rank 0 prints every rank's peak resident
// memory and optimizer-state bytes (Note [Peak RSS per rank]). The last line is machine-readable:
// "final val_loss=... train_loss=... steps=... tokens_per_s=... entropy_nats=...". The flags are in
// train_gpt_flags.h.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpt_model.h"
#include "lockstep/base/env_var.h"
#include "lockstep/base/log.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/data/data.h"
#include "lockstep/distributed/checkpoint.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/fsdp.h"
#include "lockstep/distributed/parallel_module.h"
#include "lockstep/distributed/preemption.h"
#include "lockstep/distributed/sharded_checkpoint.h"
#include "lockstep/distributed/sync_check.h"
#include "lockstep/distributed/zero.h"
#include "lockstep/io/checkpoint.h"
#include "lockstep/io/metrics.h"
#include "lockstep/io/progress.h"
#include "lockstep/io/safetensors.h"
#include "lockstep/io/sharded_checkpoint.h"
#include "lockstep/lockstep.h"
#include "lockstep/optim/optimizer.h"
#include "lockstep/optim/schedule.h"
#include "test_sample_log.h"
#include "train_gpt_flags.h"
#include "train_gpt_setup.h"

using namespace lockstep;

namespace {

using Clock = std::chrono::steady_clock;
using examples::build_fsdp;
using examples::build_gpt;
using examples::build_optimizer;
using examples::check_job_settings;
using examples::GptConfig;
using examples::is_sharded_checkpoint_path;
using examples::model_config;
using examples::model_vocab_size;
using examples::number_text;
using examples::open_split;
using examples::optimizer_param_names;
using examples::Position;
using examples::prepare;
using examples::resumed_settings;
using examples::schedule_of;
using examples::stdout_is_terminal;
using examples::timeout_of;
using examples::train_device;
using examples::unigram_entropy_nats;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Note [MFU]
// Model FLOPs utilisation, as llm.c prints it: the FLOPs the model's arithmetic needs per
// trained token (Gpt::flops_per_token: 6 per parameter plus the attention's 12 L T C) times the
// tokens per second, over the machine's GEMM peak. The peak is measured at start, not taken
// from a data sheet: the best of a few (n, n) x (n, n) matmuls in the training dtype (bf16 under
// --amp bf16, else f32) on this process's threads, so MFU says how close the whole step comes
// to this machine's own best GEMM. Under DDP every rank runs its own GEMMs, so the job's peak
// is world times a rank's; on CPUs the ranks share the cores, so that overstates the peak and
// understates MFU when ranks outnumber cores. With --device cuda the matmuls run on the rank's
// GPU, (8192, 8192) ones there (smaller ones leave a large GPU's tensor cores part idle), so MFU
// is against the GPU's own GEMM peak; f32 products use TF32 only where the training does.
double measure_gemm_peak_flops(DType dtype, Device device) {
  const bool gpu = device.is_cuda() && !cuda::emulated();  // emulated GPUs compute on the CPU
  const int64_t n = gpu ? 8192 : 512;
  Generator gen(1);
  Tensor a = randn({n, n}, gen).to(dtype).to(device), b = randn({n, n}, gen).to(dtype).to(device);
  NoGradGuard no_grad;
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t = Clock::now();
    Tensor c = matmul(a, b);
    (void)c.select(0, 0).select(0, 0).item();  // finished (a device result is copied back)
    best = std::min(best, seconds_since(t));
  }
  return 2.0 * n * n * n / best;
}

class Trainer {
 public:
  explicit Trainer(const GptConfig& cfg)
      : cfg_(cfg),
        train_data_(open_split(cfg, "train")),
        val_data_(open_split(cfg, "val")),
        pg_(dist::init_process_group({.backend = cfg.backend, .timeout = timeout_of(cfg)})),
        world_(pg_->size()),
        main_rank_(pg_->rank() == 0),
        settings_agree_(check_job_settings(cfg, *pg_, *train_data_, *val_data_)),
        device_(train_device(cfg)),
        gen_(cfg.seed),
        gpt_(build_gpt(cfg, model_vocab_size(cfg, train_data_->tokens().vocab_size()), gen_,
                       device_)),
        // Several ranks: DDP averages the gradients across them during the last backward of
        // each step (its constructor broadcasts rank 0's parameters).
        // --zero 2/3: FSDP instead, at any number of ranks.
        fsdp_(build_fsdp(cfg, gpt_, pg_)),
        parallel_(fsdp_        ? std::shared_ptr<dist::ParallelModule>(fsdp_)
                  : world_ > 1 ? std::make_shared<dist::DistributedDataParallel>(gpt_, pg_)
                               : nullptr),
        opt_(build_optimizer(cfg, *gpt_, pg_, fsdp_.get())),
        scheduler_(*opt_, schedule_of(cfg)),
        sampler_(std::make_shared<data::DistributedSampler>(
            train_data_->size(), data::DistributedSamplerOptions{.num_replicas = world_,
                                                                 .rank = pg_->rank(),
                                                                 .shuffle = !cfg.no_shuffle,
                                                                 .seed = cfg.seed})),
        loader_(train_data_, sampler_,
                {.batch_size = cfg.batch_size, .drop_last = true, .num_workers = cfg.workers}),
        amp_dtype_(cfg.amp == "bf16" ? kBFloat16 : kFloat32),
        progress_({.terminal = true, .enabled = main_rank_ && stdout_is_terminal()}),
        sharded_(is_sharded_checkpoint_path(cfg.save)),
        saver_(cfg.async_save ? std::make_unique<dist::AsyncShardedSaver>(
                                    *pg_, dist::AsyncSaveOptions{.keep = cfg.keep})
                              : nullptr),
        sample_log_(cfg.test_sample_log, pg_->rank(), world_) {
    LS_CHECK(loader_.num_batches() > 0, "expected at least one batch of ", cfg.batch_size,
             " windows per rank in ", cfg.data, "/train.tokens, got ", sampler_->num_samples(),
             " windows of ", cfg.block_size, " tokens for this rank");
    param_names_ = optimizer_param_names(*gpt_, cfg.weight_decay);
    if (const auto signals = dist::parse_signals(cfg.stop_signals); !signals.empty())
      stop_.emplace(signals);
    if (cfg.zero_reduce_scatter && world_ > 1) {
      zero_scatter_ = static_cast<dist::ZeroRedundancyOptimizer*>(opt_.get());
      static_cast<dist::DistributedDataParallel&>(*parallel_)
          .register_comm_hook(zero_scatter_->comm_hook());
    }
  }

  void resume();
  void start();
  void train();
  double evaluate();
  void sample();
  void save_final();
  // The signal that stopped training after a step (--stop-signals), or 0.
  int stopped_by() const { return stopped_by_; }
  void report_memory();
  void finish();

 private:
  double train_step();
  void log_step(double loss, double grad_norm, double tokens_per_s);
  void save(const std::string& path, bool periodic);
  void wait_for_saver();
  io::TrainingCheckpoint checkpoint_meta() const;
  io::TrainingCheckpoint checkpoint() const;
  std::vector<io::TensorSlice> state_slices() const;
  dist::ShardedLoad read_sharded(const std::string& dir) const;
  io::TrainingCheckpoint whole_checkpoint(dist::ShardedLoad loaded, const std::string& dir) const;
  bool done() const { return pos_.step >= cfg_.max_steps || stopped_by_ != 0; }

  const GptConfig& cfg_;
  std::shared_ptr<data::TokenWindowDataset> train_data_, val_data_;
  std::shared_ptr<dist::ProcessGroup> pg_;
  const int world_;
  const bool main_rank_;
  const bool settings_agree_;  // check_job_settings, before anything else is collective
  const Device device_;        // where the model, its batches and its gradients live
  Generator gen_;
  std::shared_ptr<examples::Gpt> gpt_;
  std::shared_ptr<dist::FullyShardedDataParallel> fsdp_;  // --zero 2/3: its shards' layout
  // What trains and evaluates, whichever wrapper it is (FSDP, or DDP with or without ZeRO-1's
  // hook): the loop asks it for no_sync, clipping and the whole state, never which it is. Null
  // in one process, where the model alone trains.
  std::shared_ptr<dist::ParallelModule> parallel_;
  std::unique_ptr<optim::Optimizer> opt_;
  std::optional<dist::StopOnSignal> stop_;  // --stop-signals
  int stopped_by_ = 0;
  nn::Module& net() const { return parallel_ ? static_cast<nn::Module&>(*parallel_) : *gpt_; }
  // --zero-reduce-scatter: opt_, whose all-gathers DDP's next forward (or summon_full_params,
  // full_state_dict) waits for.
  dist::ZeroRedundancyOptimizer* zero_scatter_ = nullptr;
  optim::LRScheduler scheduler_;
  std::shared_ptr<data::DistributedSampler> sampler_;
  data::DataLoader loader_;
  const DType amp_dtype_;
  io::Progress progress_;
  std::vector<std::string> param_names_;  // the optimizer's parameters, in its order
  // Note [Sharded checkpoints in train_gpt]
  const bool sharded_;  // --save names a directory of per-rank shards, not one file
  std::unique_ptr<dist::AsyncShardedSaver> saver_;  // --async-save
  std::string saving_;                              // the directory saver_ is writing, "" when none
  examples::TestSampleLog sample_log_;              // --test-sample-log (testing only)
  std::optional<io::MetricsWriter> metrics_;
  Position pos_;
  double peak_flops_ = 0;  // the job's: world x a rank's measured GEMM peak (Note [MFU])
  double entropy_nats_ = 0;
  double last_train_loss_ = 0, last_val_loss_ = NAN;
  int64_t tokens_ = 0;  // trained by all ranks in this run
  double seconds_ = 0;  // spent in train steps in this run
};

// --resume FILE or DIR, or auto: the newest checkpoint beside --save that verifies (files or
// sharded directories, as --save names them).
void Trainer::resume() {
  // A sharded --save is a directory that may exist already; what a save needs is a new entry
  // beside it (its temporary directory), so that is what is checked.
  if (!cfg_.save.empty())
    dist::check_checkpoint_path(*pg_, "--save",
                                sharded_ ? io::sharded_temp_dir(cfg_.save, "check") : cfg_.save);
  if (cfg_.resume.empty()) return;
  const bool sharded = is_sharded_checkpoint_path(cfg_.resume == "auto" ? cfg_.save : cfg_.resume);
  const io::CheckpointChoice choice =
      sharded ? dist::resolve_sharded_resume(*pg_, cfg_.resume, cfg_.save)
              : dist::resolve_resume(*pg_, cfg_.resume, cfg_.save);
  if (choice.path.empty()) {
    log_rank0(LogLevel::kInfo, "resume: no checkpoint beside ", cfg_.save,
              " yet, starting from step 0");
    return;
  }
  // Under FSDP a sharded checkpoint gives each rank its own pieces, loaded into its shards;
  // otherwise every rank has the whole state, as from a file.
  const bool own_pieces = sharded && fsdp_;
  dist::ShardedLoad pieces;
  io::TrainingCheckpoint ckpt;
  if (own_pieces) {
    pieces = read_sharded(choice.path);
    ckpt = pieces.meta;
  } else {
    ckpt = sharded ? whole_checkpoint(read_sharded(choice.path), choice.path)
                   : dist::load_checkpoint(*pg_, choice.path);
  }
  try {
    if (own_pieces) {
      fsdp_->load_state_slices(pieces.slices, opt_.get());
    } else if (parallel_) {
      parallel_->load_full_state_dict(ckpt.model);
    } else {
      gpt_->load_state_dict(ckpt.model);
    }
  } catch (const Error& e) {
    LS_THROW("--resume ", choice.path, " holds another model than --n-layer ", cfg_.n_layer,
             " --n-head ", cfg_.n_head, " --n-embd ", cfg_.n_embd, " --block-size ",
             cfg_.block_size, ": ", e.message());
  }
  // Another --seed shuffles the epoch another way, so the windows consumed before the checkpoint
  // are no longer the prefix of the order this run skips: say so (as train_fashion_mnist does).
  for (const auto& [key, value] : resumed_settings(cfg_)) {
    auto it = ckpt.user.find(key);
    if (main_rank_ && (it == ckpt.user.end() || it->second != value))
      log_warning("--resume ", choice.path, " was written with --", key, " ",
                  it == ckpt.user.end() ? "(unset: an older checkpoint)" : it->second,
                  ", this run has --", key, " ", value,
                  key == "seed" ? " (the epoch's windows are shuffled another way: some of this "
                                  "epoch will be trained twice and some never)"
                                : " (the steps from here on hold another number of windows)");
  }
  if (!own_pieces) opt_->load_state_dict(ckpt.optimizer);
  pos_ = {.step = ckpt.step, .epoch = ckpt.epoch, .epoch_consumed = ckpt.epoch_samples};
  scheduler_.set_step(pos_.step);
  log_rank0(LogLevel::kInfo, "resumed ", choice.path, ": step ", pos_.step, ", epoch ", pos_.epoch,
            " after ", pos_.epoch_consumed, " of its windows (written by ", ckpt.world_size,
            " ranks, now ", world_, ")");
}

void Trainer::start() {
  entropy_nats_ = unigram_entropy_nats(train_data_->tokens());
  peak_flops_ = world_ * measure_gemm_peak_flops(amp_dtype_, device_);
  if (!main_rank_) return;
  std::printf(
      "gpt n_layer=%lld n_head=%lld n_embd=%lld block_size=%lld vocab=%lld params=%lld "
      "world_size=%d backend=%s threads=%d device=%s\n",
      static_cast<long long>(cfg_.n_layer), static_cast<long long>(cfg_.n_head),
      static_cast<long long>(cfg_.n_embd), static_cast<long long>(cfg_.block_size),
      static_cast<long long>(gpt_->config().vocab_size),
      static_cast<long long>(gpt_->num_parameters()), world_, std::string(pg_->backend()).c_str(),
      get_num_threads(), device_.str().c_str());
  std::printf(
      "data train_windows=%lld val_windows=%lld batch=%lld accum_steps=%lld tokens_per_step=%lld "
      "amp=%s lr=%g warmup_steps=%lld max_steps=%lld weight_decay=%g grad_clip=%g\n",
      static_cast<long long>(train_data_->size()), static_cast<long long>(val_data_->size()),
      static_cast<long long>(cfg_.batch_size), static_cast<long long>(cfg_.accum_steps),
      static_cast<long long>(cfg_.batch_size * cfg_.accum_steps * world_ * cfg_.block_size),
      cfg_.amp.c_str(), cfg_.lr, static_cast<long long>(cfg_.warmup_steps),
      static_cast<long long>(cfg_.max_steps), cfg_.weight_decay, cfg_.grad_clip);
  std::printf(
      "unigram entropy of the training bytes: %.4f nats/byte (the loss to beat); GEMM peak "
      "%.2f GFLOP/s (%s, all ranks; Note [MFU])\n",
      entropy_nats_, peak_flops_ / 1e9, cfg_.amp == "bf16" ? "bf16" : "f32");
  if (!cfg_.metrics.empty()) {
    const auto dir = std::filesystem::path(cfg_.metrics).parent_path();
    std::error_code ec;
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);  // else open says why
    metrics_.emplace(cfg_.metrics);
  }
}

// Optimizer steps until --max-steps, epoch after epoch of the shuffled windows; a resumed run
// starts inside its epoch after the windows already consumed.
void Trainer::train() {
  progress_.start_epoch(0, cfg_.max_steps);
  while (!done()) {
    loader_.set_epoch(pos_.epoch);
    sampler_->set_start_index(pos_.epoch_consumed);
    // Whole optimizer steps of --accum-steps micro-batches while the epoch has them (the
    // batches after set_start_index).
    const int64_t batches = loader_.num_batches();
    int64_t taken = 0;
    auto it = loader_.begin();
    while (!done() && it != loader_.end() && batches - taken >= cfg_.accum_steps) {
      const auto t = Clock::now();
      double loss = 0;
      for (int64_t m = 0; m < cfg_.accum_steps; ++m, ++it, ++taken) {
        const bool last = m + 1 == cfg_.accum_steps;
        // Accumulate locally, reduce at the last.
        std::optional<dist::ParallelModule::NoSync> no_sync;
        if (parallel_ && !last) no_sync.emplace(*parallel_);
        Tensor l;
        {
          amp::autocast ac(amp_dtype_, cfg_.amp == "bf16");
          sample_log_.add((*it).indices);  // testing only: Note [Sample log]
          Tensor logits = net().forward((*it).input.to(device_));    // (B,T,V)
          l = examples::gpt_loss(logits, (*it).target.to(device_));  // () f32
        }
        // Each micro-batch holds as many windows: the step's loss is their mean.
        mul(l, 1.0 / static_cast<double>(cfg_.accum_steps)).backward();
        const double value = l.item();
        optim::check_loss_is_finite(value, pos_.step + 1,
                                    "Lower --lr, or clip harder with --grad-clip.");
        loss += value / static_cast<double>(cfg_.accum_steps);
      }
      const double grad_norm = cfg_.grad_clip <= 0 ? 0.0
                               : parallel_
                                   ? parallel_->clip_grad_norm(cfg_.grad_clip)
                                   : optim::clip_grad_norm(gpt_->parameters(), cfg_.grad_clip);
      const double lr = scheduler_.last_lr();
      opt_->step();
      scheduler_.step();
      opt_->zero_grad();
      ++pos_.step;
      const int64_t windows = cfg_.batch_size * cfg_.accum_steps * world_;
      pos_.epoch_consumed += windows;
      const double dt = seconds_since(t);
      tokens_ += windows * cfg_.block_size;
      seconds_ += dt;
      last_train_loss_ = loss;
      if (metrics_)
        metrics_->write(io::TrainRecord{
            .step = pos_.step,
            .epoch = pos_.epoch,
            .loss = loss,
            .lr = lr,
            .samples_per_s = windows / dt,
            .grad_norm = cfg_.grad_clip > 0 ? std::optional<double>(grad_norm) : std::nullopt,
            .peak_rss_mib = io::peak_rss_mib()});
      progress_.update(pos_.step, loss, windows);
      sample_log_.after_step(pos_.step, pos_.epoch);  // before the step's checkpoint
      const bool due = cfg_.save_every > 0 && pos_.step % cfg_.save_every == 0;
      if (due && !cfg_.save.empty())
        save(io::checkpoint_path_for_step(cfg_.save, pos_.step), /*periodic=*/true);
      if (stop_ && (stopped_by_ = stop_->agreed(*pg_)) != 0) {
        // Note [Preemption] in lockstep/distributed/preemption.h: this step's checkpoint, where
        // --resume auto looks, written before the process ends.
        const std::string path = io::checkpoint_path_for_step(cfg_.save, pos_.step);
        if (!cfg_.save.empty() && !due) save(path, /*periodic=*/false);
        wait_for_saver();
        log_rank0(cfg_.save.empty() ? LogLevel::kWarning : LogLevel::kInfo, "stopped by ",
                  dist::signal_name(stopped_by_), " after step ", pos_.step,
                  cfg_.save.empty() ? "; nothing saved (no --save)"
                                    : ", saved as " + path + "; --resume auto goes on from there");
        break;
      }
      if (pos_.step % cfg_.eval_every == 0 || done())
        log_step(loss, grad_norm, windows * cfg_.block_size / dt);
    }
    // The epoch's tail that does not fill a step is left out; the next epoch starts afresh.
    if (!done()) pos_ = {.step = pos_.step, .epoch = pos_.epoch + 1};
  }
  progress_.finish();
}

// One log line: the step's loss (the mean over ranks), the validation loss (every rank evaluates
// its share), tokens/s over the whole run so far and MFU (Note [MFU]).
void Trainer::log_step(double loss, double grad_norm, double tokens_per_s) {
  Tensor mean = full({1}, loss, kFloat64);  // this rank's; the line shows all ranks' mean
  pg_->all_reduce_host(mean, {.op = dist::ReduceOp::avg});
  loss = last_train_loss_ = mean.item();
  last_val_loss_ = evaluate();
  if (!main_rank_) return;
  const double run_tokens_per_s = seconds_ > 0 ? tokens_ / seconds_ : tokens_per_s;
  const double mfu = gpt_->flops_per_token(cfg_.block_size) * run_tokens_per_s / peak_flops_;
  // Under a progress bar on a terminal the line replaces the bar's, which is redrawn below it
  // (Note [Open progress line]).
  if (progress_.enabled()) {
    std::printf("\r\033[K");
    detail::set_progress_line_open(false);
  }
  std::printf(
      "step %lld/%lld loss %.4f val_loss %.4f (unigram %.4f) lr %.3g grad_norm %.3f tokens/s "
      "%.0f mfu %.1f%%\n",
      static_cast<long long>(pos_.step), static_cast<long long>(cfg_.max_steps), loss,
      last_val_loss_, entropy_nats_, scheduler_.last_lr(), grad_norm, run_tokens_per_s,
      100.0 * mfu);
}

// The mean loss over the first --eval-batches batches of every rank's share of the validation
// windows (in order, no padding), averaged over all of them across ranks.
double Trainer::evaluate() {
  NoGradGuard no_grad;
  gpt_->eval();
  data::DistributedSampler shard(
      val_data_->size(),
      {.num_replicas = world_, .rank = pg_->rank(), .shuffle = false, .pad = false});
  const std::vector<int64_t> idx = shard.indices();
  const size_t limit =
      std::min<size_t>(idx.size(), static_cast<size_t>(cfg_.eval_batches * cfg_.batch_size));
  Tensor sums = zeros({2}, kFloat64);  // loss x windows, windows
  double loss_sum = 0;
  for (size_t start = 0; start < limit; start += static_cast<size_t>(cfg_.batch_size)) {
    const size_t n = std::min<size_t>(static_cast<size_t>(cfg_.batch_size), limit - start);
    std::vector<data::Example> rows;
    for (size_t i = start; i < start + n; ++i) rows.push_back(val_data_->get(idx[i]));
    data::Batch b = data::collate(rows);
    amp::autocast ac(amp_dtype_, cfg_.amp == "bf16");
    loss_sum +=
        examples::gpt_loss(net().forward(b.input.to(device_)), b.target.to(device_)).item() * n;
  }
  sums.set_at({0}, loss_sum);
  sums.set_at({1}, static_cast<double>(limit));
  pg_->all_reduce_host(sums);
  gpt_->train();
  if (metrics_)
    metrics_->write(io::EvalRecord{.step = pos_.step,
                                   .epoch = pos_.epoch,
                                   .test_accuracy = 0,
                                   .test_loss = sums.at({0}) / sums.at({1})});
  return sums.at({0}) / sums.at({1});
}

// --sample N: rank 0 generates N bytes, one at a time, from a newline: the last block_size
// tokens in, the last position's logits divided by --temperature, cut to the --top-k most
// likely, one drawn from their softmax.
void Trainer::sample() {
  if (cfg_.sample <= 0) return;
  // Every rank makes the model whole (collective: FSDP gathers it) and rank 0 samples from it.
  std::optional<dist::ParallelModule::FullParams> full;
  if (parallel_) full.emplace(*parallel_);
  if (!main_rank_) return;
  NoGradGuard no_grad;
  gpt_->eval();
  Generator gen(cfg_.seed + 1);
  std::vector<int64_t> context = {'\n'};
  std::string text;
  for (int64_t i = 0; i < cfg_.sample; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(context.size()), cfg_.block_size);
    std::vector<int64_t> window(context.end() - T, context.end());
    Tensor logits = gpt_->forward(from_vector(window, {1, T}).to(device_));        // (1,T,V)
    std::vector<double> z = logits.select(1, T - 1).to(kCPU).to_vector<double>();  // (V)
    // A padded vocabulary's extra rows name no token of the data (Note [GPT-2 124M preset]).
    z.resize(static_cast<size_t>(train_data_->tokens().vocab_size()));
    std::vector<double> sorted = z;
    const size_t k = std::min<size_t>(static_cast<size_t>(cfg_.top_k), z.size());
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(),
                     std::greater<double>());
    const double cut = sorted[k - 1], top = *std::max_element(z.begin(), z.end());
    double total = 0;
    for (double& v : z) total += v = v < cut ? 0.0 : std::exp((v - top) / cfg_.temperature);
    double u = rand({1}, gen, kFloat64).item() * total;
    int64_t next = 0;
    for (; next + 1 < static_cast<int64_t>(z.size()); ++next)
      if ((u -= z[static_cast<size_t>(next)]) < 0) break;
    context.push_back(next);
    text.push_back(static_cast<char>(next));
  }
  gpt_->train();
  std::printf("sample (%lld bytes, temperature %g, top-k %lld):\n%s\n--- end of sample\n",
              static_cast<long long>(cfg_.sample), cfg_.temperature,
              static_cast<long long>(cfg_.top_k), text.c_str());
}

// Where training stands and the settings, without tensors: a sharded checkpoint's metadata.
io::TrainingCheckpoint Trainer::checkpoint_meta() const {
  io::TrainingCheckpoint ckpt;
  ckpt.step = pos_.step;
  ckpt.epoch = pos_.epoch;
  ckpt.epoch_samples = pos_.epoch_consumed;
  ckpt.world_size = world_;
  ckpt.user = {{"n_layer", std::to_string(cfg_.n_layer)},
               {"n_head", std::to_string(cfg_.n_head)},
               {"n_embd", std::to_string(cfg_.n_embd)},
               {"block_size", std::to_string(cfg_.block_size)}};
  for (auto& [key, value] : resumed_settings(cfg_)) ckpt.user[key] = value;
  return ckpt;
}

// The whole state (a collective under FSDP and ZeRO-1, which gather it for rank 0).
io::TrainingCheckpoint Trainer::checkpoint() const {
  io::TrainingCheckpoint ckpt = checkpoint_meta();
  ckpt.model = parallel_ ? parallel_->full_state_dict() : gpt_->state_dict();
  ckpt.optimizer = opt_->state_dict();
  ckpt.optimizer_param_names = param_names_;
  return ckpt;
}

// Note [Sharded checkpoints in train_gpt]
// A --save that does not end in ".safetensors" is a directory of shards (io/sharded_checkpoint.h)
// whose tensors are named as a file's (Note [Checkpoint layout]), so that `lockstep checkpoint
// consolidate` turns it into the very tensors the file format holds. Under FSDP every rank writes
// its own pieces of the parameters and of AdamW's moments (state_slices) and reads back only the
// pieces its layout needs, from a checkpoint of any world size and layout. Without FSDP (one
// process, DDP, ZeRO-1) rank 0 writes the whole state, each tensor one slice, and the others
// nothing; every rank then reads every tensor whole. --async-save writes the periodic ones from
// a background thread (dist::AsyncShardedSaver): the step pays for a copy to host memory, and the
// next save, the final one, waits for it.

// This rank's slices of the state, named as io::checkpoint_contents names a file's tensors.
std::vector<io::TensorSlice> Trainer::state_slices() const {
  if (fsdp_) return fsdp_->state_slices(opt_.get());
  io::TrainingCheckpoint ckpt = checkpoint();  // on every rank: ZeRO-1's state_dict gathers
  if (!main_rank_) return {};
  std::vector<io::TensorSlice> whole;
  for (auto& [name, t] : io::checkpoint_contents(ckpt).tensors)
    whole.push_back({.name = name, .shape = t.shape(), .start = 0, .data = t});
  return whole;
}

// Collective. Reads what this rank needs of the sharded checkpoint `dir`: under FSDP its pieces
// at its own layout, else every tensor whole.
dist::ShardedLoad Trainer::read_sharded(const std::string& dir) const {
  // An empty read first, so that a directory that does not open fails every rank alike; then
  // each rank learns the names from the index.
  (void)dist::load_sharded_checkpoint(*pg_, dir, {});
  const io::ShardedCheckpointReader index(dir);
  std::vector<std::string> names;
  for (const io::ShardedTensorInfo& t : index.tensors()) names.push_back(t.name);
  std::vector<io::SliceRequest> wanted;
  if (fsdp_) {
    wanted = fsdp_->state_requests(names, opt_.get());
  } else {
    for (const std::string& name : names) wanted.push_back({.name = name});
  }
  return dist::load_sharded_checkpoint(*pg_, dir, wanted);
}

// Whole tensors of a sharded checkpoint as the checkpoint a file holds: "model.<name>" into the
// model's state, "optim.<param>.<field>" back to the optimizer's "<index>.<field>" (as
// io::checkpoint_from_contents maps a file's names).
io::TrainingCheckpoint Trainer::whole_checkpoint(dist::ShardedLoad loaded,
                                                 const std::string& dir) const {
  io::TrainingCheckpoint ckpt = std::move(loaded.meta);
  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < param_names_.size(); ++i) index_of[param_names_[i]] = i;
  for (io::TensorSlice& s : loaded.slices) {
    Tensor t = s.data.reshape(s.shape);
    if (s.name.rfind("model.", 0) == 0) {
      ckpt.model.emplace_back(s.name.substr(6), std::move(t));
      continue;
    }
    std::string key = s.name.substr(6);  // "optim." (the reader refuses other names)
    if (key != "step" && key.rfind("group.", 0) != 0) {
      const size_t dot = key.rfind('.');
      auto it = dot == std::string::npos ? index_of.end() : index_of.find(key.substr(0, dot));
      LS_CHECK(it != index_of.end(), "--resume ", dir, ": optimizer state '", s.name,
               "' names no parameter of this model");
      key = std::to_string(it->second) + key.substr(dot);
    }
    ckpt.optimizer.emplace_back(std::move(key), std::move(t));
  }
  return ckpt;
}

// Writes `path`: one file (rank 0) or a sharded directory (every rank its slices); a periodic
// sharded one in the background under --async-save.
void Trainer::save(const std::string& path, bool periodic) {
  if (!sharded_) {
    dist::save_checkpoint(*pg_, path, checkpoint(), cfg_.keep);
    log_rank0(LogLevel::kInfo, "saved ", path);
    return;
  }
  const std::vector<io::TensorSlice> slices = state_slices();
  if (saver_ && periodic) {
    wait_for_saver();
    saver_->save(path, slices, checkpoint_meta());  // returns once the slices are copied
    saving_ = path;
    return;
  }
  wait_for_saver();
  dist::save_sharded_checkpoint(*pg_, path, slices, checkpoint_meta(), cfg_.keep);
  log_rank0(LogLevel::kInfo, "saved ", path);
}

// Collective: the background save in flight is committed (or its failure thrown on every rank).
void Trainer::wait_for_saver() {
  if (!saver_ || saving_.empty()) return;
  saver_->wait();
  log_rank0(LogLevel::kInfo, "saved ", saving_, " (in the background)");
  saving_.clear();
}

void Trainer::save_final() {
  if (!cfg_.save.empty()) save(cfg_.save, /*periodic=*/false);
  wait_for_saver();
}

// Note [Peak RSS per rank]
// Every rank's peak resident memory (getrusage's ru_maxrss, io::peak_rss_mib(), the value the
// metrics file's train records carry for rank 0) is summed into its own slot of a world-long
// vector, so rank 0 prints all of them on one line: "peak RSS per rank: 61.2 60.8 MiB". A
// collective: every rank calls it. Under ZeRO-1 the ranks differ by their optimizer shards, so
// the optimizer state each rank keeps is gathered the same way and printed on the next line,
// "optimizer state per rank: 3374816 3374968 bytes": without --zero each rank keeps all of
// AdamW's state (two f32 moments per parameter element, an 8-byte step count per parameter);
// under --zero 1 each keeps its 1/world_size shard of the moments and a step count per piece.
// With --device cuda a third line gives each rank's peak of GPU memory in tensors (the caching
// allocator's peak_allocated_bytes), which is where the model and activations live then.
//
// Note [Memory split]
// The last line splits rank 0's peak of tensor memory (the CPU allocator's, or the GPU's) by
// kind: the parameters it keeps (all of them, or its FSDP shards), their gradients (DDP's
// buckets hold all of them; FSDP's shards), the optimizer state above, FSDP's gathered units and
// full unit gradients at their peak, and what is left: activations, temporaries, batches. The
// peaks of the parts need not coincide, so the rest is a lower bound of the activations.
void Trainer::report_memory() {
  const auto* zero = dynamic_cast<const dist::ZeroRedundancyOptimizer*>(opt_.get());
  int64_t state = 0;
  if (zero) {
    state = zero->stats().state_bytes;
  } else {
    const optim::Optimizer* local = dist::FullyShardedDataParallel::local_optimizer(*opt_);
    for (const auto& [name, t] : (local ? *local : *opt_).state_dict())  // "<index>.<name>"
      if (name.find('.') != std::string::npos && std::isdigit(static_cast<unsigned char>(name[0])))
        state += t.nbytes();
  }
  // Note [Memory split]: what this rank's tensors held at their peak, by kind.
  int64_t params = 0, grads = 0, gathered = 0;
  if (fsdp_) {
    const dist::FSDPStats f = fsdp_->stats();
    params = f.shard_bytes;
    grads = f.grad_shard_bytes;
    gathered = f.peak_gathered_bytes + f.peak_full_grad_bytes;
  } else {
    for (const Tensor& p : gpt_->parameters()) params += p.nbytes();
    grads = params;  // every rank holds the whole gradient (DDP's buckets)
  }
  const double peak =
      device_.is_cuda()
          ? static_cast<double>(cuda::memory_stats(device_.index).peak_allocated_bytes)
          : static_cast<double>(cpu_allocator_stats().peak_allocated_bytes);
  Tensor mem = zeros({7, world_}, kFloat64);
  mem.set_at({0, pg_->rank()}, io::peak_rss_mib());
  mem.set_at({1, pg_->rank()}, static_cast<double>(state));
  if (device_.is_cuda())
    mem.set_at({2, pg_->rank()},
               cuda::memory_stats(device_.index).peak_allocated_bytes / 1048576.0);
  mem.set_at({3, pg_->rank()}, peak);
  mem.set_at({4, pg_->rank()}, static_cast<double>(params));
  mem.set_at({5, pg_->rank()}, static_cast<double>(grads));
  mem.set_at({6, pg_->rank()}, static_cast<double>(gathered));
  pg_->all_reduce_host(mem);
  if (!main_rank_) return;
  std::string rss = "peak RSS per rank:", opt = "optimizer state per rank:";
  std::string dev = "peak device memory per rank:";
  char buf[48];
  for (int r = 0; r < world_; ++r) {
    std::snprintf(buf, sizeof buf, " %.1f", mem.at({0, r}));
    rss += buf;
    std::snprintf(buf, sizeof buf, " %lld", static_cast<long long>(mem.at({1, r})));
    opt += buf;
    std::snprintf(buf, sizeof buf, " %.1f", mem.at({2, r}));
    dev += buf;
  }
  std::printf("%s MiB\n%s bytes\n", rss.c_str(), opt.c_str());
  // Note [Memory split]
  std::string split = "peak tensor memory per rank:";
  for (int r = 0; r < world_; ++r) {
    std::snprintf(buf, sizeof buf, " %.2f", mem.at({3, r}) / 1048576.0);
    split += buf;
  }
  const double rest =
      mem.at({3, 0}) - mem.at({4, 0}) - mem.at({5, 0}) - mem.at({1, 0}) - mem.at({6, 0});
  std::printf(
      "%s MiB (rank 0: parameters %.2f, gradients %.2f, optimizer state %.2f, gathered units "
      "and their full gradients %.2f, activations and the rest %.2f MiB)\n",
      split.c_str(), mem.at({4, 0}) / 1048576.0, mem.at({5, 0}) / 1048576.0,
      mem.at({1, 0}) / 1048576.0, mem.at({6, 0}) / 1048576.0, std::max(0.0, rest) / 1048576.0);
  // With --device cuda, the caching allocator's peak of memory in tensors on each rank's GPU.
  if (device_.is_cuda()) std::printf("%s MiB (in tensors)\n", dev.c_str());
  // Note [ZeRO-1], Overlap: what the parameters' all-gathers cost rank 0's steps.
  if (zero && pos_.step > 0)
    std::printf("zero: %lld segments, all-gathers %.3f ms per step%s\n",
                static_cast<long long>(zero->stats().segments),
                1e3 * zero->stats().gather_seconds / static_cast<double>(pos_.step),
                zero_scatter_ ? " (launch, wait in the next forward, copy)" : "");
  if (fsdp_ && pos_.step > 0) {
    const dist::FSDPStats f = fsdp_->stats();
    std::printf(
        "fsdp: %lld units, shard %.2f MiB per rank, peak gathered %.2f MiB, peak full gradients "
        "%.2f MiB, waiting for gathers %.3f ms per step\n",
        static_cast<long long>(f.units), f.shard_bytes / 1048576.0,
        f.peak_gathered_bytes / 1048576.0, f.peak_full_grad_bytes / 1048576.0,
        1e3 * f.exposed_gather_seconds / static_cast<double>(pos_.step));
  }
}

void Trainer::finish() {
  report_memory();
  if (!main_rank_) return;
  if (std::isnan(last_val_loss_))
    log_info("nothing left to train: step ", pos_.step, " reached --max-steps");
  std::printf(
      "final val_loss=%.4f train_loss=%.4f steps=%lld tokens_per_s=%.1f entropy_nats=%.4f\n",
      last_val_loss_, last_train_loss_, static_cast<long long>(pos_.step),
      seconds_ > 0 ? tokens_ / seconds_ : 0.0, entropy_nats_);
}

// --plan: what the model of these flags costs, counted without building it: parameters
// (gpt_num_parameters, which every built model checks), model FLOPs per token (Note [MFU]) and
// the bytes of its f32 weights, gradients and AdamW moments on one rank (activations depend on
// the batch and are not counted). Needs no data: the vocabulary is --vocab-size, else 256 byte
// tokens.
int plan(const GptConfig& cfg) {
  const examples::GptModelConfig model = model_config(cfg, model_vocab_size(cfg, 256));
  const int64_t params = examples::gpt_num_parameters(model);
  const double mib = static_cast<double>(params) * 4 / 1048576.0;  // f32
  std::printf("gpt n_layer=%lld n_head=%lld n_embd=%lld block_size=%lld vocab=%lld params=%lld\n",
              static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_head),
              static_cast<long long>(cfg.n_embd), static_cast<long long>(cfg.block_size),
              static_cast<long long>(model.vocab_size), static_cast<long long>(params));
  std::printf(
      "plan flops_per_token=%.4g tokens_per_step=%lld weights_mib=%.1f grads_mib=%.1f "
      "adamw_mib=%.1f\n",
      examples::gpt_flops_per_token(model, cfg.block_size),
      static_cast<long long>(cfg.batch_size * cfg.accum_steps * cfg.block_size), mib, mib, 2 * mib);
  return 0;
}

int run(const GptConfig& cfg) {
  if (cfg.prepare) return prepare(cfg);
  if (cfg.plan) return plan(cfg);
  if (cfg.threads > 0) set_num_threads(static_cast<int>(cfg.threads));
  Trainer trainer(cfg);
  trainer.resume();
  trainer.start();
  trainer.train();
  if (trainer.stopped_by() != 0) {  // --stop-signals: saved; no final save, sample or report
    dist::destroy_process_group();
    return dist::StopOnSignal::exit_code(trainer.stopped_by());
  }
  trainer.save_final();
  trainer.sample();
  trainer.finish();
  dist::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line even into a pipe (`lockstep run`), so a killed run loses no printed line.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  GptConfig cfg;
  try {
    if (const int rc = examples::parse_gpt_flags(argc, argv, cfg); rc >= 0) return rc;
    return run(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    dist::record_error(e.what());  // for `lockstep run`'s failure summary
    return 1;
  }
}
