// train_gpt's setup from its flags: --prepare, the token windows, the model (--init), FSDP and
// the optimizer for each --zero, what a checkpoint records of the position and settings, and the
// check that every rank was started with the same settings (Note [Same settings]).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpt_model.h"
#include "lockstep/base/env_var.h"
#include "lockstep/data/data.h"
#include "lockstep/distributed/fsdp.h"
#include "lockstep/distributed/sync_check.h"
#include "lockstep/distributed/zero.h"
#include "lockstep/io/safetensors.h"
#include "lockstep/lockstep.h"
#include "lockstep/optim/optimizer.h"
#include "lockstep/optim/schedule.h"
#include "train_gpt_flags.h"

namespace lockstep::examples {

// --prepare: a text file or directory as byte tokens, split 90/10 into --out/train.tokens and
// val.tokens, with a summary and the unigram entropy the trained model must beat.
inline int prepare(const GptConfig& cfg) {
  const bool fortunes = cfg.prepare_files.empty();
  const std::vector<std::string> files =
      fortunes ? data::fortunes_corpus_files(cfg.fortunes_dir) : cfg.prepare_files;
  if (fortunes)
    std::printf("prepare: the fortunes corpus, %zu files in %s\n", files.size(),
                cfg.fortunes_dir.c_str());
  const data::TextCorpusStats s = data::prepare_text_corpus(files, cfg.out);
  std::printf("prepare: %lld files, %lld bytes of UTF-8 text\n", static_cast<long long>(s.files),
              static_cast<long long>(s.total_bytes));
  std::printf("  train: %s  %lld tokens\n", s.train_path.c_str(),
              static_cast<long long>(s.train_tokens));
  std::printf("  val:   %s  %lld tokens\n", s.val_path.c_str(),
              static_cast<long long>(s.val_tokens));
  std::printf(
      "  unigram entropy of the training bytes: %.4f bits/byte = %.4f nats/byte (the loss of a "
      "model that knows only byte frequencies; a trained model's loss must go below it)\n",
      s.train_entropy_bits, s.train_entropy_nats);
  std::printf(
      "prepared files=%lld train_tokens=%lld val_tokens=%lld entropy_bits=%.6f "
      "entropy_nats=%.6f\n",
      static_cast<long long>(s.files), static_cast<long long>(s.train_tokens),
      static_cast<long long>(s.val_tokens), s.train_entropy_bits, s.train_entropy_nats);
  return 0;
}

// One split's windows: DIR/<split>.tokens cut into block_size windows (Note [Token windows]);
// each rank then reads its own shard of them through a DistributedSampler, and resumes from
// (epoch, samples consumed) as train_fashion_mnist does.
inline std::shared_ptr<data::TokenWindowDataset> open_split(const GptConfig& cfg,
                                                            const std::string& split) {
  auto tokens = std::make_shared<const data::TokenFile>(cfg.data + "/" + split + ".tokens");
  return std::make_shared<data::TokenWindowDataset>(
      tokens, data::TokenWindowOptions{.block_size = cfg.block_size});
}

// The unigram entropy (nats per byte) of the training tokens: the loss of a model that knows
// only byte frequencies, printed next to the validation loss a trained model must go below.
inline double unigram_entropy_nats(const data::TokenFile& tokens) {
  std::vector<int64_t> counts(static_cast<size_t>(tokens.vocab_size()), 0);
  for (int64_t i = 0; i < tokens.size(); ++i) ++counts[static_cast<size_t>(tokens[i])];
  double h = 0;
  for (int64_t c : counts)
    if (c > 0) {
      const double p = static_cast<double>(c) / static_cast<double>(tokens.size());
      h -= p * std::log(p);
    }
  return h;
}

// The device this rank trains on: the CPU, or with --device cuda the GPU init_process_group made
// current (cuda:LOCAL_RANK under the launcher).
inline Device train_device(const GptConfig& cfg) {
  return cfg.device == "cuda" ? cuda_device(cuda::current_device()) : kCPU;
}

// The model's vocabulary: --vocab-size, padded beyond the data's (Note [GPT-2 124M preset]),
// else the data's own.
inline int64_t model_vocab_size(const GptConfig& cfg, int64_t data_vocab) {
  LS_CHECK(cfg.vocab_size == 0 || cfg.vocab_size >= data_vocab, "--vocab-size ", cfg.vocab_size,
           " is below the vocabulary of the data (", data_vocab, " tokens in ", cfg.data,
           "/train.tokens): the model could not predict every token; give at least ", data_vocab,
           ", or 0 for the data's own");
  return cfg.vocab_size == 0 ? data_vocab : cfg.vocab_size;
}

// --init: the model's weights from a safetensors file, every parameter by name, shape and dtype
// (load_state_dict's strict check names the first that differs). The file's tensors are the
// model's: those of a train_gpt checkpoint under "model.", its optimizer state left out, or
// else all of them by their bare names.
inline void load_init(examples::Gpt& gpt, const std::string& path) {
  io::SafetensorsContents file;
  try {
    file = io::load_safetensors(path);
  } catch (const Error& e) {
    LS_THROW("--init ", path, ": ", e.what());
  }
  io::NamedTensors model;
  for (auto& [name, t] : file.tensors)
    if (name.rfind("model.", 0) == 0) model.emplace_back(name.substr(6), t);
  if (model.empty()) model = std::move(file.tensors);
  try {
    NoGradGuard no_grad;
    gpt.load_state_dict(model);
  } catch (const Error& e) {
    LS_THROW("--init ", path, ": its weights do not fit this model (--n-layer, --n-head, ",
             "--n-embd, --block-size, --vocab-size): ", e.what());
  }
}

// The model's shape from the flags, with its vocabulary.
inline examples::GptModelConfig model_config(const GptConfig& cfg, int64_t vocab_size) {
  return {.vocab_size = vocab_size,
          .block_size = cfg.block_size,
          .n_layer = cfg.n_layer,
          .n_head = cfg.n_head,
          .n_embd = cfg.n_embd};
}

// The model, initialized on the CPU from `gen` (the same values on any device), or from --init,
// then moved to `device` before DDP and the optimizer see its parameters.

inline std::shared_ptr<examples::Gpt> build_gpt(const GptConfig& cfg, int64_t vocab_size,
                                                Generator& gen, Device device) {
  auto gpt = std::make_shared<examples::Gpt>(model_config(cfg, vocab_size), gen);
  if (!cfg.init.empty()) load_init(*gpt, cfg.init);
  if (!device.is_cpu()) gpt->to(device);
  return gpt;
}

inline std::optional<std::chrono::milliseconds> timeout_of(const GptConfig& cfg) {
  if (cfg.timeout <= 0) return std::nullopt;
  return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(cfg.timeout * 1000)));
}

