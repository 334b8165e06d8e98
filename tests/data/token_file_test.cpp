// Token files: round trips, every corrupt-file case with its message, the atomic writer, and
// TokenWindowDataset's windows through DistributedSampler + DataLoader (shards, exact resume).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "lockstep/data/data.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::data;
using lockstep::testing::expect_error;
using lockstep::testing::TempDir;
namespace fs = std::filesystem;

namespace {

// Byte offsets of the header fields (Note [Token file format]), written independently of the
// library's constants so that a change to the format shows here.
constexpr int64_t kVersionAt = 8, kWidthAt = 12, kCountAt = 16, kVocabAt = 24;

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

template <typename T>
void patch(std::string& bytes, int64_t at, T value) {
  std::memcpy(bytes.data() + at, &value, sizeof value);
}

// Tokens with every value of a u8 vocabulary and no period shorter than the data.
std::vector<uint8_t> byte_tokens(int64_t n) {
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * 131 + i / 7) % 256);
  return v;
}

// A u8 token file of n tokens at dir/name; returns its path.
std::string u8_file(const TempDir& dir, const std::string& name, int64_t n) {
  const std::string path = dir.path(name);
  const std::vector<uint8_t> t = byte_tokens(n);
  write_token_file(path, std::span<const uint8_t>(t), 256);
  return path;
}

}  // namespace

// ---- the format

TEST(TokenFile, RoundTripsU8Tokens) {
  TempDir dir;
  const std::vector<uint8_t> t = byte_tokens(1000);
  write_token_file(dir.path("a.tokens"), std::span<const uint8_t>(t), 256);
  TokenFile f(dir.path("a.tokens"));
  EXPECT_EQ(f.size(), 1000);
  EXPECT_EQ(f.token_bytes(), 1);
  EXPECT_EQ(f.vocab_size(), 256);
  EXPECT_EQ(fs::file_size(dir.path("a.tokens")), 32u + 1000u);
  for (int64_t i = 0; i < f.size(); ++i) ASSERT_EQ(f[i], t[i]) << i;
  std::vector<int64_t> got(10);
  f.copy_to(990, 10, got.data());
  EXPECT_EQ(got, std::vector<int64_t>(t.begin() + 990, t.end()));
}

TEST(TokenFile, RoundTripsU16TokensAboveOneByte) {
  TempDir dir;
  std::vector<uint16_t> t(500);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint16_t>((i * 7919) % 50257);
  write_token_file(dir.path("b.tokens"), std::span<const uint16_t>(t), 50257);
  TokenFile f(dir.path("b.tokens"));
  EXPECT_EQ(f.size(), 500);
  EXPECT_EQ(f.token_bytes(), 2);
  EXPECT_EQ(f.vocab_size(), 50257);
  EXPECT_EQ(fs::file_size(dir.path("b.tokens")), 32u + 2 * 500u);
  std::vector<int64_t> got(t.size());
  f.copy_to(0, f.size(), got.data());
  EXPECT_EQ(got, std::vector<int64_t>(t.begin(), t.end()));
  EXPECT_GT(*std::max_element(got.begin(), got.end()), 255);
}

TEST(TokenFile, AnEmptyTokenFileIsValid) {
  TempDir dir;
  write_token_file(dir.path("e.tokens"), std::span<const uint8_t>(), 256);
  EXPECT_EQ(TokenFile(dir.path("e.tokens")).size(), 0);
}

TEST(TokenFile, WriterRejectsTokensOutsideTheVocabularyAndLeavesNoFile) {
  TempDir dir;
  const std::vector<uint8_t> t = {1, 2, 9, 3};
  expect_error([&] { write_token_file(dir.path("v.tokens"), std::span<const uint8_t>(t), 8); },
               {"v.tokens", "token 2 is 9", "below the vocabulary size 8"});
  expect_error([&] { write_token_file(dir.path("v.tokens"), std::span<const uint8_t>(t), 300); },
               {"vocabulary size in [1, 256]", "got 300"});
  EXPECT_TRUE(fs::is_empty(dir.dir()));
}

TEST(TokenFile, WriterReplacesAFileAtomicallyAndLeavesNoTemporaries) {
  TempDir dir;
  const std::string path = u8_file(dir, "r.tokens", 100);
  const std::string before = read_all(path);
  const std::vector<uint8_t> t(40, 7);
  write_token_file(path, std::span<const uint8_t>(t), 256);
  EXPECT_NE(read_all(path), before);
  EXPECT_EQ(TokenFile(path).size(), 40);
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir.dir())) {
    ++entries;
    EXPECT_EQ(e.path().filename(), "r.tokens");
  }
  EXPECT_EQ(entries, 1);
  // A writer that cannot create its temporary file fails naming it, and the old file stays.
  expect_error(
      [&] { write_token_file(dir.path("no/such/dir/x.tokens"), std::span<const uint8_t>(t), 256); },
      {"cannot create", "no/such/dir/x.tokens.tmp."});
}

