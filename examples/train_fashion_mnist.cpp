// Trains an MLP or a small CNN on Fashion-MNIST in one process: the program a user copies.
//
//   train_fashion_mnist --model cnn --epochs 1 --batch-size 64 --lr 0.05 --momentum 0.9
//
// Each epoch prints the mean training loss, throughput and test accuracy; the last line is
// machine-readable: "final test_accuracy=... train_loss=... steps=... samples_per_s=...".
#include <CLI/CLI.hpp>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "fashion_mnist_models.h"
#include "lockstep/base/log.h"
#include "lockstep/data/data.h"
#include "lockstep/distributed/checkpoint.h"
#include "lockstep/io/checkpoint.h"
#include "lockstep/io/metrics.h"
#include "lockstep/io/progress.h"
#include "lockstep/lockstep.h"
#include "lockstep/nn/layers.h"
#include "lockstep/optim/optimizer.h"

using namespace lockstep;

namespace {

// Exit code for bad command-line input (as CLI11 and most tools use).
constexpr int kUsageError = 2;
constexpr int64_t kEvalBatch = 1000;

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
  int threads = 0;
  int64_t log_every = 100;
  bool eval = true;
  int64_t workers = 1;
  std::string save;           // checkpoint path (rank 0 writes)
  int64_t save_every = 0;     // optimizer steps between periodic checkpoints (0: only at the end)
  int64_t keep = 0;           // periodic checkpoints kept (0: all)
  std::string resume;         // a checkpoint file, or "auto": the latest beside --save
  int64_t crash_at_step = 0;  // testing: the last rank kills itself after this step (attempt 0)
  std::string metrics;        // JSON Lines of per-step metrics (rank 0)
  double bucket_mb = 25.0;
  std::string comm_hook = "none";
  bool ddp_stats = false;
  int64_t dp = 1;
  std::string amp = "none";         // none | bf16 | fp16
  int64_t accum_steps = 1;          // micro-batches per optimizer step
  std::string lr_scaling = "none";  // linear | sqrt | none, relative to base_batch
  int64_t base_batch = 64;
  int64_t warmup_steps = 0;
  std::string schedule = "constant";  // constant | cosine
  double clip_grad_norm = 0.0;        // 0: no clipping
};

// The learning rate for an effective batch: the article's rule, more devices -> larger batch ->
// larger rate (linear, or sqrt for adaptive optimizers), relative to the batch `lr` was tuned at.
double scaled_lr(const Config& cfg, int64_t effective_batch) {
  const double ratio = static_cast<double>(effective_batch) / static_cast<double>(cfg.base_batch);
  if (cfg.lr_scaling == "linear") return cfg.lr * ratio;
  if (cfg.lr_scaling == "sqrt") return cfg.lr * std::sqrt(ratio);
  return cfg.lr;
}

// Each rank evaluates its share of the test set (the non-padding sampler: every sample once over
// all ranks); the counts are summed across ranks.
double evaluate(nn::Module& model, const data::MnistDataset& test, dist::ProcessGroup& pg) {
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
    Tensor logits = model.forward(index_select(test.images(), 0, which));  // (n,10)
    correct += static_cast<int64_t>(
        sum(eq(argmax(logits, 1), index_select(test.labels(), 0, which))).item());
  }
  counts.set_at({0}, static_cast<double>(correct));
  counts.set_at({1}, static_cast<double>(idx.size()));
  pg.all_reduce(counts)->wait();
  model.train();
  return counts.at({0}) / counts.at({1});
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

// The first attempt of a run (not a restart by `lockstep run --max-restarts`).
bool first_attempt() {
  const char* restart = std::getenv("LOCKSTEP_RESTART_COUNT");
  return restart == nullptr || std::string(restart) == "0";
}