inline bool stdout_is_terminal() { return env_flag(env::kStdoutIsTty).value_or(::isatty(1) == 1); }

// Warmup then cosine decay to --min-lr-factor of --lr over all --max-steps optimizer steps.
inline optim::Schedule schedule_of(const GptConfig& cfg) {
  LS_CHECK(cfg.max_steps > cfg.warmup_steps, "expected --warmup-steps below --max-steps ",
           cfg.max_steps, ", got ", cfg.warmup_steps);
  return cfg.warmup_steps > 0
             ? optim::warmup_cosine(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_factor)
             : optim::cosine_decay(cfg.max_steps, cfg.min_lr_factor);
}

// --zero 2 and 3: FullyShardedDataParallel, one unit per transformer block, the embeddings (and
// the tied head) and the final LayerNorm in the root unit; 3 frees each block's parameters after
// its forward. Null otherwise.
inline std::shared_ptr<dist::FullyShardedDataParallel> build_fsdp(
    const GptConfig& cfg, const std::shared_ptr<examples::Gpt>& gpt,
    const std::shared_ptr<dist::ProcessGroup>& pg) {
  if (cfg.zero < 2) return nullptr;
  return std::make_shared<dist::FullyShardedDataParallel>(
      gpt, pg,
      dist::FSDPOptions{
          .reshard_after_forward = cfg.zero == 3,
          .wrap = dist::wrap_by_type({"GptBlock"}),
          .param_dtype = cfg.param_dtype == "bf16" ? std::optional<DType>(kBFloat16) : std::nullopt,
          .reduce_dtype = cfg.reduce_dtype == "bf16" ? kBFloat16 : kFloat32});
}

// AdamW over the GPT's two groups (gpt_param_groups); with --zero 1 wrapped so that each rank
// keeps the moments of its shard only (Note [ZeRO-1]); with --zero 2 or 3 over the shards FSDP
// keeps.
// --zero-reduce-scatter (more than one rank): DDP's buckets are reduce-scattered into the shards
// and the all-gathers waited for in the next forward.
inline std::unique_ptr<optim::Optimizer> build_optimizer(
    const GptConfig& cfg, const nn::Module& model, const std::shared_ptr<dist::ProcessGroup>& pg,
    dist::FullyShardedDataParallel* fsdp) {
  LS_CHECK(!cfg.zero_reduce_scatter || cfg.zero == 1,
           "--zero-reduce-scatter needs --zero 1, got --zero ", cfg.zero);
  const optim::AdamWOptions opts{.lr = cfg.lr,
                                 .beta1 = cfg.beta1,
                                 .beta2 = cfg.beta2,
                                 .eps = 1e-8,
                                 .weight_decay = cfg.weight_decay};
  std::vector<optim::ParamGroup> groups = examples::gpt_param_groups(model, cfg.weight_decay);
  if (cfg.zero == 0) return std::make_unique<optim::AdamW>(std::move(groups), opts);
  if (fsdp) {
    return fsdp->wrap_optimizer(groups, [opts](std::vector<optim::ParamGroup> g) {
      return std::make_unique<optim::AdamW>(std::move(g), opts);
    });
  }
  const bool scatter = cfg.zero_reduce_scatter && pg->size() > 1;
  return std::make_unique<dist::ZeroRedundancyOptimizer>(
      std::move(groups), pg,
      [opts](std::vector<optim::ParamGroup> g) {
        return std::make_unique<optim::AdamW>(std::move(g), opts);
      },
      dist::ZeroOptions{.reduce_scatter_gradients = scatter, .overlap_all_gather = scatter});
}