// ---- corrupt files: each says what it expected and what it found

class CorruptTokenFile : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = u8_file(dir_, "c.tokens", 64);
    good_ = read_all(path_);
  }
  // Writes the good file with `edit` applied and expects opening it to fail with `parts`.
  void expect_open_error(const std::function<void(std::string&)>& edit,
                         const std::vector<std::string>& parts) {
    std::string bytes = good_;
    edit(bytes);
    write_all(path_, bytes);
    std::vector<std::string> all = parts;
    all.push_back(path_);
    expect_error([&] { TokenFile f(path_); }, all);
  }
  TempDir dir_;
  std::string path_;
  std::string good_;
};

TEST_F(CorruptTokenFile, BadMagicShowsExpectedAndFound) {
  expect_open_error(
      [](std::string& b) { b.replace(0, 8, "GPT2DATA"); },
      {"bad magic", "expected \"LSTOKENS\"", "found \"GPT2DATA\"", "not a token file"});
  expect_open_error([](std::string& b) { b.replace(0, 4, "\x89PNG"); },
                    {"bad magic", "found bytes 89 50 4E 47"});
}

TEST_F(CorruptTokenFile, UnsupportedVersion) {
  expect_open_error([](std::string& b) { patch<uint32_t>(b, kVersionAt, 7); },
                    {"unsupported version: expected 1, found 7"});
}

TEST_F(CorruptTokenFile, BadWidthAndVocabulary) {
  expect_open_error([](std::string& b) { patch<uint32_t>(b, kWidthAt, 3); },
                    {"bad token width: expected 1 or 2 bytes, found 3"});
  expect_open_error([](std::string& b) { patch<uint32_t>(b, kVocabAt, 257); },
                    {"bad vocabulary size: expected 1 to 256 for 1-byte tokens, found 257"});
}

TEST_F(CorruptTokenFile, TruncatedHeader) {
  expect_open_error([](std::string& b) { b.resize(10); },
                    {"truncated header: expected 32 header bytes, found a file of 10 bytes"});
  expect_open_error([](std::string& b) { b.clear(); }, {"truncated header", "of 0 bytes"});
}

TEST_F(CorruptTokenFile, TruncatedData) {
  const int64_t good = static_cast<int64_t>(good_.size());
  expect_open_error([](std::string& b) { b.resize(b.size() - 5); },
                    {"truncated", "64 tokens of 1 bytes", "need a file of " + std::to_string(good),
                     "found " + std::to_string(good - 5)});
}

TEST_F(CorruptTokenFile, SizeNotMatchingTheCount) {
  const int64_t good = static_cast<int64_t>(good_.size());
  expect_open_error([](std::string& b) { b += "xyz"; }, {"size does not match the token count",
                                                         "need a file of " + std::to_string(good),
                                                         "found " + std::to_string(good + 3)});
  // A count no file could hold is reported as truncation, without overflowing.
  expect_open_error([](std::string& b) { patch<uint64_t>(b, kCountAt, ~uint64_t{0}); },
                    {"truncated", "18446744073709551615 tokens"});
}

TEST_F(CorruptTokenFile, ChecksumMismatch) {
  expect_open_error([](std::string& b) { b[40] = static_cast<char>(b[40] ^ 0x20); },
                    {"checksum mismatch", "the data is corrupt"});
  // Without verify, only the header and the size are checked: the flipped byte reads back.
  std::string bytes = good_;
  bytes[40] = static_cast<char>(bytes[40] ^ 0x20);
  write_all(path_, bytes);
  TokenFile f(path_, TokenFileOpenOptions{.verify = false});
  EXPECT_EQ(f[40 - 32], static_cast<unsigned char>(bytes[40]));
}

TEST_F(CorruptTokenFile, TokenOutsideTheVocabulary) {
  // The header's vocabulary shrunk below tokens the data holds (the checksum still matches).
  expect_open_error([](std::string& b) { patch<uint32_t>(b, kVocabAt, 100); },
                    {"outside the vocabulary", "below 100"});
}

TEST(TokenFile, MissingFileNamesIt) {
  TempDir dir;
  expect_error([&] { TokenFile f(dir.path("absent.tokens")); },
               {"cannot open token file", "absent.tokens", "No such file"});
}

TEST(TokenFile, AFifoOrADeviceIsRefusedWithoutBlocking) {
  TempDir dir;
  ASSERT_EQ(::mkfifo(dir.path("fifo.tokens").c_str(), 0600), 0);
  expect_error([&] { TokenFile f(dir.path("fifo.tokens")); },
               {"token file ", "fifo.tokens: expected a regular file, found a FIFO"});
  expect_error([&] { TokenFile f("/dev/null"); },
               {"token file /dev/null: expected a regular file, found a character device"});
}

