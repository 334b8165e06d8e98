// The command line of examples/train_gpt: its settings, every flag with its range, and the checks
// that span several flags. The numeric-flag helpers (Range, add_number, usage_error) are the
// Fashion-MNIST example's, so both programs read numbers alike (Note [Numeric flags]).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/base/env_var.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/data/text_corpus.h"
#include "lockstep/distributed/preemption.h"
#include "train_fashion_mnist_flags.h"

namespace lockstep::examples {

// Where `train_gpt --prepare` writes and training reads, unless --out / --data say otherwise.
constexpr const char* kDefaultGptDataDir = "gpt-data";

// Whether a --save or --resume path names a sharded checkpoint (a directory each rank writes its
// part of, io/sharded_checkpoint.h) rather than one file: any path but one ending in
// ".safetensors". Decided by the name alone, so every rank decides alike before anything exists.
inline bool is_sharded_checkpoint_path(const std::string& path) {
  return !path.empty() && !path.ends_with(".safetensors");
}

struct GptConfig {
  // --prepare [FILES...]: turn text files (none: the fortunes corpus) into token files and stop.
  bool prepare = false;
  std::vector<std::string> prepare_files;
  std::string fortunes_dir = data::kDefaultFortunesDir;
  std::string out = kDefaultGptDataDir;  // --prepare's output directory