// The names of the optimizer's parameters in its order, which is gpt_param_groups' (the groups
// one after the other), not the module's: a checkpoint names the state "<index>.<field>" of
// index i "optim.<name i>.<field>" (Note [Checkpoint layout]), as FSDP's state_slices does.
inline std::vector<std::string> optimizer_param_names(const nn::Module& model,
                                                      double weight_decay) {
  const auto named = model.named_parameters();
  std::vector<std::string> names;
  for (const optim::ParamGroup& g : examples::gpt_param_groups(model, weight_decay))
    for (const Tensor& p : g.params)
      for (const auto& [name, q] : named)
        if (q.is_same(p)) names.push_back(name);
  return names;
}

// Where training stands: optimizer steps taken; the sampler epoch and the windows all ranks
// together consumed in it. A checkpoint stores exactly this (and resumes the data exactly, as
// the Fashion-MNIST example does).
struct Position {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t epoch_consumed = 0;
};

// The settings a checkpoint records so that a resumed run can say when it differs: the resume
// is exact either way, but what the steps mean changes.
inline std::vector<std::pair<std::string, std::string>> resumed_settings(const GptConfig& cfg) {
  return {{"seed", std::to_string(cfg.seed)},
          {"batch-size", std::to_string(cfg.batch_size)},
          {"accum-steps", std::to_string(cfg.accum_steps)}};
}

// A token file as the settings check compares it: its size and the checksum its header records.
inline std::string token_file_text(const data::TokenFile& f) {
  return std::to_string(f.size()) + " tokens, checksum " + std::to_string(f.checksum());
}

// Note [Same settings] for this program: the flags that decide the data each rank reads, the model,
// the optimization and the collectives each rank calls, and the token files themselves (ranks
// started by hand or by a scheduler may name them by another path on each machine). --threads,
// --workers, --metrics, --timeout, --sample and its flags may differ per rank. Runs as a member's
// initializer, right after the process group forms and before the model is broadcast.
inline bool check_job_settings(const GptConfig& cfg, dist::ProcessGroup& pg,
                               const data::TokenWindowDataset& train,
                               const data::TokenWindowDataset& val) {
  const auto text = [](auto v) { return std::to_string(v); };
  const auto yes_no = [](bool b) { return std::string(b ? "yes" : "no"); };
  dist::check_same_settings(
      pg,
      {{"--seed", text(cfg.seed)},
       {"--block-size", text(cfg.block_size)},
       {"--batch-size", text(cfg.batch_size)},
       {"--accum-steps", text(cfg.accum_steps)},
       {"--n-layer", text(cfg.n_layer)},
       {"--n-head", text(cfg.n_head)},
       {"--n-embd", text(cfg.n_embd)},
       {"--vocab-size", text(cfg.vocab_size)},
       {"--max-steps", text(cfg.max_steps)},
       {"--warmup-steps", text(cfg.warmup_steps)},
       {"--lr", number_text(cfg.lr)},
       {"--min-lr-factor", number_text(cfg.min_lr_factor)},
       {"--weight-decay", number_text(cfg.weight_decay)},
       {"--beta1", number_text(cfg.beta1)},
       {"--beta2", number_text(cfg.beta2)},
       {"--grad-clip", number_text(cfg.grad_clip)},
       {"--amp", cfg.amp},
       {"--device", cfg.device},
       {"--zero", text(cfg.zero)},
       {"--param-dtype", cfg.param_dtype},
       {"--reduce-dtype", cfg.reduce_dtype},
       {"--zero-reduce-scatter", yes_no(cfg.zero_reduce_scatter)},
       {"--eval-every", text(cfg.eval_every)},
       {"--eval-batches", text(cfg.eval_batches)},
       {"--save (given or not)", yes_no(!cfg.save.empty())},
       {"--save (a sharded directory or not)", yes_no(is_sharded_checkpoint_path(cfg.save))},
       {"--async-save", yes_no(cfg.async_save)},
       {"--save-every", text(cfg.save_every)},
       {"--stop-signals", stop_signals_text(cfg.stop_signals)},  // the stop check: a collective
       {"--resume", cfg.resume},
       {"--no-shuffle", yes_no(cfg.no_shuffle)},
       {"the training tokens (--data)", token_file_text(train.tokens())},
       {"the validation tokens (--data)", token_file_text(val.tokens())}},
      "Every rank must train with the same settings: start every rank with the same flags and "
      "data (a rank-dependent --seed, say, shuffles each rank's windows its own way, so that "
      "some are trained twice and others never).");
  return true;
}

}  // namespace lockstep::examples