// ---- windows

TEST(TokenWindowDataset, WindowsAreBlocksAtStrideTWithTargetsShiftedByOne) {
  TempDir dir;
  const int64_t n = 1000;
  const std::vector<uint8_t> t = byte_tokens(n);
  auto file = std::make_shared<const TokenFile>(u8_file(dir, "w.tokens", n));
  for (int64_t offset : {0, 3}) {
    const int64_t block = 16;
    TokenWindowDataset ds(file, {.block_size = block, .offset = offset});
    // Windows need block + 1 tokens from offset + i * block.
    int64_t expect_windows = 0;
    while (offset + expect_windows * block + block + 1 <= n) ++expect_windows;
    ASSERT_EQ(ds.size(), expect_windows) << offset;
    for (int64_t i : {int64_t{0}, int64_t{1}, expect_windows - 1}) {
      Example e = ds.get(i);
      ASSERT_EQ(e.input.dtype(), DType::i64);
      ASSERT_EQ(e.input.shape(), (Dims{block}));
      ASSERT_EQ(e.target.shape(), (Dims{block}));
      const auto in = e.input.to_vector<int64_t>();
      const auto tg = e.target.to_vector<int64_t>();
      const int64_t start = offset + i * block;
      for (int64_t k = 0; k < block; ++k) {
        ASSERT_EQ(in[k], t[start + k]) << "window " << i << " position " << k;
        ASSERT_EQ(tg[k], t[start + k + 1]) << "window " << i << " position " << k;
      }
    }
    expect_error([&] { ds.get(expect_windows); }, {"out of range", std::to_string(expect_windows)});
  }
}

TEST(TokenWindowDataset, EveryTokenAfterTheFirstIsATargetOnceAcrossAllWindows) {
  TempDir dir;
  const int64_t n = 161, block = 8;  // 20 windows use tokens 0..160 exactly
  auto file = std::make_shared<const TokenFile>(u8_file(dir, "once.tokens", n));
  TokenWindowDataset ds(file, {.block_size = block});
  ASSERT_EQ(ds.size(), 20);
  std::vector<int64_t> targets;
  for (int64_t i = 0; i < ds.size(); ++i) {
    const auto tg = ds.get(i).target.to_vector<int64_t>();
    targets.insert(targets.end(), tg.begin(), tg.end());
  }
  std::vector<int64_t> want(n - 1);
  file->copy_to(1, n - 1, want.data());
  EXPECT_EQ(targets, want);
}

TEST(TokenWindowDataset, TooFewTokensOrBadOptionsSayWhy) {
  TempDir dir;
  auto file = std::make_shared<const TokenFile>(u8_file(dir, "small.tokens", 16));
  expect_error([&] { TokenWindowDataset ds(file, {.block_size = 16}); },
               {"holds 16 tokens", "at least block_size + 1 + offset = 17"});
  expect_error([&] { TokenWindowDataset ds(file, {.block_size = 4, .offset = 4}); },
               {"offset in [0, block_size = 4)", "got 4"});
  expect_error([&] { TokenWindowDataset ds(file, {.block_size = 0}); },
               {"block_size >= 1", "got 0"});
}

// ---- with DistributedSampler and DataLoader

