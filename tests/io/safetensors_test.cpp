// safetensors: byte layout, round trips of every dtype, metadata, atomic writes, corrupt files.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "lockstep/io/safetensors.h"
#include "lockstep/nn/layers.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::io;
using lockstep::testing::expect_error;
namespace fs = std::filesystem;

namespace {
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("lockstep_st_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  static std::string read(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
  static void write(const std::string& p, const std::string& bytes) {
    std::ofstream(p, std::ios::binary) << bytes;
  }
  // A file with the given header JSON and `data_bytes` bytes of zeros.
  static std::string file_with(const std::string& header, size_t data_bytes) {
    std::string out(8, '\0');
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
    return out + header + std::string(data_bytes, '\0');
  }
  fs::path dir_;
};
}  // namespace

TEST_F(SafetensorsTest, ByteLayoutIsTheSafetensorsFormat) {
  Tensor a = from_vector<float>({1.0f, 2.0f, 3.0f}, {3});
  Tensor b = from_vector<int64_t>({7, 8}, {2, 1});
  save_safetensors(path("x.safetensors"), {{"a", a}, {"b", b}}, {{"format", "pt"}});
  const std::string bytes = read(path("x.safetensors"));
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  EXPECT_EQ((8 + hlen) % 8, 0u);  // data 8-byte aligned
  auto header = nlohmann::json::parse(bytes.substr(8, hlen));
  EXPECT_EQ(header["a"]["dtype"], "F32");
  EXPECT_EQ(header["a"]["shape"], nlohmann::json::array({3}));
  EXPECT_EQ(header["a"]["data_offsets"], nlohmann::json::array({0, 12}));
  EXPECT_EQ(header["b"]["dtype"], "I64");
  EXPECT_EQ(header["b"]["data_offsets"], nlohmann::json::array({12, 28}));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  ASSERT_EQ(bytes.size(), 8 + hlen + 28);
  float f[3];
  std::memcpy(f, bytes.data() + 8 + hlen, 12);
  EXPECT_EQ(f[2], 3.0f);
  // No temporary file left behind.
  int files = 0;
  for (auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST_F(SafetensorsTest, RoundTripEveryDtypeNonContiguousAndEmpty) {
  Generator gen(0);
  NamedTensors in;
  for (DType dt : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool})
    in.emplace_back(std::string(dtype_name(dt)), randn({3, 5}, gen).mul_(3.0).to(dt));
  in.emplace_back("transposed", randn({4, 6}, gen).t());
  in.emplace_back("empty", zeros({0, 3}));
  in.emplace_back("scalar", scalar_tensor(2.5));
  save_safetensors(path("all.safetensors"), in);
  auto out = load_safetensors(path("all.safetensors"));
  ASSERT_EQ(out.tensors.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out.tensors[i].first, in[i].first);
    EXPECT_EQ(out.tensors[i].second.dtype(), in[i].second.dtype());
    EXPECT_EQ(out.tensors[i].second.shape(), in[i].second.shape());
    EXPECT_TRUE(equal(out.tensors[i].second, in[i].second)) << in[i].first;
  }
  EXPECT_TRUE(out.metadata.empty());
}

TEST_F(SafetensorsTest, ModuleStateDictRoundTrip) {
  Generator g1(1), g2(2);
  nn::Linear a(5, 3, g1), b(5, 3, g2);
  save_safetensors(path("m.safetensors"), a.state_dict());
  b.load_state_dict(load_safetensors(path("m.safetensors")).tensors);
  EXPECT_TRUE(equal(a.weight(), b.weight()));
  EXPECT_TRUE(equal(a.bias(), b.bias()));
}

TEST_F(SafetensorsTest, CorruptFilesAreClearErrors) {
  const std::string p = path("bad.safetensors");
  write(p, "abc");
  expect_error([&] { (void)load_safetensors(p); }, {p, "too short"});
  std::string huge(8, '\xff');
  write(p, huge + "{}");
  expect_error([&] { (void)load_safetensors(p); }, {p, "header length", "impossible"});
  write(p, file_with("{not json", 0));
  expect_error([&] { (void)load_safetensors(p); }, {p, "not valid JSON"});
  write(p, file_with(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8));
  expect_error([&] { (void)load_safetensors(p); }, {p, "'a'", "only 8 bytes", "truncated"});
  write(p, file_with(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16));
  expect_error([&] { (void)load_safetensors(p); }, {"'a'", "needs 12 bytes", "hold 16"});
  write(p, file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8));
  expect_error([&] { (void)load_safetensors(p); }, {"starts at byte 4", "gaps"});
  write(p, file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8));
  expect_error([&] { (void)load_safetensors(p); }, {"4 bytes of data after the last tensor"});
  write(p, file_with(R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}})", 4));
  expect_error([&] { (void)load_safetensors(p); }, {"unsupported safetensors dtype 'Q7'"});
  write(p, file_with(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4));
  expect_error([&] { (void)load_safetensors(p); }, {"malformed header entry"});
  write(p, file_with(R"({"a":{"dtype":"F32","shape":[4611686018427387905,4],"data_offsets":[0,16]}})", 16));
  expect_error([&] { (void)load_safetensors(p); }, {"'a'", "does not fit in 64 bits"});
  expect_error([&] { (void)load_safetensors(path("missing.safetensors")); }, {"cannot open"});
  expect_error([&] { save_safetensors(p, {{"x", ones({1})}, {"x", ones({1})}}); },
               {"duplicate tensor name 'x'"});
  expect_error([&] { save_safetensors(path("no/such/dir/f.safetensors"), {{"x", ones({1})}}); },
               {"cannot create"});
}
