// Fuzzing load_safetensors with random and mutated files: every outcome is a load or a
// lockstep::Error, never a crash; under the asan preset, never an out-of-bounds read either.
#include <chrono>
#include <random>
#include <typeinfo>

#include "io/safetensors_reference.h"
#include "lockstep/io/safetensors.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::io;
namespace st = lockstep::testing::st;

namespace {

constexpr uint64_t kSeed = 0x5afe7e4503u;
constexpr int kIterations = 20000;
// Every kMappedEvery-th load goes through the memory-mapped path.
constexpr int kMappedEvery = 4;

using Rng = std::mt19937_64;

struct DtypeInfo {
  const char* name;
  size_t bytes;
};
constexpr DtypeInfo kDtypes[] = {{"F32", 4}, {"F64", 8}, {"BF16", 2}, {"F16", 2},
                                 {"I32", 4}, {"I64", 8}, {"U8", 1},   {"BOOL", 1}};

size_t pick(Rng& rng, size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng() % n); }

template <typename T, size_t N>
const T& pick(Rng& rng, const T (&items)[N]) {
  return items[pick(rng, N)];
}

// A valid file: up to 5 tensors of random dtype and shape (0-d and empty ones included), random
// bytes (0/1 for BOOL), sometimes metadata, sometimes an unpadded header.
std::string valid_file(Rng& rng) {
  std::vector<st::RefTensor> tensors;
  const size_t n = pick(rng, 6);
  for (size_t i = 0; i < n; ++i) {
    const DtypeInfo& dt = pick(rng, kDtypes);
    st::RefTensor t{"t" + std::to_string(i), dt.name, {}, ""};
    size_t numel = 1;
    for (size_t d = pick(rng, 4); d > 0; --d) {
      t.shape.push_back(static_cast<int64_t>(pick(rng, 5)));
      numel *= static_cast<size_t>(t.shape.back());
    }
    for (size_t b = 0; b < numel * dt.bytes; ++b)
      t.bytes += static_cast<char>(dt.bytes == 1 && t.dtype == "BOOL" ? rng() % 2 : rng());
    tensors.push_back(std::move(t));
  }
  std::vector<std::pair<std::string, std::string>> meta;
  if (rng() % 2) meta = {{"format", "pt"}, {"k\"ey", "v\nalue"}};
  return st::file_of(tensors, meta, rng() % 4 ? 8 : 1);
}

uint64_t header_length(const std::string& file) {
  uint64_t n = 0;
  for (size_t i = 0; i < 8 && i < file.size(); ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(file[i])) << (8 * i);
  return n;
}

