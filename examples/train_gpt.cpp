// Trains a GPT-2 style byte-level language model: the data part (prepare) is built, the training
// loop is not yet.
//
//   train_gpt --prepare [FILES...] --out DIR    text -> DIR/train.tokens, DIR/val.tokens
//   train_gpt --data DIR ...                    training (not built yet: exits 2 saying so)
//
// --prepare checks every file (missing, empty, not UTF-8: an error naming the file), splits the
// concatenated bytes 90/10 (Note [Text corpus]) and prints the unigram entropy of the training
// bytes, the loss a model must beat. Its last line is machine-readable: "prepared files=...
// train_tokens=... val_tokens=... entropy_bits=... entropy_nats=...". The flags are in
// train_gpt_flags.h.
//
// Layout for the training loop to come: run() sets up once (the world, the data with
// open_split(), the model, the optimizer, a resumed position), then epoch after epoch of
// train_step, evaluate, checkpoint, reading top to bottom as train_fashion_mnist.cpp does.
#include <cstdio>
#include <memory>
#include <string>

#include "lockstep/data/data.h"
#include "train_gpt_flags.h"

using namespace lockstep;

namespace {

using examples::GptConfig;

int prepare(const GptConfig& cfg) {
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
[[maybe_unused]] std::shared_ptr<data::TokenWindowDataset> open_split(const GptConfig& cfg,
                                                                      const std::string& split) {
  auto tokens = std::make_shared<const data::TokenFile>(cfg.data + "/" + split + ".tokens");
  return std::make_shared<data::TokenWindowDataset>(
      tokens, data::TokenWindowOptions{.block_size = cfg.block_size});
}

int run(const GptConfig& cfg) {
  if (cfg.prepare) return prepare(cfg);
  std::fprintf(stderr,
               "train_gpt: training is not built yet (issue 19); this build only prepares data:\n"
               "  train_gpt --prepare [FILES...] --out DIR\n");
  return examples::kUsageError;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  GptConfig cfg;
  if (const int rc = examples::parse_gpt_flags(argc, argv, cfg); rc >= 0) return rc;
  try {
    return run(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