  // Training.
  std::string data = kDefaultGptDataDir;  // the directory with train.tokens and val.tokens
  int64_t block_size = 128;               // tokens per example (T), the longest context
  int64_t batch_size = 16;                // examples per rank and micro-batch (B)
  uint64_t seed = 0;                      // the model's init and the sampler's shuffle
  // The model (examples/gpt_model.h).
  std::string preset;  // "gpt2-124m": GPT-2 small's shape (Note [GPT-2 124M preset])
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  int64_t vocab_size = 0;  // the model's vocabulary; 0: the data's (256 byte tokens)
  bool plan = false;       // --plan: print the model's size and cost, train nothing
  // The optimization: AdamW, warmup then cosine decay to min_lr_factor * lr over max_steps.
  int64_t max_steps = 300;
  int64_t warmup_steps = 30;
  double lr = 2e-3;
  double min_lr_factor = 0.1;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;  // 0: no clipping
  int64_t accum_steps = 1;
  std::string amp = "none";  // or "bf16"
  int64_t zero = 0;  // 1: ZeRO-1 (dist::ZeroRedundancyOptimizer); 2, 3: FSDP (ZeRO-2, ZeRO-3)
  std::string param_dtype = "f32";   // --zero 2/3: the dtype units gather and compute in
  std::string reduce_dtype = "f32";  // --zero 2/3: the dtype gradients are reduced in
  bool zero_reduce_scatter = false;  // --zero 1 with DDP's buckets reduce-scattered (Note [ZeRO-1])
  // Reporting.
  int64_t eval_every = 25;   // a log line with the validation loss every N steps
  int64_t eval_batches = 8;  // batches per rank of the validation windows per evaluation
  std::string metrics;       // JSON Lines per step and evaluation (rank 0)
  int64_t sample = 0;        // bytes generated at the end (rank 0)
  double temperature = 0.8;
  int64_t top_k = 40;
  // Checkpoints, as train_fashion_mnist: a file when --save ends in ".safetensors", else a
  // sharded directory (is_sharded_checkpoint_path).
  std::string save;
  int64_t save_every = 0;
  std::string stop_signals = "TERM";  // Note [Preemption]: stop after the step, save, exit 128+N
  int64_t keep = 0;
  std::string resume;       // a checkpoint file or directory, or "auto": the latest beside --save
  bool async_save = false;  // periodic sharded checkpoints written in the background
  std::string init;         // start from these model weights (safetensors) instead of GPT-2's init
  bool no_shuffle = false;  // the windows in file order, every epoch
  std::string test_sample_log;  // testing only: Note [Sample log]
  // Execution.
  int64_t threads = 0;
  int64_t workers = 1;
  std::string device = "cpu";  // or "cuda": each rank on its local GPU (cuda:LOCAL_RANK)
  std::string backend;         // empty: LOCKSTEP_BACKEND, else nccl with --device cuda, else auto
  double timeout = 0;
};

// Note [GPT-2 124M preset]
// `--preset gpt2-124m` is GPT-2 small as llm.c trains it: 12 blocks of 12 heads, 768 wide, a
// context of 1024, the vocabulary padded from GPT-2's 50257 tokens to 50304 (a multiple of 128,
// so that the output layer's GEMM fills whole tiles on a GPU), the head tied to the token
// embedding and GPT-2's init (both as every train_gpt model has them), and GPT-3's peak learning
// rate for that size, 6e-4. The data stays byte tokens: only the first 256 rows of the
// embedding are ever looked up and the other rows learn to predict nothing, but every step
// pays for the full vocabulary, as GPT-2's does. 124,475,904 parameters. A flag given beside
// the preset overrides its value (`--preset gpt2-124m --block-size 256`).
struct GptPreset {
  int64_t n_layer, n_head, n_embd, block_size, vocab_size;
  double lr;
};
constexpr GptPreset kGpt2Small{.n_layer = 12,
                               .n_head = 12,
                               .n_embd = 768,
                               .block_size = 1024,
                               .vocab_size = 50304,
                               .lr = 6e-4};

// Upper bound of --vocab-size: the output layer is (vocabulary, C) and each step's logits are
// (B T, vocabulary).
constexpr int64_t kMaxVocabSize = 1 << 20;

// Upper bound of --block-size: a window is copied per sample, and the model's attention is
// (T, T) per head.
constexpr int64_t kMaxBlockSize = 1 << 16;

// Reads the command line into `cfg`. Returns -1 when the program should run, else the exit code
// (0 after --help; kUsageError with the reason printed).
inline int parse_gpt_flags(int argc, char** argv, GptConfig& cfg) {
  using I = Range<int64_t>;
  using R = Range<double>;
  CLI::App app{
      "Train a GPT-2 style byte-level language model with lockstep (vocabulary 256: any UTF-8 "
      "text trains without a tokenizer). First prepare the data: train_gpt --prepare [FILES...] "
      "--out DIR."};
  CLI::Option* prepare =
      app.add_option("--prepare", cfg.prepare_files,
                     "Check the UTF-8 text FILES, concatenate them and split them 90/10 into "
                     "DIR/train.tokens and DIR/val.tokens (byte tokens), then stop. With no "
                     "FILES: the fortunes corpus (--fortunes-dir)")
          ->expected(0, CLI::detail::expected_max_vector_size)
          ->type_name("FILES...");
  app.add_option("--out", cfg.out, "--prepare's output directory")->capture_default_str();
  app.add_option("--fortunes-dir", cfg.fortunes_dir,
                 "Where the Debian package fortunes keeps its text files (--prepare's default)")
      ->capture_default_str();
  app.add_option("--data", cfg.data, "Directory with train.tokens and val.tokens")
      ->capture_default_str();
  add_number(app, "--block-size", cfg.block_size, I{1, kMaxBlockSize}, "Tokens per example (T)");
  add_number(app, "--batch-size", cfg.batch_size, I{1, kMaxCount}, "Examples per rank and step");
  add_number(app, "--seed", cfg.seed, Range<uint64_t>{0},
             "Seed of the model's init and the data order");
  app.add_option("--preset", cfg.preset,
                 "A model shape by name: gpt2-124m (GPT-2 small: 12 layers, 12 heads, 768 wide, "
                 "--block-size 1024, --vocab-size 50304, --lr 6e-4); flags given beside it win")
      ->check(CLI::IsMember({"gpt2-124m"}));
  add_number(app, "--n-layer", cfg.n_layer, I{1, 1024}, "Transformer blocks");
  add_number(app, "--n-head", cfg.n_head, I{1, 1024}, "Attention heads (divide --n-embd)");
  add_number(app, "--n-embd", cfg.n_embd, I{1, 1 << 16}, "Width of the residual stream (C)");
  add_number(app, "--vocab-size", cfg.vocab_size, I{0, kMaxVocabSize},
             "The model's vocabulary, padded beyond the data's 256 byte tokens (0: the data's)");
  app.add_flag("--plan", cfg.plan,
               "Print the model's parameters, FLOPs per token and the memory of its weights, "
               "gradients and AdamW moments, then stop (nothing built, no data needed)");
  add_number(app, "--max-steps", cfg.max_steps, I{1, kMaxCount},
             "Optimizer steps of the whole run (the cosine decay ends there)");
  add_number(app, "--warmup-steps", cfg.warmup_steps, I{0, kMaxCount},
             "Steps of linear warmup before the cosine decay");
  add_number(app, "--lr", cfg.lr, R{0}, "Peak learning rate");
  add_number(app, "--min-lr-factor", cfg.min_lr_factor, R{0, 1},
             "The cosine ends at this times --lr");
  add_number(app, "--weight-decay", cfg.weight_decay, R{0},
             "AdamW's decoupled weight decay (matrices only, not biases or LayerNorm)");
  add_number(app, "--beta1", cfg.beta1, R{0, 1, true}, "AdamW's beta1");
  add_number(app, "--beta2", cfg.beta2, R{0, 1, true}, "AdamW's beta2");
  add_number(app, "--grad-clip", cfg.grad_clip, R{0}, "Clip the gradients' global norm (0: off)");
  add_number(app, "--accum-steps", cfg.accum_steps, I{1, kMaxCount},
             "Micro-batches whose gradients one optimizer step sums");
  app.add_option("--amp", cfg.amp, "Mixed precision: autocast to bf16")
      ->check(CLI::IsMember({"none", "bf16"}))
      ->capture_default_str();
  add_number(app, "--zero", cfg.zero, I{0, 3},
             "1: ZeRO-1, each rank keeps the AdamW moments of its shard only; 2: FSDP, each rank "
             "keeps its shard of the parameters, gradients and moments, a block gathered whole "
             "from its forward to its backward; 3: FSDP freeing each block's parameters after "
             "its forward (the least memory)");
  app.add_option("--param-dtype", cfg.param_dtype,
                 "With --zero 2 or 3: gather the blocks and compute in bf16 over f32 master "
                 "shards (FSDP's mixed precision: half the gathers' bytes and memory)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  app.add_option("--reduce-dtype", cfg.reduce_dtype,
                 "With --zero 2 or 3: reduce-scatter the gradients in f32 or in bf16 (half the "
                 "bytes)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  app.add_flag("--zero-reduce-scatter", cfg.zero_reduce_scatter,
               "With --zero 1: reduce-scatter DDP's buckets into the shards during backward and "
               "overlap the parameters' all-gather with the next forward");
  add_number(app, "--eval-every", cfg.eval_every, I{1, kMaxCount},
             "A log line with the validation loss every N steps (and at the last)");
  add_number(app, "--eval-batches", cfg.eval_batches, I{1, kMaxCount},
             "Validation batches per rank in an evaluation");
  app.add_option("--metrics", cfg.metrics, "Write JSON Lines metrics here (rank 0)");
  add_number(app, "--sample", cfg.sample, I{0, kMaxCount},
             "At the end, print N bytes the model generates (rank 0)");
  add_number(app, "--temperature", cfg.temperature, R{0, 1e6, true}, "Sampling temperature");
  add_number(app, "--top-k", cfg.top_k, I{1, 1 << 16}, "Sample among the k likeliest bytes");
  app.add_option(
      "--save", cfg.save,
      "Checkpoint at the end (and with --save-every beside it): one file when the "
      "path ends in .safetensors, else a sharded directory each rank writes its part of");
  add_number(app, "--save-every", cfg.save_every, I{0}, "A checkpoint every N steps (0: none)");
  add_number(app, "--keep", cfg.keep, I{0}, "Keep the newest N periodic checkpoints (0 = all)");
  app.add_option("--resume", cfg.resume,
                 "Continue from a checkpoint file, a sharded checkpoint directory, or 'auto': the "
                 "newest beside --save");
  app.add_option("--stop-signals", cfg.stop_signals,
                 "On these signals (comma-separated names or numbers; 'none' for none) every "
                 "rank finishes its step, the job saves a checkpoint beside --save that "
                 "--resume auto finds, and exits with 128 + the signal (143 for TERM)")
      ->capture_default_str();
  app.add_flag("--async-save", cfg.async_save,
               "With a sharded --save: write the --save-every checkpoints in the background "
               "while training goes on (the step only copies its part to host memory)");
  app.add_option("--init", cfg.init,
                 "Start from the model weights in this safetensors file (a train_gpt "
                 "checkpoint's model, or the names of its model without 'model.', as "
                 "bench/pytorch_gpt.py --save-init writes them) instead of GPT-2's random init; "
                 "the optimizer starts afresh, and a resumed run takes the checkpoint's weights");
  app.add_option("--test-sample-log", cfg.test_sample_log,
                 "Testing only (the sharded-checkpoint test): every rank appends to this file, "
                 "after each optimizer step, one line 'restart=R step=S epoch=E rank=K "
                 "world_size=W samples=I,J,...' (the indices of the step's token windows on that "
                 "rank, in order), each line one O_APPEND write")
      ->type_name("PATH");
  app.add_flag("--no-shuffle", cfg.no_shuffle,
               "Read the training windows in file order every epoch (to compare step for step "
               "with another program, e.g. bench/pytorch_gpt.py --no-shuffle)");
  add_number(app, "--threads", cfg.threads, I{0, kMaxThreads},
             "Intra-op threads (0 = OMP_NUM_THREADS or all cores)");
  add_number(app, "--workers", cfg.workers, I{0, kMaxThreads}, "DataLoader worker threads");
  app.add_option("--device", cfg.device,
                 "Where the model trains: cpu, or cuda (each rank on its local GPU, "
                 "cuda:LOCAL_RANK)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--backend", cfg.backend,
                 "DDP's process group backend (default: LOCKSTEP_BACKEND, else nccl with "
                 "--device cuda, else auto)")
      ->check(CLI::IsMember(dist::backend_names()));
  add_number(app, "--timeout", cfg.timeout, R{0, dist::kMaxTimeoutS, true},
             "Seconds a collective waits for the other ranks");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kUsageError;
  }
  cfg.prepare = prepare->count() > 0;
  if (cfg.preset == "gpt2-124m") {
    const GptPreset& p = kGpt2Small;
    const auto unless_given = [&](const char* flag, auto& field, auto value) {
      if (app.get_option(flag)->count() == 0) field = value;
    };
    unless_given("--n-layer", cfg.n_layer, p.n_layer);
    unless_given("--n-head", cfg.n_head, p.n_head);
    unless_given("--n-embd", cfg.n_embd, p.n_embd);
    unless_given("--block-size", cfg.block_size, p.block_size);
    unless_given("--vocab-size", cfg.vocab_size, p.vocab_size);
    unless_given("--lr", cfg.lr, p.lr);
  }
  // CLI11 gives a bare `--prepare` one empty value; no file has an empty name.
  std::erase(cfg.prepare_files, std::string());
  if (!cfg.prepare && app.get_option("--out")->count() > 0)
    return usage_error("--out is where --prepare writes; without --prepare it does nothing");
  if ((cfg.save_every > 0 || cfg.resume == "auto") && cfg.save.empty())
    return usage_error(std::string(cfg.save_every > 0 ? "--save-every" : "--resume auto") +
                       " needs --save: where the checkpoints go");
  if (cfg.zero < 2 && (cfg.param_dtype != "f32" || cfg.reduce_dtype != "f32"))
    return usage_error(std::string(cfg.param_dtype != "f32" ? "--param-dtype" : "--reduce-dtype") +
                       " is FSDP's mixed precision: it needs --zero 2 or 3, got --zero " +
                       std::to_string(cfg.zero) + " (for DDP, --amp bf16)");
  try {
    dist::parse_signals(cfg.stop_signals);
  } catch (const std::exception& e) {
    return usage_error(std::string("--stop-signals: ") + e.what());
  }
  if (cfg.async_save && !is_sharded_checkpoint_path(cfg.save))
    return usage_error("--async-save needs a sharded --save (a path not ending in .safetensors)");
  if (cfg.n_embd % cfg.n_head != 0)
    return usage_error("--n-embd " + std::to_string(cfg.n_embd) +
                       " must be divisible by --n-head " + std::to_string(cfg.n_head));
  if (cfg.warmup_steps >= cfg.max_steps)
    return usage_error("--warmup-steps must be below --max-steps");
  if (cfg.prepare && cfg.plan) return usage_error("--plan and --prepare: choose one");
  if (cfg.prepare || cfg.plan) return -1;
  if (const int rc = check_device_flags(cfg.device, cfg.backend); rc >= 0) return rc;
  // CUDA tensors go through NCCL unless the user says otherwise, as in PyTorch.
  if (cfg.device == "cuda" && cfg.backend.empty() && !env_string(env::kBackend))
    cfg.backend = "nccl";
  return -1;
}

}  // namespace lockstep::examples
