// Text corpora: UTF-8 validation against hand-built sequences, prepare_text_corpus's split and
// entropy against naive references, and its errors for missing, empty and non-UTF-8 files.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "lockstep/data/data.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::data;
using lockstep::testing::expect_error;
using lockstep::testing::TempDir;
namespace fs = std::filesystem;

namespace {

std::span<const unsigned char> bytes_of(const std::string& s) {
  return {reinterpret_cast<const unsigned char*>(s.data()), s.size()};
}

std::string write_text(const TempDir& dir, const std::string& name, const std::string& text) {
  std::ofstream f(dir.path(name), std::ios::binary);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  return dir.path(name);
}

std::string tokens_as_string(const TokenFile& f) {
  std::vector<int64_t> v(static_cast<size_t>(f.size()));
  f.copy_to(0, f.size(), v.data());
  return std::string(v.begin(), v.end());
}

}  // namespace

TEST(Utf8, ValidTextOfEveryLengthPasses) {
  // 1-, 2-, 3- and 4-byte sequences, the largest code point and the edges around surrogates.
  const std::string ok =
      "a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\xF4\x8F\xBF\xBF\xED\x9F\xBF\xEE\x80\x80";
  EXPECT_EQ(find_invalid_utf8(bytes_of(ok)), -1);
  EXPECT_EQ(find_invalid_utf8(bytes_of("")), -1);
}

TEST(Utf8, FindsTheFirstInvalidSequence) {
  const std::string prefix = "ok \xC3\xA9 ";  // 6 valid bytes
  const std::map<std::string, std::string> bad = {
      {"\xFF", "a byte never used"},
      {"\x80", "a stray continuation byte"},
      {"\xC0\x80", "an overlong NUL"},
      {"\xE0\x9F\xBF", "an overlong 3-byte form"},
      {"\xED\xA0\x80", "a surrogate"},
      {"\xF4\x90\x80\x80", "a code point above U+10FFFF"},
      {"\xE2\x82", "a sequence cut off by the end"},
      {"\xE2\x28\xA1", "a bad continuation byte"},
  };
  for (const auto& [seq, what] : bad) {
    const std::string text = prefix + seq;
    EXPECT_EQ(find_invalid_utf8(bytes_of(text)), static_cast<int64_t>(prefix.size())) << what;
  }
}

TEST(Utf8, EntropyMatchesANaiveCount) {
  const std::string s = "abracadabra, a byte-level corpus \xE2\x82\xAC";
  std::map<unsigned char, double> count;
  for (unsigned char c : s) count[c] += 1;
  double want = 0;
  for (const auto& [c, k] : count) want += k / s.size() * std::log2(s.size() / k);
  EXPECT_NEAR(byte_entropy_bits(bytes_of(s)), want, 1e-12);
  EXPECT_EQ(byte_entropy_bits(bytes_of(std::string(50, 'x'))), 0.0);
}

TEST(PrepareTextCorpus, SplitsTheConcatenatedBytes90To10) {
  TempDir dir;
  std::string a, b;
  for (int i = 0; i < 40; ++i) a += "fortune " + std::to_string(i) + ": caf\xC3\xA9\n%\n";
  for (int i = 0; i < 25; ++i) b += "line " + std::to_string(i * i);  // no final newline
  const auto pa = write_text(dir, "a.txt", a), pb = write_text(dir, "b.txt", b);
  const std::string out = dir.path("out/nested");
  const TextCorpusStats s = prepare_text_corpus({pa, pb}, out);

  const std::string corpus = a + b + "\n";  // a newline ends a file that lacked one
  const auto total = static_cast<int64_t>(corpus.size());
  EXPECT_EQ(s.files, 2);
  EXPECT_EQ(s.total_bytes, total);
  EXPECT_EQ(s.train_tokens, total * 9 / 10);
  EXPECT_EQ(s.val_tokens, total - total * 9 / 10);
  TokenFile train(out + "/train.tokens"), val(out + "/val.tokens");
  EXPECT_EQ(train.vocab_size(), 256);
  EXPECT_EQ(train.token_bytes(), 1);
  EXPECT_EQ(tokens_as_string(train), corpus.substr(0, s.train_tokens));
  EXPECT_EQ(tokens_as_string(val), corpus.substr(s.train_tokens));
  EXPECT_EQ(s.train_path, out + "/train.tokens");

  const std::string train_text = corpus.substr(0, s.train_tokens);
  EXPECT_NEAR(s.train_entropy_bits, byte_entropy_bits(bytes_of(train_text)), 1e-12);
  EXPECT_NEAR(s.train_entropy_nats, s.train_entropy_bits * std::log(2.0), 1e-12);
  EXPECT_GT(s.train_entropy_bits, 1.0);
  EXPECT_LT(s.train_entropy_bits, 8.0);
}

