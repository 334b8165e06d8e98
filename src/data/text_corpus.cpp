// UTF-8 validation, the fortunes file list, and prepare_text_corpus.
#include "lockstep/data/text_corpus.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "lockstep/base/syscall.h"
#include "lockstep/data/token_file.h"

namespace lockstep::data {

namespace {

constexpr const char* kTrainFile = "train.tokens";
constexpr const char* kValFile = "val.tokens";
// Bytes of the offending sequence quoted in the invalid-UTF-8 error.
constexpr int64_t kQuoteBytes = 4;

bool continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

// Length of the valid sequence starting at p[0] (of n bytes left), or 0 if it is invalid.
int64_t utf8_sequence(const unsigned char* p, int64_t n) {
  const unsigned char b = p[0];
  if (b < 0x80) return 1;
  int64_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (b >= 0xC2 && b <= 0xDF) {
    len = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    len = 3;
    if (b == 0xE0) lo = 0xA0;  // overlong below U+0800
    if (b == 0xED) hi = 0x9F;  // surrogates U+D800..U+DFFF
  } else if (b >= 0xF0 && b <= 0xF4) {
    len = 4;
    if (b == 0xF0) lo = 0x90;  // overlong below U+10000
    if (b == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;  // a continuation byte, 0xC0/0xC1 (overlong) or 0xF5..0xFF
  }
  if (n < len || p[1] < lo || p[1] > hi) return 0;
  for (int64_t k = 2; k < len; ++k)
    if (!continuation(p[k])) return 0;
  return len;
}

std::string quote_bytes(const std::vector<unsigned char>& bytes, int64_t at) {
  std::string s;
  char buf[8];
  const int64_t end = std::min<int64_t>(static_cast<int64_t>(bytes.size()), at + kQuoteBytes);
  for (int64_t i = at; i < end; ++i) {
    std::snprintf(buf, sizeof buf, "0x%02X", bytes[static_cast<size_t>(i)]);
    s += (i > at ? " " : "") + std::string(buf);
  }
  return s;
}

// The whole file; throws naming it when it is missing, unreadable or not a regular file.
std::vector<unsigned char> read_file(const std::string& path) {
  struct stat st {};
  Fd fd = open_regular_file(path, path, "prepare_text_corpus: ", &st);
  std::vector<unsigned char> bytes(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = LS_SYSCHECK_MSG(
        retry_on_eintr([&] { return ::read(fd.get(), bytes.data() + done, bytes.size() - done); }),
        "prepare_text_corpus: reading ", path);
    if (r == 0) break;  // shrank while we read: take what is there
    done += static_cast<size_t>(r);
  }
  bytes.resize(done);
  return bytes;
}

}  // namespace

int64_t find_invalid_utf8(std::span<const unsigned char> bytes) {
  const auto n = static_cast<int64_t>(bytes.size());
  for (int64_t i = 0; i < n;) {
    const int64_t len = utf8_sequence(bytes.data() + i, n - i);
    if (len == 0) return i;
    i += len;
  }
  return -1;
}

double byte_entropy_bits(std::span<const unsigned char> bytes) {
  if (bytes.empty()) return 0;
  std::array<int64_t, kByteVocabSize> counts{};
  for (unsigned char b : bytes) ++counts[b];
  const auto n = static_cast<double>(bytes.size());
  double h = 0;
  for (int64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / n;
    h -= p * std::log2(p);
  }
  return h;
}

std::vector<std::string> fortunes_corpus_files(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string hint = " (install the Debian package `fortunes`: scripts/install-deps.sh)";
  std::error_code ec;
  LS_CHECK(fs::is_directory(dir, ec), "fortunes_corpus_files: ", dir,
           " is not a directory: expected the fortunes text files there", hint);
  std::vector<std::string> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat") continue;
    files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  LS_CHECK(!files.empty(), "fortunes_corpus_files: ", dir,
           " holds no fortune files: expected text files beside their .dat indexes", hint);
  return files;
}

TextCorpusStats prepare_text_corpus(const std::vector<std::string>& files,
                                    const std::string& out_dir, const TextCorpusOptions& options) {
  LS_CHECK(!files.empty(), "prepare_text_corpus: expected at least one text file, got none");
  LS_CHECK(options.train_fraction > 0 && options.train_fraction < 1,
           "prepare_text_corpus: expected a train fraction in (0, 1), got ",
           options.train_fraction);
  LS_CHECK(!out_dir.empty(), "prepare_text_corpus: expected an output directory, got \"\"");

  // Every file is checked before anything is written, so a bad one leaves out_dir as it was.
  std::vector<unsigned char> corpus;
  for (const std::string& path : files) {
    std::vector<unsigned char> bytes = read_file(path);
    LS_CHECK(!bytes.empty(), "prepare_text_corpus: ", path,
             " is empty (0 bytes): expected some text");
    const int64_t bad = find_invalid_utf8(bytes);
    LS_CHECK(bad < 0, "prepare_text_corpus: ", path,
             " is not valid UTF-8: the first invalid sequence starts at byte offset ", bad, " (",
             quote_bytes(bytes, bad),
             "); convert the file to UTF-8 first, e.g. iconv -f latin1 -t utf-8");
    corpus.insert(corpus.end(), bytes.begin(), bytes.end());
    if (corpus.back() != '\n') corpus.push_back('\n');
  }

  const auto total = static_cast<int64_t>(corpus.size());
  const auto train =
      static_cast<int64_t>(std::floor(static_cast<double>(total) * options.train_fraction));
  LS_CHECK(train > 0 && train < total, "prepare_text_corpus: the corpus has ", total,
           " bytes, too few to split ", options.train_fraction, " / ", 1 - options.train_fraction,
           " with a byte on each side; expected more text");

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  LS_CHECK(!ec && std::filesystem::is_directory(out_dir), "prepare_text_corpus: cannot create ",
           "the output directory ", out_dir, ": ", ec ? ec.message() : "it is not a directory");

  const std::span<const unsigned char> all(corpus);
  TextCorpusStats stats;
  stats.files = static_cast<int64_t>(files.size());
  stats.total_bytes = total;
  stats.train_tokens = train;
  stats.val_tokens = total - train;
  stats.train_path = (std::filesystem::path(out_dir) / kTrainFile).string();
  stats.val_path = (std::filesystem::path(out_dir) / kValFile).string();
  write_token_file(stats.train_path, all.first(static_cast<size_t>(train)), kByteVocabSize);
  write_token_file(stats.val_path, all.subspan(static_cast<size_t>(train)), kByteVocabSize);
  stats.train_entropy_bits = byte_entropy_bits(all.first(static_cast<size_t>(train)));
  stats.train_entropy_nats = stats.train_entropy_bits * std::log(2.0);
  return stats;
}

}  // namespace lockstep::data