// Edits the header text as JSON-aware noise would: numbers and strings swapped for tricky
// ones, spans deleted, copied (duplicate keys and entries) or broken up by structural characters.
std::string edit_json(std::string h, Rng& rng) {
  static const char* kNumbers[] = {"-1",
                                   "0",
                                   "1",
                                   "3",
                                   "4",
                                   "7",
                                   "8",
                                   "255",
                                   "4294967296",
                                   "9223372036854775807",
                                   "9223372036854775808",
                                   "18446744073709551615",
                                   "18446744073709551616",
                                   "2.5",
                                   "-0",
                                   "1e3",
                                   "1e400",
                                   "4611686018427387905"};
  static const char* kValues[] = {"\"F32\"",
                                  "\"BOOL\"",
                                  "\"U8\"",
                                  "\"F64\"",
                                  "\"__metadata__\"",
                                  "\"dtype\"",
                                  "\"shape\"",
                                  "\"data_offsets\"",
                                  "\"Q7\"",
                                  "\"\"",
                                  "1",
                                  "[]",
                                  "{}",
                                  "null",
                                  "true",
                                  "[0,0]",
                                  "[1,1,1,1,1,1,1,1,1]",
                                  "\"t0\"",
                                  "\"\\u0000\"",
                                  "\"\\ud800\""};
  static const char kStructural[] = "{}[]\":,-.e0 \\";
  const int edits = 1 + static_cast<int>(pick(rng, 3));
  for (int e = 0; e < edits && !h.empty(); ++e) {
    const size_t at = pick(rng, h.size());
    switch (pick(rng, 7)) {
      case 0: {  // replace the number at or after `at`
        const size_t b = h.find_first_of("0123456789", at);
        if (b == std::string::npos) break;
        const size_t end = h.find_first_not_of("0123456789", b);
        h.replace(b, (end == std::string::npos ? h.size() : end) - b, pick(rng, kNumbers));
        break;
      }
      case 1: {  // replace the string at or after `at`
        const size_t b = h.find('"', at);
        if (b == std::string::npos) break;
        const size_t end = h.find('"', b + 1);
        if (end == std::string::npos) break;
        h.replace(b, end + 1 - b, pick(rng, kValues));
        break;
      }
      case 2:  // delete a span
        h.erase(at, 1 + pick(rng, 12));
        break;
      case 3:  // insert a structural character
        h.insert(at, 1, kStructural[pick(rng, sizeof kStructural - 1)]);
        break;
      case 4: {  // copy a span elsewhere: duplicates keys, entries, brackets
        const std::string span = h.substr(at, 1 + pick(rng, 80));
        h.insert(pick(rng, h.size() + 1), span);
        break;
      }
      case 5: {  // move a tensor's byte range, keeping its size: gaps, overlaps, out of file
        static const int64_t kShifts[] = {-16, -8, -4, -2, -1, 1, 2, 4, 8, 16, 1 << 20};
        const size_t key = h.find("\"data_offsets\": [", at);
        if (key == std::string::npos) break;
        const size_t b = key + 17;
        const size_t comma = h.find(", ", b), close = h.find(']', b);
        if (comma == std::string::npos || close == std::string::npos || comma > close) break;
        const std::string a = h.substr(b, comma - b), z = h.substr(comma + 2, close - comma - 2);
        const auto digits = [](const std::string& n) {
          return !n.empty() && n.size() < 16 && n.find_first_not_of("0123456789") == n.npos;
        };
        if (!digits(a) || !digits(z)) break;
        const int64_t shift = pick(rng, kShifts);
        const int64_t lo = std::stoll(a) + shift, hi = std::stoll(z) + shift;
        h.replace(b, close - b, std::to_string(lo) + ", " + std::to_string(hi));
        break;
      }
      default:  // change digits
        for (char& c : h)
          if (c >= '0' && c <= '9' && rng() % 8 == 0) c = static_cast<char>('0' + pick(rng, 10));
        break;
    }
  }
  return h;
}

// One mutation of `file`; returns the kind applied (0 = none).
int mutate(std::string& file, Rng& rng) {
  const int kind = static_cast<int>(pick(rng, 8));
  switch (kind) {
    case 0:
      break;
    case 1: {  // bit flips anywhere, or only in the data (which mostly still loads)
      const size_t from = rng() % 2 ? 0 : std::min(file.size(), 8 + header_length(file));
      for (size_t k = 1 + pick(rng, 8); k > 0 && from < file.size(); --k)
        file[from + pick(rng, file.size() - from)] ^= static_cast<char>(1u << pick(rng, 8));
      break;
    }
    case 2:  // truncation
      file.resize(pick(rng, file.size() + 1));
      break;
    case 3: {  // a random header length: wild, off by a little, or anywhere within the file
      const uint64_t real = header_length(file);
      const uint64_t choices[] = {rng(), real + pick(rng, 33) - 16, pick(rng, file.size() + 16),
                                  rng() >> pick(rng, 64)};
      const std::string len = st::le64(pick(rng, choices));
      file.replace(0, 8, len);
      break;
    }
    case 4: {  // JSON edits, the length fixed up so the parser sees them (usually)
      if (file.size() < 8) break;
      const uint64_t hlen = std::min<uint64_t>(header_length(file), file.size() - 8);
      std::string h = edit_json(file.substr(8, hlen), rng);
      std::string data = file.substr(8 + hlen);
      file = rng() % 8 ? st::file_with(h, data) : file.substr(0, 8) + h + data;
      break;
    }
    case 5: {  // random bytes, sometimes behind a plausible header length
      std::string r(pick(rng, 200), '\0');
      for (char& c : r) c = static_cast<char>(rng());
      file = rng() % 2 ? r : st::le64(pick(rng, r.size() + 1)) + r;
      break;
    }
    case 6:  // data grown or shrunk at the end
      if (rng() % 2)
        file.append(1 + pick(rng, 16), static_cast<char>(rng()));
      else
        file.resize(file.size() - std::min(file.size(), 1 + pick(rng, 16)));
      break;
    default: {  // a header of JSON-ish token soup
      static const char* kTokens[] = {"{",         "}",
                                      "[",         "]",
                                      ",",         ":",
                                      "\"a\"",     "\"dtype\"",
                                      "\"shape\"", "\"data_offsets\"",
                                      "\"F32\"",   "0",
                                      "4",         "\"__metadata__\"",
                                      "\"BOOL\""};
      std::string h;
      for (size_t k = pick(rng, 40); k > 0; --k) h += pick(rng, kTokens);
      file = st::file_with(h, std::string(pick(rng, 16), '\1'));
      break;
    }
  }
  return kind;
}

}  // namespace

