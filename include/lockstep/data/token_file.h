// Token files for language models: the format (TokenFile, memory-mapped and validated on open),
// its atomic writer, and TokenWindowDataset, the (input, target) windows a model trains on.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "lockstep/data/dataset.h"

namespace lockstep::data {

// Note [Token file format]
// A token file is a 32-byte header followed by the tokens, all little-endian:
//   bytes  0..7   magic "LSTOKENS"
//   bytes  8..11  u32 format version (kTokenFileVersion)
//   bytes 12..15  u32 token width in bytes: 1 (u8 tokens) or 2 (u16 tokens)
//   bytes 16..23  u64 token count
//   bytes 24..27  u32 vocabulary size: every token is below it (1 ..= 256 for width 1,
//                 1 ..= 65536 for width 2)
//   bytes 28..31  u32 CRC-32 (zlib's) of the token bytes
//   bytes 32..    count * width bytes of tokens, nothing after them
// The header says everything a reader needs, so a file is checked on open against itself:
// magic, version, width, vocabulary, the file's size against count * width, and (with
// verify) the checksum and every token against the vocabulary. The data starts 32 bytes in, so
// u16 tokens are aligned in the mapping. Files are written once, to a temporary name, and
// renamed into place (write_token_file): a reader never sees a half-written file, and a file
// is never changed under a mapping (which would make reads past a shrunk end fault).
inline constexpr char kTokenFileMagic[8] = {'L', 'S', 'T', 'O', 'K', 'E', 'N', 'S'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderBytes = 32;

struct TokenFileOpenOptions {
  // Recompute the checksum and check every token against the vocabulary (one pass over the
  // data). Off, only the header and the file's size are checked.
  bool verify = true;
};

// A token file mapped read-only. Opening checks it (Note [Token file format]); each failure
// names the file and says what was expected and what was found. Safe to read from several
// threads at once (nothing in it changes after construction).
class TokenFile {
 public:
  explicit TokenFile(const std::string& path, const TokenFileOpenOptions& options = {});
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  // Tokens in the file.
  int64_t size() const { return count_; }
  // 1 (u8) or 2 (u16).
  int64_t token_bytes() const { return token_bytes_; }
  int64_t vocab_size() const { return vocab_size_; }
  uint32_t checksum() const { return checksum_; }

  // Token i, i in [0, size()).
  int64_t operator[](int64_t i) const;
  // Tokens [start, start + n) widened to i64 into dst.
  void copy_to(int64_t start, int64_t n, int64_t* dst) const;

 private:
  std::string path_;
  int64_t count_ = 0;
  int64_t token_bytes_ = 1;
  int64_t vocab_size_ = 0;
  uint32_t checksum_ = 0;
  void* map_ = nullptr;  // the whole file, header included
  size_t map_bytes_ = 0;
  const unsigned char* data_ = nullptr;  // the first token
};

// Writes `tokens` as a token file (u8 or u16 tokens by the overload), every token below
// vocab_size: to "<path>.tmp.<pid>.<n>", fsynced, renamed to path, the directory fsynced, so
// that path holds either its old content or the whole new file, whatever happens meanwhile.
void write_token_file(const std::string& path, std::span<const uint8_t> tokens, int64_t vocab_size);
void write_token_file(const std::string& path, std::span<const uint16_t> tokens,
                      int64_t vocab_size);

struct TokenWindowOptions {
  // Tokens the model reads per example (T).
  int64_t block_size = 256;
  // Where the first window starts, in [0, block_size): Note [Token windows].
  int64_t offset = 0;
};

// Note [Token windows]
// Window i holds the block_size + 1 tokens from start = offset + i * block_size: the input is
// the first block_size of them, the target the last block_size (the input shifted by one), both
// i64 (T). Windows sit next to each other at a stride of block_size, so consecutive windows
// share one token (a window's last target is the next window's first input) and every token
// after the first is predicted exactly once per epoch; the windows are
// (size - offset - 1) / block_size, the tail that does not fill one is left out.
//
// Fixed windows make an epoch a fixed, finite set of examples, which is what lets the dataset
// plug into DistributedSampler and DataLoader unchanged: the sampler shuffles the windows and
// deals each rank its own disjoint share, and a run resumes exactly from (epoch, samples
// consumed), as the Fashion-MNIST example does (docs/CHECKPOINT.md). Random offsets drawn per
// sample would see more distinct contexts, but then an "epoch" is no longer a permutation of a
// fixed set and a resume must replay a generator's stream. The middle way keeps resumes exact:
// a trainer wanting different cuts per epoch builds the epoch's dataset with an offset that is
// a pure function of (seed, epoch), so a resumed run computes the same offset again. The window
// count may then differ by one between epochs, so it builds that epoch's sampler (and loader)
// over that epoch's dataset too; samples consumed still count positions in that epoch's order.
class TokenWindowDataset : public Dataset {
 public:
  TokenWindowDataset(std::shared_ptr<const TokenFile> tokens, const TokenWindowOptions& options);

  int64_t size() const override { return num_windows_; }
  // input i64 (T) = tokens[start, start + T), target i64 (T) = tokens[start + 1, start + T + 1).
  Example get(int64_t index) const override;

  int64_t block_size() const { return options_.block_size; }
  int64_t offset() const { return options_.offset; }
  // Position in the file of window `index`'s first token.
  int64_t window_start(int64_t index) const { return options_.offset + index * block_size(); }
  const TokenFile& tokens() const { return *tokens_; }

 private:
  std::shared_ptr<const TokenFile> tokens_;
  TokenWindowOptions options_;
  int64_t num_windows_ = 0;
};

}  // namespace lockstep::data
