// TokenFile (open, check, map), write_token_file (temporary file + rename) and
// TokenWindowDataset.
#include "lockstep/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "lockstep/base/syscall.h"

namespace lockstep::data {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian and read in place: a little-endian host only");

namespace {

constexpr int64_t kMaxVocabU8 = 256;
constexpr int64_t kMaxVocabU16 = 65536;
// Header field offsets (Note [Token file format]).
constexpr size_t kVersionAt = 8;
constexpr size_t kWidthAt = 12;
constexpr size_t kCountAt = 16;
constexpr size_t kVocabAt = 24;
constexpr size_t kChecksumAt = 28;

int64_t max_vocab(int64_t token_bytes) { return token_bytes == 1 ? kMaxVocabU8 : kMaxVocabU16; }

uint32_t get_u32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void put_u32(unsigned char* p, uint32_t v) { std::memcpy(p, &v, sizeof v); }
void put_u64(unsigned char* p, uint64_t v) { std::memcpy(p, &v, sizeof v); }

uint32_t crc_of(const void* data, size_t n) {
  return static_cast<uint32_t>(crc32_z(crc32_z(0L, Z_NULL, 0), static_cast<const Bytef*>(data), n));
}

// The magic as text where it is printable, else as hex bytes: "LSTOKENS" or "89 50 4E 47 ...".
std::string describe_magic(const unsigned char* p) {
  bool printable = true;
  for (int i = 0; i < 8; ++i) printable = printable && p[i] >= 0x20 && p[i] < 0x7f;
  if (printable) return "\"" + std::string(reinterpret_cast<const char*>(p), 8) + "\"";
  std::string s;
  char buf[4];
  for (int i = 0; i < 8; ++i) {
    std::snprintf(buf, sizeof buf, "%02X", p[i]);
    s += (i ? " " : "") + std::string(buf);
  }
  return "bytes " + s;
}

template <typename T>
void write_tokens(const std::string& path, std::span<const T> tokens, int64_t vocab_size) {
  constexpr int64_t width = sizeof(T);
  LS_CHECK(vocab_size >= 1 && vocab_size <= max_vocab(width), "write_token_file: ", path,
           ": expected a vocabulary size in [1, ", max_vocab(width), "] for ", width,
           "-byte tokens, got ", vocab_size);
  for (size_t i = 0; i < tokens.size(); ++i) {
    LS_CHECK(static_cast<int64_t>(tokens[i]) < vocab_size, "write_token_file: ", path, ": token ",
             i, " is ", static_cast<int64_t>(tokens[i]),
             ", expected every token below the vocabulary size ", vocab_size);
  }
  const size_t data_bytes = tokens.size() * sizeof(T);
  unsigned char header[kTokenFileHeaderBytes] = {};
  std::memcpy(header, kTokenFileMagic, sizeof kTokenFileMagic);
  put_u32(header + kVersionAt, kTokenFileVersion);
  put_u32(header + kWidthAt, static_cast<uint32_t>(width));
  put_u64(header + kCountAt, tokens.size());
  put_u32(header + kVocabAt, static_cast<uint32_t>(vocab_size));
  put_u32(header + kChecksumAt, crc_of(tokens.data(), data_bytes));

  AtomicFile file(path, "write_token_file");
  file.write(header, sizeof header);
  file.write(tokens.data(), data_bytes);
  file.commit();
}

// The largest token of n at p, each `width` bytes.
int64_t max_token(const unsigned char* p, int64_t n, int64_t width) {
  int64_t m = 0;
  if (width == 1) {
    unsigned char b = 0;
    for (int64_t i = 0; i < n; ++i) b = std::max(b, p[i]);
    m = b;
  } else {
    uint16_t w = 0;
    const auto* q = reinterpret_cast<const uint16_t*>(p);
    for (int64_t i = 0; i < n; ++i) w = std::max(w, q[i]);
    m = w;
  }
  return m;
}

}  // namespace

void write_token_file(const std::string& path, std::span<const uint8_t> tokens,
                      int64_t vocab_size) {
  write_tokens(path, tokens, vocab_size);
}

void write_token_file(const std::string& path, std::span<const uint16_t> tokens,
                      int64_t vocab_size) {
  write_tokens(path, tokens, vocab_size);
}

// ---- TokenFile

TokenFile::TokenFile(const std::string& path, const TokenFileOpenOptions& options) : path_(path) {
  const std::string where = "token file " + path + ": ";
  struct stat st {};
  Fd fd = open_regular_file(path, "token file " + path, "", &st);
  const auto file_bytes = static_cast<int64_t>(st.st_size);

  // Header checks, in the order a reader needs them: is this a token file at all, of a version
  // we read, with a width and vocabulary that make sense, and as large as its header says.
  unsigned char h[kTokenFileHeaderBytes];
  const ssize_t got = LS_SYSCHECK_MSG(
      retry_on_eintr([&] { return ::pread(fd.get(), h, sizeof h, 0); }), "reading ", path);
  LS_CHECK(got == kTokenFileHeaderBytes, where, "truncated header: expected ",
           kTokenFileHeaderBytes, " header bytes, found a file of ", file_bytes, " bytes");
  LS_CHECK(std::memcmp(h, kTokenFileMagic, sizeof kTokenFileMagic) == 0, where,
           "bad magic: expected \"LSTOKENS\", found ", describe_magic(h),
           " (not a token file; write one with write_token_file or train_gpt --prepare)");
  const uint32_t version = get_u32(h + kVersionAt);
  LS_CHECK(version == kTokenFileVersion, where, "unsupported version: expected ", kTokenFileVersion,
           ", found ", version);
  token_bytes_ = get_u32(h + kWidthAt);
  LS_CHECK(token_bytes_ == 1 || token_bytes_ == 2, where,
           "bad token width: expected 1 or 2 bytes, found ", token_bytes_);
  vocab_size_ = get_u32(h + kVocabAt);
  LS_CHECK(vocab_size_ >= 1 && vocab_size_ <= max_vocab(token_bytes_), where,
           "bad vocabulary size: expected 1 to ", max_vocab(token_bytes_), " for ", token_bytes_,
           "-byte tokens, found ", vocab_size_);
  const uint64_t count = get_u64(h + kCountAt);
  // The size the header implies, unless a corrupt count makes it overflow.
  const bool representable =
      count <= static_cast<uint64_t>(INT64_MAX - kTokenFileHeaderBytes) / token_bytes_;
  const int64_t need =
      representable ? kTokenFileHeaderBytes + static_cast<int64_t>(count) * token_bytes_ : 0;
  const std::string need_text = representable ? std::to_string(need) : "more than 2^63";
  LS_CHECK(representable && need <= file_bytes, where, "truncated: the header's ", count,
           " tokens of ", token_bytes_, " bytes need a file of ", need_text, " bytes, found ",
           file_bytes);
  LS_CHECK(need == file_bytes, where, "size does not match the token count: the header's ", count,
           " tokens of ", token_bytes_, " bytes need a file of ", need, " bytes, found ",
           file_bytes, " (", file_bytes - need, " bytes after the data)");
  count_ = static_cast<int64_t>(count);
  checksum_ = get_u32(h + kChecksumAt);

  map_bytes_ = static_cast<size_t>(file_bytes);
  void* p = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd.get(), 0);
  LS_CHECK(p != MAP_FAILED, where, "cannot map ", map_bytes_, " bytes: ", errno_text(errno));
  map_ = p;
  data_ = static_cast<const unsigned char*>(map_) + kTokenFileHeaderBytes;