namespace {

// The window index a collated row came from, recovered from its tokens (each window's first
// 8 tokens are distinct in these files), so that checks do not trust Batch::indices.
int64_t window_of(const TokenWindowDataset& ds, const std::vector<int64_t>& row) {
  for (int64_t i = 0; i < ds.size(); ++i) {
    std::vector<int64_t> w(static_cast<size_t>(ds.block_size()));
    ds.tokens().copy_to(ds.window_start(i), ds.block_size(), w.data());
    if (w == row) return i;
  }
  return -1;
}

std::vector<std::vector<int64_t>> rows(const Tensor& t) {
  const auto v = t.to_vector<int64_t>();
  const int64_t cols = t.size(1);
  std::vector<std::vector<int64_t>> out;
  for (int64_t r = 0; r < t.size(0); ++r)
    out.emplace_back(v.begin() + r * cols, v.begin() + (r + 1) * cols);
  return out;
}

// Where a run stands: the epoch and the samples all ranks together consumed in it, as the
// Fashion-MNIST example's checkpoint records them (docs/CHECKPOINT.md).
struct Position {
  int64_t epoch = 0;
  int64_t consumed = 0;
};

// Runs `batches` batches on every one of `world` ranks from `at` (a fresh sampler and loader per
// rank, as a resumed process builds them), moving to the next epoch when one ends; returns each
// rank's batch inputs in order and the position after them.
std::vector<std::vector<int64_t>> run_from(std::shared_ptr<const TokenWindowDataset> ds,
                                           int64_t world, int64_t batch, Position& at,
                                           int64_t batches) {
  std::vector<std::shared_ptr<DistributedSampler>> samplers;
  std::vector<std::unique_ptr<DataLoader>> loaders;
  for (int64_t r = 0; r < world; ++r) {
    samplers.push_back(std::make_shared<DistributedSampler>(
        ds->size(), DistributedSamplerOptions{.num_replicas = world, .rank = r, .seed = 5}));
    loaders.push_back(std::make_unique<DataLoader>(
        ds, samplers.back(), DataLoaderOptions{.batch_size = batch, .num_workers = 1}));
  }
  std::vector<std::vector<int64_t>> seen(static_cast<size_t>(world));
  auto start_epoch = [&] {
    for (int64_t r = 0; r < world; ++r) {
      loaders[r]->set_epoch(at.epoch);
      samplers[r]->set_start_index(at.consumed);
      loaders[r]->start_epoch();
    }
  };
  start_epoch();
  for (int64_t b = 0; b < batches;) {
    std::vector<std::optional<Batch>> got;
    for (int64_t r = 0; r < world; ++r) got.push_back(loaders[r]->next());
    if (!got[0]) {  // every rank has as many batches (the sampler pads): the epoch is over
      for (const auto& g : got) EXPECT_FALSE(g.has_value());
      ++at.epoch;
      at.consumed = 0;
      start_epoch();
      continue;
    }
    for (int64_t r = 0; r < world; ++r) {
      for (const auto& row : rows(got[r]->input)) seen[r].push_back(window_of(*ds, row));
    }
    at.consumed += got[0]->input.size(0) * world;
    ++b;
  }
  return seen;
}

}  // namespace

TEST(TokenWindowDataset, RanksReadDisjointShardsThatCoverTheEpoch) {
  TempDir dir;
  const int64_t block = 8, world = 3, batch = 4;
  auto file = std::make_shared<const TokenFile>(u8_file(dir, "shard.tokens", 24 * block + 1));
  auto ds =
      std::make_shared<const TokenWindowDataset>(file, TokenWindowOptions{.block_size = block});
  ASSERT_EQ(ds->size(), 24);  // a multiple of world: no padding repeats a window
  Position at;
  const auto seen = run_from(ds, world, batch, at, ds->size() / world / batch);
  std::set<int64_t> all;
  for (int64_t r = 0; r < world; ++r) {
    EXPECT_EQ(seen[r].size(), static_cast<size_t>(ds->size() / world));
    for (int64_t w : seen[r]) {
      ASSERT_GE(w, 0) << "rank " << r << " read a row that is no window";
      EXPECT_TRUE(all.insert(w).second) << "window " << w << " read twice (rank " << r << ")";
    }
  }
  EXPECT_EQ(static_cast<int64_t>(all.size()), ds->size());
  // The shards follow the sampler's shuffle, not the file's order.
  std::vector<int64_t> rank0_sorted = seen[0];
  std::sort(rank0_sorted.begin(), rank0_sorted.end());
  EXPECT_NE(seen[0], rank0_sorted);
}

TEST(TokenWindowDataset, ResumeIsExactAcrossAnEpochBoundary) {
  TempDir dir;
  const int64_t block = 4, world = 2, batch = 3;
  // 26 windows: 13 per rank, 5 batches per epoch (the last one short).
  auto file = std::make_shared<const TokenFile>(u8_file(dir, "resume.tokens", 26 * block + 1));
  auto ds =
      std::make_shared<const TokenWindowDataset>(file, TokenWindowOptions{.block_size = block});
  const int64_t per_epoch = 5, total = 3 * per_epoch;
  Position straight;
  const auto want = run_from(ds, world, batch, straight, total);
  // Interrupted after every batch count, including both ends of the first epoch.
  for (int64_t stop = 1; stop < total; ++stop) {
    Position at;
    auto got = run_from(ds, world, batch, at, stop);
    // A checkpoint taken after an epoch's last batch resumes in that epoch with nothing left;
    // the resumed run finds it empty and moves on, as the example's loop does.
    const auto rest = run_from(ds, world, batch, at, total - stop);
    for (int64_t r = 0; r < world; ++r) {
      got[r].insert(got[r].end(), rest[r].begin(), rest[r].end());
      ASSERT_EQ(got[r], want[r]) << "rank " << r << ", stopped after " << stop << " batches";
    }
    EXPECT_EQ(at.epoch, straight.epoch) << stop;
    EXPECT_EQ(at.consumed, straight.consumed) << stop;
  }
  // Epochs differ in order (the sampler reshuffles per epoch).
  EXPECT_NE(std::vector<int64_t>(want[0].begin(), want[0].begin() + 13),
            std::vector<int64_t>(want[0].begin() + 13, want[0].begin() + 26));
}
