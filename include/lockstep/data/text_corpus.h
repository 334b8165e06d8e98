// Text corpora for byte-level language models: UTF-8 validation, the fortunes corpus, and
// prepare_text_corpus (text files -> train/val token files).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace lockstep::data {

// Where the Debian package `fortunes` installs its text files (beside their .dat indexes).
inline constexpr const char* kDefaultFortunesDir = "/usr/share/games/fortunes";
// Byte-level tokens: every byte is one token.
inline constexpr int64_t kByteVocabSize = 256;

// The byte offset of the first invalid UTF-8 sequence in `bytes`, or -1 when all of it is valid.
// Valid means RFC 3629: no overlong forms, no surrogates (U+D800..U+DFFF), nothing above
// U+10FFFF, no sequence cut off by the end.
int64_t find_invalid_utf8(std::span<const unsigned char> bytes);

// The fortune files of `dir`, sorted by name: the regular files that are not a .dat index
// (the package's .u8 names are symbolic links to the same files and are left out). Throws
// naming the directory and the package to install when there are none.
std::vector<std::string> fortunes_corpus_files(const std::string& dir = kDefaultFortunesDir);

struct TextCorpusOptions {
  // The share of the bytes that goes to the training file; the rest, from the end of the
  // corpus, to the validation file.
  double train_fraction = 0.9;
};

struct TextCorpusStats {
  int64_t files = 0;
  int64_t total_bytes = 0;  // tokens over both splits
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  std::string train_path;
  std::string val_path;
  // Unigram (order-0) entropy of the training bytes: the loss, per byte, of a model that knows
  // each byte's frequency and nothing else, i.e. what a language model must beat.
  double train_entropy_bits = 0;
  double train_entropy_nats = 0;
};

// Note [Text corpus]
// Reads each file whole, checks it (it must exist, be non-empty and be valid UTF-8: the error
// names the file, and for bad UTF-8 the byte offset of the first invalid sequence), and
// concatenates them in the order given, adding a newline after a file that does not end in one
// so that files never run together mid-line. The first train_fraction of the bytes become
// out_dir/train.tokens, the rest out_dir/val.tokens: u8 token files with a vocabulary of 256
// (Note [Token file format]), each written atomically. The split is contiguous, not
// interleaved, so no validation window overlaps training text. out_dir is created if missing.
TextCorpusStats prepare_text_corpus(const std::vector<std::string>& files,
                                    const std::string& out_dir,
                                    const TextCorpusOptions& options = {});

// Order-0 entropy of `bytes` in bits per byte (0 for empty input).
double byte_entropy_bits(std::span<const unsigned char> bytes);

}  // namespace lockstep::data