TEST(PrepareTextCorpus, MissingFileIsNamed) {
  TempDir dir;
  const auto ok = write_text(dir, "ok.txt", std::string(100, 'z'));
  expect_error(
      [&] {
        prepare_text_corpus({ok, dir.path("nope.txt")}, dir.path("out"));
      },
      {"cannot open", "nope.txt", "No such file"});
  EXPECT_FALSE(fs::exists(dir.path("out")));  // nothing is written before every file passed
}

TEST(PrepareTextCorpus, EmptyFileIsNamed) {
  TempDir dir;
  const auto ok = write_text(dir, "ok.txt", std::string(100, 'z'));
  const auto empty = write_text(dir, "empty.txt", "");
  expect_error(
      [&] {
        prepare_text_corpus({ok, empty}, dir.path("out"));
      },
      {"empty.txt", "is empty (0 bytes)"});
  EXPECT_FALSE(fs::exists(dir.path("out")));
}

TEST(PrepareTextCorpus, NonUtf8FileIsNamedWithTheOffset) {
  TempDir dir;
  std::string latin1 = std::string(1234, 'q') + "na\xEFve";  // Latin-1, not UTF-8
  const auto bad = write_text(dir, "latin1.txt", latin1);
  expect_error([&] { prepare_text_corpus({bad}, dir.path("out")); },
               {"latin1.txt", "is not valid UTF-8", "byte offset 1236", "0xEF", "iconv"});
  EXPECT_FALSE(fs::exists(dir.path("out")));
}

// A FIFO with no writer: opening it to read would block for ever; it is refused at once.
TEST(PrepareTextCorpus, AFifoIsRefusedWithoutBlocking) {
  TempDir dir;
  ASSERT_EQ(::mkfifo(dir.path("fifo").c_str(), 0600), 0);
  expect_error([&] { prepare_text_corpus({dir.path("fifo")}, dir.path("out")); },
               {"prepare_text_corpus: ", "fifo: expected a regular file, found a FIFO"});
  EXPECT_FALSE(fs::exists(dir.path("out")));
}

TEST(PrepareTextCorpus, DirectoriesNoFilesAndTinyCorporaSayWhy) {
  TempDir dir;
  fs::create_directories(dir.path("adir"));
  expect_error([&] { prepare_text_corpus({dir.path("adir")}, dir.path("out")); },
               {"adir", "expected a regular file, found a directory"});
  expect_error([&] { prepare_text_corpus({}, dir.path("out")); },
               {"expected at least one text file"});
  const auto tiny = write_text(dir, "tiny.txt", "\n");
  expect_error([&] { prepare_text_corpus({tiny}, dir.path("out")); },
               {"the corpus has 1 bytes", "too few to split"});
}

TEST(PrepareTextCorpus, FortunesFilesSkipIndexesAndLinks) {
  TempDir dir;
  write_text(dir, "zen", "a\n%\nb\n");
  write_text(dir, "art", "c\n%\nd\n");
  write_text(dir, "art.dat", "\x00\x00\x00\x02");
  fs::create_symlink(dir.path("art"), dir.path("art.u8"));
  const std::vector<std::string> files = fortunes_corpus_files(dir.dir().string());
  EXPECT_EQ(files, (std::vector<std::string>{dir.path("art"), dir.path("zen")}));
  expect_error([&] { fortunes_corpus_files(dir.path("missing")); },
               {"missing", "is not a directory", "fortunes"});
}
