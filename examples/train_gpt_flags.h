// The command line of examples/train_gpt: its settings, every flag with its range, and the checks
// that span several flags. The numeric-flag helpers (Range, add_number, usage_error) are the
// Fashion-MNIST example's, so both programs read numbers alike (Note [Numeric flags]).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/data/text_corpus.h"
#include "train_fashion_mnist_flags.h"

namespace lockstep::examples {

// Where `train_gpt --prepare` writes and training reads, unless --out / --data say otherwise.
constexpr const char* kDefaultGptDataDir = "gpt-data";

struct GptConfig {
  // --prepare [FILES...]: turn text files (none: the fortunes corpus) into token files and stop.
  bool prepare = false;
  std::vector<std::string> prepare_files;
  std::string fortunes_dir = data::kDefaultFortunesDir;
  std::string out = kDefaultGptDataDir;  // --prepare's output directory

  // Training (the loop is not built yet; these are what it reads first).
  std::string data = kDefaultGptDataDir;  // the directory with train.tokens and val.tokens
  int64_t block_size = 256;               // tokens per example (T)
  int64_t batch_size = 16;                // examples per rank and step (B)
  uint64_t seed = 0;                      // the sampler's shuffle (and later the model's init)
};

// Upper bound of --block-size: a window is copied per sample, and the model's attention is
// (T, T) per head.
constexpr int64_t kMaxBlockSize = 1 << 16;

// Reads the command line into `cfg`. Returns -1 when the program should run, else the exit code
// (0 after --help; kUsageError with the reason printed).
inline int parse_gpt_flags(int argc, char** argv, GptConfig& cfg) {
  using I = Range<int64_t>;
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
  add_number(app, "--seed", cfg.seed, Range<uint64_t>{0}, "Seed of the data order");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kUsageError;
  }
  cfg.prepare = prepare->count() > 0;
  // CLI11 gives a bare `--prepare` one empty value; no file has an empty name.
  std::erase(cfg.prepare_files, std::string());
  if (!cfg.prepare && app.get_option("--out")->count() > 0)
    return usage_error("--out is where --prepare writes; without --prepare it does nothing");
  return -1;
}

}  // namespace lockstep::examples