  if (options.verify) {
    try {
      const uint32_t crc = crc_of(data_, static_cast<size_t>(file_bytes - kTokenFileHeaderBytes));
      LS_CHECK(crc == checksum_, where, "checksum mismatch: the header says CRC-32 ", checksum_,
               ", the ", count_, " tokens give ", crc, " (the data is corrupt)");
      const int64_t m = max_token(data_, count_, token_bytes_);
      LS_CHECK(count_ == 0 || m < vocab_size_, where, "token ", m,
               " is outside the vocabulary: expected every token below ", vocab_size_);
    } catch (...) {
      ::munmap(map_, map_bytes_);
      throw;
    }
  }
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

int64_t TokenFile::operator[](int64_t i) const {
  LS_CHECK(i >= 0 && i < count_, "TokenFile ", path_, ": token index ", i, " is out of range for ",
           count_, " tokens");
  if (token_bytes_ == 1) return data_[i];
  uint16_t v;
  std::memcpy(&v, data_ + 2 * i, sizeof v);
  return v;
}

void TokenFile::copy_to(int64_t start, int64_t n, int64_t* dst) const {
  LS_CHECK(start >= 0 && n >= 0 && start <= count_ && n <= count_ - start, "TokenFile ", path_,
           ": tokens [", start, ", ", start + n, ") are out of range for ", count_, " tokens");
  if (token_bytes_ == 1) {
    for (int64_t i = 0; i < n; ++i) dst[i] = data_[start + i];
  } else {
    const auto* q = reinterpret_cast<const uint16_t*>(data_) + start;
    for (int64_t i = 0; i < n; ++i) dst[i] = q[i];
  }
}

// ---- TokenWindowDataset

TokenWindowDataset::TokenWindowDataset(std::shared_ptr<const TokenFile> tokens,
                                       const TokenWindowOptions& options)
    : tokens_(std::move(tokens)), options_(options) {
  LS_CHECK(tokens_ != nullptr, "TokenWindowDataset: the token file is null");
  LS_CHECK(options.block_size >= 1, "TokenWindowDataset: expected block_size >= 1, got ",
           options.block_size);
  LS_CHECK(options.offset >= 0 && options.offset < options.block_size,
           "TokenWindowDataset: expected an offset in [0, block_size = ", options.block_size,
           "), got ", options.offset);
  // Note [Token windows]: window i needs tokens up to offset + (i + 1) * block_size inclusive.
  const int64_t usable = tokens_->size() - options.offset - 1;
  num_windows_ = usable > 0 ? usable / options.block_size : 0;
  LS_CHECK(num_windows_ > 0, "TokenWindowDataset: ", tokens_->path(), " holds ", tokens_->size(),
           " tokens, too few for one window: expected at least block_size + 1 + offset = ",
           options.block_size + 1 + options.offset, " (use a smaller block size or more text)");
}

Example TokenWindowDataset::get(int64_t index) const {
  LS_CHECK(index >= 0 && index < num_windows_, "TokenWindowDataset::get: index ", index,
           " is out of range for ", num_windows_, " windows");
  const int64_t t = block_size();
  Tensor input = empty({t}, DType::i64);   // (T)
  Tensor target = empty({t}, DType::i64);  // (T)
  tokens_->copy_to(window_start(index), t, static_cast<int64_t*>(input.data_ptr()));
  tokens_->copy_to(window_start(index) + 1, t, static_cast<int64_t*>(target.data_ptr()));
  return {input, target};
}

}  // namespace lockstep::data
