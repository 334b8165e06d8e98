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
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
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
#include "lockstep/distributed/preemption.h"
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
#include "train_fashion_mnist_position.h"
#include "train_fashion_mnist_setup.h"

using namespace lockstep;

namespace {

constexpr int64_t kEvalBatch = 1000;

using Clock = std::chrono::steady_clock;
using examples::accumulation_window;
using examples::build_model;
using examples::build_optimizer;
using examples::check_job_settings;
using examples::Config;
using examples::effective_batch_of;
using examples::epoch_loss_of;
using examples::EpochLoss;
using examples::first_attempt;
using examples::load_split;
using examples::longest_rank_batches;
using examples::Model;
using examples::number_text;
using examples::Position;
using examples::put_position;
using examples::recorded_scaled_lr;
using examples::run_metadata;
using examples::scaled_lr;
using examples::schedule_of;
using examples::stdout_is_terminal;
using examples::timeout_of;
using examples::total_steps_of;
using examples::train_device;
using examples::Window;

// Note [Testing hooks]
// --test-crash-at-step N is for the tests alone (tests/examples/train_fashion_mnist_test.sh:
// resume, resume_ddp, metrics): the last rank kills itself with SIGKILL right after optimizer
// step N and that step's periodic checkpoint, as a machine failure would, so that the tests can
// check that --resume and `lockstep run --max-restarts` recover the very same state. Only on the
// first attempt of a run: a group that `lockstep run` restarted goes on past step N. It is armed
// once at setup and called at one moment, after each optimizer step; nothing else in the
// training loop knows of it. --test-sample-log PATH logs the samples of every step (Note
// [Sample log]). --test-slow-rank R (the slow_rank test) makes rank R's forward
// sleep 100 ms in every training step, through a forward pre-hook (test_slow_forward):
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
        opt_(build_optimizer(cfg, lr_, *model_.params, pg_, model_.fsdp)),
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
    if (const auto signals = dist::parse_signals(cfg.stop_signals); !signals.empty())
      stop_.emplace(signals);
  }

  // --save: rank 0 can write there, checked before the run whose result it is to hold.
  void check_save_path();
  // --resume: continue from a checkpoint file, or with "auto" from the newest beside --save
  // that verifies.
  void resume();
  // The two header lines; then the per-step record (--metrics) opens.
  void start();
  bool done() const { return pos_.epoch >= cfg_.epochs || reached_max_steps() || stopped_by_ != 0; }
  // The signal that stopped the run after the current step (Note [Preemption] in
  // lockstep/distributed/preemption.h), or 0.
  int stopped_by() const { return stopped_by_; }

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
  bool save_step(bool epoch_end);
  bool stop_agreed(bool epoch_end);
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
  std::optional<dist::StopOnSignal> stop_;  // --stop-signals
  int stopped_by_ = 0;
  int64_t saved_step_ = -1;  // the step of the last periodic checkpoint written
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
  // (Note [Rescaling] in train_fashion_mnist_position.h).
  scheduler_.set_step(pos_.step);
  log_rank0(LogLevel::kInfo, "resumed ", path, ": step ", pos_.step, ", epoch ", pos_.epoch,
            " after ", pos_.epoch_consumed, " of its samples (written by ", ckpt.world_size,
            " ranks, now ", world_, ")");
  report_rescaled_lr(ckpt, path);
}

// Rank 0 says when the base learning rate differs from the checkpoint's run's (Note
// [Rescaling] in train_fashion_mnist_position.h).
void Trainer::report_rescaled_lr(const io::TrainingCheckpoint& ckpt,
                                 const std::string& path) const {
  if (!main_rank_) return;
  // A checkpoint without user.scaled_lr was written with this run's flags at its world size.
  const double before = recorded_scaled_lr(ckpt, path).value_or(
      scaled_lr(cfg_, effective_batch_of(cfg_, static_cast<int>(ckpt.world_size))));
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
  const std::optional<EpochLoss> loss = epoch_loss_of(ckpt, path);
  if (!loss) {
    if (pos_.epoch_consumed > 0)
      log_rank0(LogLevel::kInfo, "--resume ", path, " records no losses of epoch ", pos_.epoch,
                " (an older checkpoint): its train_loss will cover the steps from here on");
    return;
  }
  double mean = 0;
  for (double v : loss->sums) mean += v;
  mean /= static_cast<double>(loss->sums.size());
  pos_.epoch_loss_sum =
      static_cast<int>(loss->sums.size()) == world_ ? loss->sums[pg_->rank()] : mean;
  pos_.epoch_loss_steps = loss->steps;
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
  if (cfg_.uneven && model_.parallel) {
    join.emplace(*model_.parallel,
                 dist::JoinOptions{.optimizer = opt_.get(),
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
    if (stop_agreed(epoch_end) || reached_max_steps()) break;
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
// updates. With --uneven and --zero 1, 2 or 3 a rank out of data runs it too, over the others'
// averaged gradients, so that its shard moves with theirs (Note [Join and ZeRO], Note [Join and
// FSDP]).
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
  save_step(epoch_end);
}

// The checkpoint of the step just taken, as <--save>.step<N>.<ext>, where --resume auto looks.
bool Trainer::save_step(bool epoch_end) {
  const std::string path = io::checkpoint_path_for_step(cfg_.save, pos_.step);
  if (spared(path)) {
    log_rank0(LogLevel::kWarning, "not saving step ", pos_.step, " to ", path,
              ": it holds the corrupt checkpoint --resume auto skipped, left for you to inspect; "
              "remove or move it to let this run write there");
    return false;
  }
  // At the end of an epoch, the position is the next epoch's start.
  const Position at = epoch_end ? Position{.step = pos_.step, .epoch = pos_.epoch + 1} : pos_;
  dist::save_checkpoint(*pg_, path, checkpoint(at), cfg_.keep, spare_);
  log_rank0(LogLevel::kInfo, "saved ", path);
  saved_step_ = pos_.step;
  return true;
}

// --stop-signals (Note [Preemption] in lockstep/distributed/preemption.h): after each optimizer
// step the ranks agree whether any of them caught one of the signals. If so, the step's
// checkpoint is saved (unless --save-every just wrote it), and the run ends after this step,
// the last one too (no evaluation, no final save: the cluster's time is short).
bool Trainer::stop_agreed(bool epoch_end) {
  if (!stop_) return false;
  stopped_by_ = stop_->agreed(*pg_);
  if (stopped_by_ == 0) return false;
  const bool saved = !cfg_.save.empty() && (saved_step_ == pos_.step || save_step(epoch_end));
  if (!saved) {
    log_rank0(LogLevel::kWarning, "stopped by ", dist::signal_name(stopped_by_), " after step ",
              pos_.step, "; nothing saved", cfg_.save.empty() ? " (no --save)" : "");
  } else {
    log_rank0(LogLevel::kInfo, "stopped by ", dist::signal_name(stopped_by_), " after step ",
              pos_.step, ", saved as ", io::checkpoint_path_for_step(cfg_.save, pos_.step),
              "; --resume auto goes on from there");
  }
  return true;
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
  put_position(ckpt.user, sums.to_vector<double>(), at.epoch_loss_steps, lr_);
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
    if (trainer.stopped_by() != 0) {  // --stop-signals: saved; no evaluation, no final save
      dist::destroy_process_group();
      return dist::StopOnSignal::exit_code(trainer.stopped_by());
    }
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