int run(const Config& cfg) {
  if (cfg.threads > 0) set_num_threads(cfg.threads);
  data::MnistOptions mopts;
  mopts.normalize = true;
  auto train = data::load_mnist(cfg.data, data::Split::kTrain, mopts);
  auto test = cfg.eval ? data::load_mnist(cfg.data, data::Split::kTest, mopts) : nullptr;

  // A world of one without launcher variables; under `lockstep run` (or torchrun's variables)
  // one rank of a DDP job, each on its own shard of the data.
  auto pg = dist::init_process_group();
  const int world = pg->size();
  const bool main_rank = pg->rank() == 0;  // only rank 0 prints and saves

  Generator gen(cfg.seed);
  auto model = examples::build_fashion_mnist_model(cfg.model, gen);
  // --dp K: DataParallel, K replicas on threads in this one process (the baseline).
  std::unique_ptr<dist::DataParallel> dp;
  if (cfg.dp > 1) {
    LS_CHECK(world == 1, "--dp runs in one process; it cannot be combined with WORLD_SIZE=", world);
    dp = std::make_unique<dist::DataParallel>(
        [&] {
          Generator g(cfg.seed);
          return examples::build_fashion_mnist_model(cfg.model, g);
        },
        static_cast<int>(cfg.dp));
    model = dp->module();
  }
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  if (world > 1) {
    dist::DDPOptions dopts;
    dopts.bucket_bytes = static_cast<int64_t>(cfg.bucket_mb * (1 << 20));
    dopts.comm_hook = comm_hook_named(cfg.comm_hook);
    ddp = std::make_shared<dist::DistributedDataParallel>(model, pg, dopts);
  }
  nn::Module& net = ddp ? static_cast<nn::Module&>(*ddp) : *model;
  const int64_t effective_batch = cfg.batch_size * cfg.accum_steps * world;
  const double lr = scaled_lr(cfg, effective_batch);
  optim::SGD opt(model->parameters(),
                 {.lr = lr, .momentum = cfg.momentum, .weight_decay = cfg.weight_decay});
  auto sampler =
      std::make_shared<data::DistributedSampler>(train->size(), world, pg->rank(), true, cfg.seed);
  data::DataLoader loader(
      train, sampler, {.batch_size = cfg.batch_size, .num_workers = cfg.workers, .prefetch = 4});
  // The schedule counts optimizer steps (a step is accum_steps micro-batches).
  const int64_t full_epoch_batches = loader.num_batches();
  const int64_t steps_per_epoch = (full_epoch_batches + cfg.accum_steps - 1) / cfg.accum_steps;
  int64_t total_steps = steps_per_epoch * cfg.epochs;
  if (cfg.max_steps > 0) total_steps = std::min(total_steps, cfg.max_steps);
  optim::Schedule schedule = optim::constant_schedule();
  if (cfg.schedule == "cosine") {
    LS_CHECK(total_steps > cfg.warmup_steps, "--warmup-steps ", cfg.warmup_steps,
             " leaves nothing of the ", total_steps, " optimizer steps for the cosine decay");
    schedule = cfg.warmup_steps > 0 ? optim::warmup_cosine(cfg.warmup_steps, total_steps)
                                    : optim::cosine_decay(total_steps);
  } else if (cfg.warmup_steps > 0) {
    schedule = optim::linear_warmup(cfg.warmup_steps);
  }
  optim::LRScheduler scheduler(opt, schedule);
  // f16 needs loss scaling (its range ends at 65504); bf16 has f32's range and does without.
  amp::GradScaler scaler({.enabled = cfg.amp == "fp16"});

  // Where training stands: optimizer steps taken in all, and within `epoch` the samples all
  // ranks together consumed. A checkpoint stores exactly this.
  int64_t steps = 0, epoch = 0, epoch_consumed = 0;
  std::vector<std::string> param_names;
  for (const auto& [name, p] : model->named_parameters()) param_names.push_back(name);
  auto checkpoint = [&] {
    io::TrainingCheckpoint ckpt;
    ckpt.model = model->state_dict();
    ckpt.optimizer = opt.state_dict();
    ckpt.optimizer_param_names = param_names;
    if (scaler.is_enabled()) ckpt.scaler = scaler.state_dict();
    ckpt.step = steps;
    ckpt.epoch = epoch;
    ckpt.epoch_samples = epoch_consumed;
    ckpt.world_size = world;
    ckpt.rng["init"] = {gen.seed(), gen.offset()};
    ckpt.user = run_metadata(cfg);
    return ckpt;
  };
  if (!cfg.resume.empty()) {
    const std::string path = dist::resolve_resume(*pg, cfg.resume, cfg.save);
    if (path.empty()) {
      log_rank0(LogLevel::kInfo, "resume: no checkpoint beside ", cfg.save,
                " yet, starting from step 0");
    } else {
      io::TrainingCheckpoint ckpt = dist::load_checkpoint(*pg, path);
      try {
        model->load_state_dict(ckpt.model);
      } catch (const Error& e) {
        LS_THROW("--resume ", path, " holds another model than --model ", cfg.model, ": ",
                 e.message());
      }
      for (const auto& [key, value] : run_metadata(cfg)) {
        auto it = ckpt.user.find(key);
        if (main_rank && (it == ckpt.user.end() || it->second != value))
          log_warning("--resume ", path, " was written with --", key, " ",
                      it == ckpt.user.end() ? "(unset)" : it->second, ", this run has --", key, " ",
                      value);
      }
      opt.load_state_dict(ckpt.optimizer);
      if (scaler.is_enabled()) scaler.load_state_dict(ckpt.scaler);
      if (auto it = ckpt.rng.find("init"); it != ckpt.rng.end()) {
        gen.manual_seed(it->second.seed);
        gen.set_offset(it->second.offset);
      }
      steps = ckpt.step;
      epoch = ckpt.epoch;
      epoch_consumed = ckpt.epoch_samples;
      scheduler.set_step(steps);
      log_rank0(LogLevel::kInfo, "resumed ", path, ": step ", steps, ", epoch ", epoch, " after ",
                epoch_consumed, " of its samples (written by ", ckpt.world_size, " ranks, now ",
                world, ")");
    }
  }
  if (main_rank && !cfg.save.empty() && cfg.save_every > 0) {
    // Periodic checkpoints of later steps (another run's, or an older checkpoint resumed on
    // purpose) would win over this run's in a later --resume auto.
    for (const auto& [step, path] : io::list_checkpoints(cfg.save))
      if (step > steps)
        log_warning(path, " is of step ", step, ", later than this run's step ", steps,
                    ": --resume auto would pick it over this run's checkpoints until this run "
                    "passes that step; remove it if it belongs to another run");
  }
  if (main_rank) {
    std::printf(
        "model=%s params=%lld threads=%d train=%lld test=%lld batch=%lld world_size=%d "
        "global_batch=%lld\n",
        cfg.model.c_str(), static_cast<long long>(model->num_parameters()), get_num_threads(),
        static_cast<long long>(train->size()), static_cast<long long>(test ? test->size() : 0),
        static_cast<long long>(cfg.batch_size), world,
        static_cast<long long>(cfg.batch_size * world));
    std::printf(
        "amp=%s accum_steps=%lld effective_batch=%lld lr=%g (scaling %s from base batch %lld) "
        "schedule=%s warmup_steps=%lld optimizer_steps=%lld\n",
        cfg.amp.c_str(), static_cast<long long>(cfg.accum_steps),
        static_cast<long long>(effective_batch), lr, cfg.lr_scaling.c_str(),
        static_cast<long long>(cfg.base_batch), cfg.schedule.c_str(),
        static_cast<long long>(cfg.warmup_steps), static_cast<long long>(total_steps));
  }

  // Rank 0 records every optimizer step (--metrics) and, on a terminal, draws a progress bar in
  // place of the periodic loss lines.
  std::optional<io::MetricsWriter> metrics;
  if (main_rank && !cfg.metrics.empty()) {
    const auto dir = std::filesystem::path(cfg.metrics).parent_path();
    std::error_code ec;
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);  // else open says why
    metrics.emplace(cfg.metrics);
  }
  const char* launcher_tty = std::getenv("LOCKSTEP_STDOUT_IS_TTY");
  const bool terminal = launcher_tty ? std::string(launcher_tty) == "1" : ::isatty(1) == 1;
  io::Progress progress({.terminal = true, .enabled = main_rank && terminal});

  using Clock = std::chrono::steady_clock;
  int64_t samples = 0;
  double train_seconds = 0, last_loss = 0, accuracy = -1;
  bool done = cfg.max_steps > 0 && steps >= cfg.max_steps;
  while (epoch < cfg.epochs && !done) {
    loader.set_epoch(epoch);
    sampler->set_start_index(epoch_consumed);  // 0 but in the epoch a checkpoint resumes
    const int64_t micro_per_epoch = loader.num_batches();
    double loss_sum = 0;
    int64_t epoch_steps = 0, epoch_samples = 0;
    const auto t0 = Clock::now();
    int64_t micro = 0;  // micro-batches since the last optimizer step
    double step_loss = 0;
    bool epoch_finished = micro_per_epoch == 0;
    // This epoch's optimizer steps, those taken before a resume included.
    const int64_t done_before = (full_epoch_batches - micro_per_epoch) / cfg.accum_steps;
    progress.start_epoch(epoch, steps_per_epoch);
    auto last_step_end = t0;
    int64_t step_samples = 0;
    for (data::Batch& batch : loader) {
      // The last micro-batch of a step (or of the epoch) communicates and steps; the others
      // accumulate locally inside no_sync().
      const bool last = micro + 1 == cfg.accum_steps || batch.index + 1 == micro_per_epoch;
      const double weight = 1.0 / static_cast<double>(cfg.accum_steps);
      std::optional<dist::DistributedDataParallel::NoSync> no_sync;
      if (ddp && !last) no_sync.emplace(*ddp);
      if (dp) {
        step_loss += dp->forward_backward(
            batch.input, batch.target,
            [&](const Tensor& out, const Tensor& t) { return mul(cross_entropy(out, t), weight); });
      } else {
        Tensor loss;
        {
          amp::autocast ac(cfg.amp == "fp16" ? kFloat16 : kBFloat16, cfg.amp != "none");
          Tensor logits = net.forward(batch.input);    // (B,10), bf16/f16 under autocast
          loss = cross_entropy(logits, batch.target);  // () in f32 always
        }
        scaler.scale(mul(loss, weight)).backward();
        step_loss += loss.item() * weight;
      }
      no_sync.reset();
      epoch_samples += batch.input.size(0);
      epoch_consumed += batch.input.size(0) * world;  // every rank read a batch as large
      step_samples += batch.input.size(0) * world;
      if (!last) {
        ++micro;
        continue;
      }
      micro = 0;
      std::optional<double> grad_norm;
      if (cfg.clip_grad_norm > 0) {
        scaler.unscale_(opt);
        grad_norm = optim::clip_grad_norm(model->parameters(), cfg.clip_grad_norm);
      }
      // What this step ran with, before update() and the scheduler move on to the next.
      const double loss_scale = scaler.get_scale();
      const double step_lr = scheduler.last_lr();
      scaler.step(opt);
      scaler.update();
      scheduler.step();
      opt.zero_grad();
      const double l = step_loss;
      step_loss = 0;
      loss_sum += l;
      ++epoch_steps;
      ++steps;
      const bool epoch_end = batch.index + 1 == micro_per_epoch;
      epoch_finished = epoch_end;
      const auto now = Clock::now();
      const double step_rate =
          step_samples / std::chrono::duration<double>(now - last_step_end).count();
      if (metrics) {
        metrics->write(io::TrainRecord{
            .step = steps,
            .epoch = epoch,
            .loss = l,
            .lr = step_lr,
            .samples_per_s = step_rate,
            .loss_scale = scaler.is_enabled() ? std::optional<double>(loss_scale) : std::nullopt,
            .grad_norm = grad_norm});
      }
      progress.update(done_before + epoch_steps, l, step_samples);
      last_step_end = now;
      step_samples = 0;
      if (cfg.save_every > 0 && steps % cfg.save_every == 0) {
        io::TrainingCheckpoint ckpt = checkpoint();
        if (epoch_end) ckpt.epoch = epoch + 1, ckpt.epoch_samples = 0;  // resume at the next one
        const std::string path = io::checkpoint_path_for_step(cfg.save, steps);
        dist::save_checkpoint(*pg, path, ckpt, cfg.keep);
        log_rank0(LogLevel::kInfo, "saved ", path);
      }
      if (cfg.crash_at_step > 0 && steps == cfg.crash_at_step && pg->rank() == world - 1 &&
          first_attempt()) {
        std::fprintf(stderr, "--crash-at-step %lld: rank %d kills itself\n",
                     static_cast<long long>(steps), pg->rank());
        ::kill(::getpid(), SIGKILL);
      }
      if (main_rank && !progress.enabled() && cfg.log_every > 0 && steps % cfg.log_every == 0)
        std::printf("epoch %lld step %lld loss %.4f lr %.5g%s\n", static_cast<long long>(epoch),
                    static_cast<long long>(steps), l, step_lr,
                    scaler.is_enabled()
                        ? (" loss_scale " + std::to_string(scaler.get_scale())).c_str()
                        : "");
      if (cfg.max_steps > 0 && steps >= cfg.max_steps) {
        done = true;
        break;
      }
    }
    progress.finish();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    train_seconds += secs;
    epoch_samples *= world;  // every rank processed as many
    samples += epoch_samples;
    // The mean training loss over all ranks.
    Tensor mean_loss =
        full({1}, epoch_steps ? loss_sum / static_cast<double>(epoch_steps) : 0.0, kFloat64);
    pg->all_reduce(mean_loss, {.op = dist::ReduceOp::avg})->wait();
    last_loss = mean_loss.item();
    if (test) accuracy = evaluate(*model, *test, *pg);
    if (metrics && test)
      metrics->write(io::EvalRecord{.step = steps, .epoch = epoch, .test_accuracy = accuracy});
    if (main_rank) {
      std::printf("epoch %lld train_loss %.4f samples/s %.1f test_accuracy %.4f data_wait %.1f%%\n",
                  static_cast<long long>(epoch), last_loss, epoch_samples / secs, accuracy,
                  100.0 * loader.wait_seconds() / secs);
    }
    loader.reset_wait_seconds();
    if (epoch_finished) ++epoch, epoch_consumed = 0;  // the next one starts at its first sample
  }
  if (!cfg.save.empty()) {
    dist::save_checkpoint(*pg, cfg.save, checkpoint());  // rank 0 writes, the others wait
    log_rank0(LogLevel::kInfo, "saved ", cfg.save);
  }
  if (ddp && cfg.ddp_stats && main_rank) std::printf("ddp: %s\n", ddp->stats().str().c_str());
  if (main_rank) {
    if (samples == 0)
      log_info("nothing left to train: step ", steps, " reached --max-steps / --epochs");
    std::printf("final test_accuracy=%.4f train_loss=%.4f steps=%lld samples_per_s=%.1f\n",
                accuracy, last_loss, static_cast<long long>(steps),
                train_seconds > 0 ? samples / train_seconds : 0.0);
  }
  dist::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line even into a pipe (`lockstep run`), so a killed run loses no printed line.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Config cfg;
  CLI::App app{"Train an MLP or a CNN on Fashion-MNIST with lockstep."};
  app.add_option("--data", cfg.data, "Directory with the Fashion-MNIST IDX files")
      ->capture_default_str();
  app.add_option("--model", cfg.model, "Model")
      ->check(CLI::IsMember({"mlp", "cnn"}))
      ->capture_default_str();
  app.add_option("--epochs", cfg.epochs, "Epochs")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-steps", cfg.max_steps,
                 "Stop after N optimizer steps of the run, those before a resumed checkpoint "
                 "included (0 = no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--batch-size", cfg.batch_size, "Batch size per process")->capture_default_str();
  app.add_option("--lr", cfg.lr, "Learning rate")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--momentum", cfg.momentum, "SGD momentum")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--weight-decay", cfg.weight_decay, "SGD weight decay")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--seed", cfg.seed, "Seed for initialisation and shuffling")
      ->capture_default_str();
  app.add_option("--threads", cfg.threads, "Intra-op threads (0 = OMP_NUM_THREADS or all cores)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-every", cfg.log_every, "Print the loss every N steps (0 = never)")
      ->capture_default_str();
  app.add_flag("--eval,!--no-eval", cfg.eval, "Evaluate on the test set after each epoch")
      ->capture_default_str();
  app.add_option("--workers", cfg.workers, "DataLoader worker threads")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--save", cfg.save,
                 "Checkpoint file (safetensors: model, optimizer, scaler, position), written by "
                 "rank 0 at the end and, with --save-every, beside it as <name>.step<N>.<ext>");
  app.add_option("--save-every", cfg.save_every,
                 "Checkpoint every N optimizer steps (0 = at the end only)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--keep", cfg.keep, "Keep the newest N periodic checkpoints (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--resume", cfg.resume,
                 "Continue from a checkpoint file, or 'auto': the newest beside --save if any");
  app.add_option("--metrics", cfg.metrics,
                 "Append per-step metrics as JSON Lines here (rank 0; `lockstep plot` draws them)");
  app.add_option("--crash-at-step", cfg.crash_at_step,
                 "Testing: the last rank kills itself (SIGKILL) after this optimizer step, on the "
                 "first attempt of a `lockstep run` only")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bucket-mb", cfg.bucket_mb, "DDP gradient bucket size in MiB")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--comm-hook", cfg.comm_hook, "DDP gradient compression on the wire")
      ->check(CLI::IsMember({"none", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--dp", cfg.dp, "DataParallel with K replicas on threads (one process)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--ddp-stats", cfg.ddp_stats, "Print DDP's bucket and communication statistics");
  app.add_option("--amp", cfg.amp, "Mixed precision: autocast to bf16, or fp16 with loss scaling")
      ->check(CLI::IsMember({"none", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--accum-steps", cfg.accum_steps,
                 "Micro-batches per optimizer step (gradient accumulation)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr-scaling", cfg.lr_scaling,
                 "Scale --lr with the effective batch (batch x accum x world) / --base-batch")
      ->check(CLI::IsMember({"linear", "sqrt", "none"}))
      ->capture_default_str();
  app.add_option("--base-batch", cfg.base_batch, "The batch size --lr was tuned for")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup-steps", cfg.warmup_steps,
                 "Linear learning-rate warmup (optimizer steps)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--schedule", cfg.schedule, "Learning-rate schedule after warmup")
      ->check(CLI::IsMember({"constant", "cosine"}))
      ->capture_default_str();
  app.add_option("--clip-grad-norm", cfg.clip_grad_norm, "Clip the gradient norm (0 = off)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kUsageError;
  }
  if (cfg.batch_size <= 0) {
    std::fprintf(stderr, "error: --batch-size must be a positive integer, got %lld\n",
                 static_cast<long long>(cfg.batch_size));
    return kUsageError;
  }
  if (cfg.dp > 1 && cfg.amp != "none") {
    std::fprintf(stderr,
                 "error: --amp runs in the calling thread's autocast scope; DataParallel's replica "
                 "threads have none, so --amp cannot be combined with --dp %lld\n",
                 static_cast<long long>(cfg.dp));
    return kUsageError;
  }
  if ((cfg.save_every > 0 || cfg.resume == "auto") && cfg.save.empty()) {
    std::fprintf(stderr, "error: %s needs --save PATH (where the checkpoints go)\n",
                 cfg.save_every > 0 ? "--save-every" : "--resume auto");
    return kUsageError;
  }
  if (!std::filesystem::is_directory(cfg.data)) {
    std::fprintf(stderr,
                 "error: --data %s is not a directory; install the Debian package "
                 "dataset-fashion-mnist or pass the directory holding the IDX files\n",
                 cfg.data.c_str());
    return kUsageError;
  }
  try {
    return run(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    dist::record_error(e.what());  // for `lockstep run`'s failure summary
    return 1;
  }
}
