// IDX reader and MNIST loader: small files written here (plain and gzip), every broken-file
// case, and the installed Fashion-MNIST when present.
#include <unistd.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "lockstep/data/idx.h"
#include "lockstep/data/mnist.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::data;
using lockstep::testing::expect_error;
using lockstep::testing::values;
namespace fs = std::filesystem;

namespace {

void put_be32(std::string& s, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>(v >> shift));
}

// IDX header for `type` and `dims`.
std::string idx_header(uint8_t type, const std::vector<uint32_t>& dims) {
  std::string s{'\0', '\0', static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims) put_be32(s, d);
  return s;
}

std::string u8_idx(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data) {
  return idx_header(0x08, dims) + std::string(data.begin(), data.end());
}

void write_plain(const fs::path& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

void write_gzip(const fs::path& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb9");
  ASSERT_NE(f, nullptr) << path;
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::string read_all(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Pixel p of image i; spans all 256 values.
uint8_t pixel(int64_t i, int64_t p) { return static_cast<uint8_t>((i * 37 + p * 11) % 256); }

std::string mnist_images(uint32_t n, uint32_t rows = 28, uint32_t cols = 28) {
  std::vector<uint8_t> data(static_cast<size_t>(n) * rows * cols);
  for (size_t k = 0; k < data.size(); ++k) data[k] = pixel(k / (rows * cols), k % (rows * cols));
  return u8_idx({n, rows, cols}, data);
}

std::string mnist_labels(uint32_t n) {
  std::vector<uint8_t> data(n);
  for (uint32_t i = 0; i < n; ++i) data[i] = static_cast<uint8_t>((i * 3) % 10);
  return u8_idx({n}, data);
}

class IdxFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           (std::string("lockstep_idx_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string plain(const std::string& name, const std::string& bytes) {
    write_plain(dir_ / name, bytes);
    return (dir_ / name).string();
  }
  std::string gz(const std::string& name, const std::string& bytes) {
    write_gzip(dir_ / name, bytes);
    return (dir_ / name).string();
  }
  // Writes a split's two files; `gzip` picks the format.
  void write_split(const std::string& prefix, const std::string& images, const std::string& labels,
                   bool gzip) {
    const std::string ext = gzip ? ".gz" : "";
    auto w = [&](const std::string& name, const std::string& b) {
      gzip ? (void)gz(name + ext, b) : (void)plain(name, b);
    };
    w(prefix + "-images-idx3-ubyte", images);
    w(prefix + "-labels-idx1-ubyte", labels);
  }

  fs::path dir_;
};

// ---- read_idx on good files ----

TEST_F(IdxFiles, ReadsU8PlainAndGzip) {
  std::vector<uint8_t> data(2 * 3 * 4);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(250 - 10 * i % 256);
  for (bool gzip : {false, true}) {
    std::string path =
        gzip ? gz("a.gz", u8_idx({2, 3, 4}, data)) : plain("a", u8_idx({2, 3, 4}, data));
    Tensor t = read_idx(path);
    EXPECT_EQ(t.dtype(), kUInt8);
    EXPECT_EQ(t.shape(), (Dims{2, 3, 4}));
    EXPECT_EQ(t.to_vector<uint8_t>(), data) << path;
  }
}

TEST_F(IdxFiles, GzipIsRecognisedByContentNotName) {
  std::string bytes = u8_idx({3}, {7, 8, 9});
  EXPECT_EQ(values(read_idx(gz("no_suffix", bytes))), (std::vector<double>{7, 8, 9}));
  EXPECT_EQ(values(read_idx(plain("plain.gz", bytes))), (std::vector<double>{7, 8, 9}));
}

TEST_F(IdxFiles, ReadsConcatenatedGzipMembers) {
  std::string bytes = u8_idx({6}, {1, 2, 3, 4, 5, 6});
  gz("first", bytes.substr(0, 7));
  gz("second", bytes.substr(7));
  std::string path = plain("joined.gz", read_all(dir_ / "first") + read_all(dir_ / "second"));
  EXPECT_EQ(values(read_idx(path)), (std::vector<double>{1, 2, 3, 4, 5, 6}));
}

TEST_F(IdxFiles, ReadsEveryTypeBigEndian) {
  // i8: -2, 127
  std::string i8 = idx_header(0x09, {2}) + std::string{'\xfe', '\x7f'};
  // i16: -300, 1000
  std::string i16 = idx_header(0x0B, {2}) + std::string{'\xfe', '\xd4', '\x03', '\xe8'};
  std::string i32 = idx_header(0x0C, {2});
  put_be32(i32, static_cast<uint32_t>(-70000));
  put_be32(i32, 123456789);
  std::string f32 = idx_header(0x0D, {1, 2});
  for (float v : {1.5f, -0.25f}) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    put_be32(f32, bits);
  }
  std::string f64 = idx_header(0x0E, {1});
  double dv = -3.125e100;
  uint64_t dbits;
  std::memcpy(&dbits, &dv, 8);
  put_be32(f64, static_cast<uint32_t>(dbits >> 32));
  put_be32(f64, static_cast<uint32_t>(dbits));

  Tensor a = read_idx(plain("i8", i8));
  EXPECT_EQ(a.dtype(), kInt32);
  EXPECT_EQ(values(a), (std::vector<double>{-2, 127}));
  Tensor b = read_idx(gz("i16", i16));
  EXPECT_EQ(b.dtype(), kInt32);
  EXPECT_EQ(values(b), (std::vector<double>{-300, 1000}));
  Tensor c = read_idx(plain("i32", i32));
  EXPECT_EQ(c.dtype(), kInt32);
  EXPECT_EQ(values(c), (std::vector<double>{-70000, 123456789}));
  Tensor d = read_idx(plain("f32", f32));
  EXPECT_EQ(d.dtype(), kFloat32);
  EXPECT_EQ(d.shape(), (Dims{1, 2}));
  EXPECT_EQ(values(d), (std::vector<double>{1.5, -0.25}));
  Tensor e = read_idx(gz("f64", f64));
  EXPECT_EQ(e.dtype(), kFloat64);
  EXPECT_EQ(values(e), (std::vector<double>{-3.125e100}));
}

TEST_F(IdxFiles, ZeroSizedDimension) {
  Tensor t = read_idx(plain("empty", u8_idx({0, 28, 28}, {})));
  EXPECT_EQ(t.shape(), (Dims{0, 28, 28}));
}

// ---- read_idx on broken files ----

TEST_F(IdxFiles, MissingFile) {
  std::string path = (dir_ / "nope").string();
  expect_error([&] { read_idx(path); }, {"cannot open", path});
}

TEST_F(IdxFiles, TruncatedHeader) {
  for (bool gzip : {false, true}) {
    auto write = [&](const std::string& n, const std::string& b) {
      return gzip ? gz(n, b) : plain(n, b);
    };
    std::string p1 = write("short_magic", std::string("\0\0\x08", 3));
    expect_error([&] { read_idx(p1); },
                 {p1, "truncated header", "expected 4 magic bytes, found 3"});
    std::string p2 = write("short_dims", idx_header(0x08, {5, 28, 28}).substr(0, 12));
    expect_error([&] { read_idx(p2); },
                 {p2, "truncated header", "expected 12 bytes for 3 dimension sizes, found 8"});
    std::string p3 = write("empty_file", "");
    expect_error([&] { read_idx(p3); }, {p3, "found 0"});
  }
}

TEST_F(IdxFiles, TruncatedData) {
  std::string bytes = u8_idx({4, 5}, std::vector<uint8_t>(20, 1)).substr(0, 12 + 17);
  std::string p = plain("trunc", bytes);
  expect_error([&] { read_idx(p); }, {p, "truncated data", "[4, 5] u8", "needs 20 data bytes",
                                      "found 17", "expected 32"});
  std::string g = gz("trunc.gz", bytes);
  expect_error([&] { read_idx(g); }, {g, "truncated data", "needs 20 data bytes", "found 17"});
}

TEST_F(IdxFiles, WrongMagic) {
  std::string p = plain("magic", std::string("\x12\x34\x08\x01\0\0\0\x01\x05", 9));
  expect_error([&] { read_idx(p); }, {p, "bad magic number 0x12340801", "0x00 0x00"});
  std::string t = plain("type", idx_header(0x0A, {1}) + "x");
  expect_error([&] { read_idx(t); }, {t, "unsupported IDX type code 0x0A", "0x08 (u8)"});
  std::string z = plain("ndim0", idx_header(0x08, {}));
  expect_error([&] { read_idx(z); }, {z, "expected 1 to 8 dimensions, found 0"});
  std::string n = plain("ndim9", idx_header(0x08, {1, 1, 1, 1, 1, 1, 1, 1, 1}) + "x");
  expect_error([&] { read_idx(n); }, {n, "found 9"});
}

TEST_F(IdxFiles, TrailingGarbageAfterData) {
  std::string bytes = u8_idx({3}, {1, 2, 3}) + "junk";
  std::string p = plain("trail", bytes);
  expect_error([&] { read_idx(p); }, {p, "4 bytes of trailing garbage after the data",
                                      "accounts for 11 bytes", "has 15"});
  std::string g = gz("trail.gz", bytes);
  expect_error([&] { read_idx(g); },
               {g, "4 bytes of trailing garbage after the data", "decompressed file has 15"});
}

TEST_F(IdxFiles, BadGzipStream) {
  // Enough varied data that the compressed stream is long; a byte flipped in its middle breaks
  // either the deflate data or the CRC.
  std::vector<uint8_t> data(20000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>((i * i) % 251);
  gz("good.gz", u8_idx({20000}, data));
  std::string good = read_all(dir_ / "good.gz");
  ASSERT_GT(good.size(), 200u);
  EXPECT_EQ(read_idx((dir_ / "good.gz").string()).to_vector<uint8_t>(), data);

  std::string corrupt = good;
  for (size_t i = good.size() / 2; i < good.size() / 2 + 8; ++i) corrupt[i] ^= 0x5a;
  std::string c = plain("corrupt.gz", corrupt);
  expect_error([&] { read_idx(c); }, {c, "corrupt gzip stream"});

  std::string bad_crc = good;
  bad_crc[good.size() - 6] ^= 0x01;  // inside the CRC-32 of the trailer
  std::string b = plain("crc.gz", bad_crc);
  expect_error([&] { read_idx(b); }, {b, "corrupt gzip stream", "incorrect data check"});

  std::string t = plain("cut.gz", good.substr(0, good.size() - 20));
  expect_error([&] { read_idx(t); }, {t, "gzip stream is truncated"});

  std::string a = plain("after.gz", good + "garbage!");
  expect_error([&] { read_idx(a); }, {a, "8 bytes of trailing garbage after the gzip stream",
                                      "ends at byte " + std::to_string(good.size())});
}

TEST_F(IdxFiles, ImpossibleSizesAreRefusedBeforeAllocating) {
  std::string header = idx_header(0x08, {0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF});
  std::string p = plain("huge", header + "abc");
  expect_error([&] { read_idx(p); }, {p, "impossibly large"});
  std::string big = idx_header(0x0E, {1u << 30, 1u << 10});
  std::string g = gz("big.gz", big + "abc");
  expect_error([&] { read_idx(g); }, {g, "needs 8796093022208 data bytes", "gzip file of"});
  std::string q = plain("big", big + "abc");
  expect_error([&] { read_idx(q); }, {q, "truncated data", "found 3"});
}

// ---- load_mnist ----

TEST_F(IdxFiles, LoadsSmallMnistPlainAndGzip) {
  write_split("train", mnist_images(7), mnist_labels(7), /*gzip=*/true);
  write_split("t10k", mnist_images(3), mnist_labels(3), /*gzip=*/false);
  auto train = load_mnist(dir_.string(), Split::kTrain);
  auto test = load_mnist(dir_.string(), parse_split("test"));
  EXPECT_EQ(train->size(), 7);
  EXPECT_EQ(test->size(), 3);
  EXPECT_EQ(test->split(), Split::kTest);
  EXPECT_EQ(train->images().shape(), (Dims{7, 1, 28, 28}));
  EXPECT_EQ(train->images().dtype(), kFloat32);
  EXPECT_EQ(train->labels().shape(), (Dims{7}));
  EXPECT_EQ(train->labels().dtype(), kInt64);
  EXPECT_EQ(values(train->labels()), (std::vector<double>{0, 3, 6, 9, 2, 5, 8}));
  std::vector<float> px = train->images().to_vector<float>();
  for (int64_t i = 0; i < 7; ++i)
    for (int64_t p = 0; p < 784; ++p)
      ASSERT_FLOAT_EQ(px[i * 784 + p], pixel(i, p) / 255.0f) << i << " " << p;
  Example e = train->get(4);
  EXPECT_EQ(e.input.shape(), (Dims{1, 28, 28}));
  EXPECT_EQ(e.target.item(), 2.0);
}

TEST_F(IdxFiles, PlainFileWinsOverGzipAndNormalizeOption) {
  write_split("train", mnist_images(2), mnist_labels(2), /*gzip=*/false);
  write_split("train", mnist_images(5), mnist_labels(5), /*gzip=*/true);
  MnistOptions opts;
  opts.normalize = true;
  opts.mean = 0.5;
  opts.std = 0.25;
  auto ds = load_mnist(dir_.string(), Split::kTrain, opts);
  EXPECT_EQ(ds->size(), 2);
  std::vector<float> px = ds->images().to_vector<float>();
  for (int64_t p = 0; p < 784; ++p)
    ASSERT_NEAR(px[784 + p], (pixel(1, p) / 255.0 - 0.5) / 0.25, 1e-5);
  expect_error([] { parse_split("validation"); }, {"\"train\" or \"test\"", "validation"});
}

TEST_F(IdxFiles, MnistMissingDirectoryOrFile) {
  std::string missing = (dir_ / "absent").string();
  expect_error([&] { load_mnist(missing, Split::kTrain); },
               {missing, "does not exist", "train-images-idx3-ubyte, train-images-idx3-ubyte.gz",
                "train-labels-idx1-ubyte.gz", kDefaultFashionMnistDir});
  plain("t10k-images-idx3-ubyte", mnist_images(2));
  expect_error([&] { load_mnist(dir_.string(), Split::kTest); },
               {(dir_ / "t10k-labels-idx1-ubyte").string(),
                (dir_ / "t10k-labels-idx1-ubyte.gz").string(), "neither"});
  expect_error([&] { load_mnist(dir_.string(), Split::kTrain); },
               {(dir_ / "train-images-idx3-ubyte.gz").string()});
}

TEST_F(IdxFiles, MnistCountMismatch) {
  write_split("train", mnist_images(5), mnist_labels(4), /*gzip=*/true);
  expect_error(
      [&] { load_mnist(dir_.string(), Split::kTrain); },
      {"image and label counts differ", (dir_ / "train-images-idx3-ubyte.gz").string(),
       "holds 5 images", (dir_ / "train-labels-idx1-ubyte.gz").string(), "holds 4 labels"});
}

TEST_F(IdxFiles, MnistWrongDims) {
  std::string images = (dir_ / "train-images-idx3-ubyte").string();
  std::string labels = (dir_ / "train-labels-idx1-ubyte").string();
  write_split("train", mnist_images(2, 28, 27), mnist_labels(2), false);
  expect_error([&] { load_mnist(dir_.string(), Split::kTrain); },
               {images, "expected 28x28 images, found 28x27", "[2, 28, 27]"});
  write_split("train", u8_idx({2, 784}, std::vector<uint8_t>(2 * 784)), mnist_labels(2), false);
  expect_error([&] { load_mnist(dir_.string(), Split::kTrain); },
               {images, "expected u8 images with 3 dims", "0x00000803", "[2, 784]"});
  write_split("train", mnist_images(2), u8_idx({2, 1}, {1, 2}), false);
  expect_error([&] { load_mnist(dir_.string(), Split::kTrain); },
               {labels, "expected u8 labels with 1 dim", "0x00000801", "[2, 1]"});
  std::string i32_labels = idx_header(0x0C, {2});
  put_be32(i32_labels, 1);
  put_be32(i32_labels, 2);
  write_split("train", mnist_images(2), i32_labels, false);
  expect_error([&] { load_mnist(dir_.string(), Split::kTrain); },
               {labels, "expected u8 labels", "found i32"});
}

TEST_F(IdxFiles, MnistBrokenFilesNameTheFile) {
  std::string labels = (dir_ / "train-labels-idx1-ubyte").string();
  write_split("train", mnist_images(3), u8_idx({3}, {1, 10, 2}), false);
  expect_error([&] { load_mnist(dir_.string(), Split::kTrain); },
               {labels, "label 10 at index 1", "outside [0, 10)"});
  write_split("train", mnist_images(3), mnist_labels(3) + "x", false);
  expect_error([&] { load_mnist(dir_.string(), Split::kTrain); }, {labels, "trailing garbage"});
  fs::remove(dir_ / "train-images-idx3-ubyte");
  fs::remove(dir_ / "train-labels-idx1-ubyte");
  std::string images = mnist_images(3);
  write_split("train", images.substr(0, images.size() - 1), mnist_labels(3), true);
  expect_error([&] { load_mnist(dir_.string(), Split::kTrain); },
               {(dir_ / "train-images-idx3-ubyte.gz").string(), "truncated data",
                "needs 2352 data bytes, found 2351"});
}

// ---- the installed Fashion-MNIST ----

TEST(FashionMnist, RealDatasetWhenInstalled) {
  if (!fs::is_directory(kDefaultFashionMnistDir)) {
    GTEST_SKIP() << kDefaultFashionMnistDir << " is absent (Debian package dataset-fashion-mnist)";
  }
  for (Split split : {Split::kTrain, Split::kTest}) {
    auto ds = load_mnist(kDefaultFashionMnistDir, split);
    const int64_t n = split == Split::kTrain ? 60000 : 10000;
    ASSERT_EQ(ds->size(), n);
    EXPECT_EQ(ds->images().shape(), (Dims{n, 1, 28, 28}));
    EXPECT_EQ(ds->labels().shape(), (Dims{n}));
    // Every class is equally represented: 6000 per class in train, 1000 in test.
    std::map<int64_t, int64_t> per_class;
    for (int64_t y : ds->labels().to_vector<int64_t>()) ++per_class[y];
    ASSERT_EQ(per_class.size(), 10u);
    for (auto [label, count] : per_class) {
      EXPECT_GE(label, 0);
      EXPECT_LT(label, 10);
      EXPECT_EQ(count, n / 10) << "class " << label;
    }
    double lo = 1, hi = 0, sum = 0;
    const float* px = ds->images().data<float>();
    for (int64_t i = 0; i < ds->images().numel(); ++i) {
      lo = std::min<double>(lo, px[i]);
      hi = std::max<double>(hi, px[i]);
      sum += px[i];
    }
    EXPECT_EQ(lo, 0.0);
    EXPECT_EQ(hi, 1.0);
    // The published pixel mean of Fashion-MNIST is about 0.286.
    EXPECT_NEAR(sum / ds->images().numel(), kFashionMnistMean, 0.005);
  }
}

}  // namespace