TEST(SafetensorsFuzz, RandomAndMutatedFilesLoadOrThrowLockstepError) {
  st::TempDir dir;
  const std::string p = dir.path("fuzz.safetensors");
  Rng rng(kSeed);
  int loaded = 0, rejected = 0, valid_loaded = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int it = 0; it < kIterations; ++it) {
    const std::string original = valid_file(rng);
    std::string file = original;
    const int kind = mutate(file, rng);
    if (kind != 0 && rng() % 4 == 0) mutate(file, rng);  // sometimes two mutations
    const bool unchanged = file == original;
    // A fresh file each time: ext4 flushes a file truncated and rewritten in place on close.
    std::filesystem::remove(p);
    st::write_file(p, file);
    SafetensorsLoadOptions opts;
    if (it % kMappedEvery == 0) opts.mmap_min_bytes = 0;
    try {
      const auto out = load_safetensors(p, opts);
      ++loaded;
      // A load accounts for every data byte, and each tensor's bytes are readable.
      const uint64_t hlen = header_length(file);
      uint64_t total = 0, checksum = 0;
      for (const auto& [name, t] : out.tensors) {
        ASSERT_EQ(t.nbytes(), t.numel() * t.element_size()) << name;
        const auto* b = static_cast<const unsigned char*>(t.data_ptr());
        for (int64_t i = 0; i < t.nbytes(); ++i) checksum += b[i];
        total += static_cast<uint64_t>(t.nbytes());
      }
      ASSERT_EQ(total, file.size() - 8 - hlen) << "iteration " << it;
      (void)checksum;
      if (unchanged) ++valid_loaded;
    } catch (const Error& e) {
      ++rejected;
      ASSERT_FALSE(unchanged) << "iteration " << it << ": a valid file was rejected: " << e.what();
      ASSERT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      FAIL() << "iteration " << it << " (mutation " << kind << "): " << typeid(e).name()
             << " instead of lockstep::Error: " << e.what();
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ fuzz     ] %d files in %.2f s: %d loaded (%d unmutated), %d rejected\n",
              kIterations, seconds, loaded, valid_loaded, rejected);
  // Both outcomes must be common, or the fuzzer is not reaching past the first checks.
  EXPECT_GT(valid_loaded, kIterations / 20);
  EXPECT_GT(loaded - valid_loaded, kIterations / 50);
  EXPECT_GT(rejected, kIterations / 2);
}

TEST(SafetensorsFuzz, DeeplyNestedHeadersAreErrorsNotStackOverflows) {
  st::TempDir dir;
  const std::string p = dir.path("deep.safetensors");
  constexpr size_t kDepth = 200000;
  const std::string arrays = std::string(kDepth, '[') + std::string(kDepth, ']');
  std::string objects;
  for (size_t i = 0; i < kDepth; ++i) objects += "{\"a\":";
  objects += "1" + std::string(kDepth, '}');
  const std::pair<std::string, std::string> cases[] = {
      {std::string(kDepth, '['), "not valid JSON"},
      {arrays, "found array [[[[...]]]]"},
      {"{\"a\":" + arrays + "}", "tensor 'a': expected an object"},
      {objects, "tensor 'a' has unexpected key 'a'"},
      {"{\"__metadata__\":" + objects + "}", "__metadata__ must be an object of strings"},
  };
  for (const auto& [header, message] : cases) {
    st::write_file(p, st::file_with(header, ""));
    lockstep::testing::expect_error([&] { (void)load_safetensors(p); }, {p, message});
  }
}
