// safetensors: byte layout, round trips of every dtype, interop with an independent writer and
// with PyTorch, one test per validation error, memory-mapped zero-copy loads, atomic writes.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "io/safetensors_reference.h"
#include "lockstep/io/safetensors.h"
#include "lockstep/nn/layers.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::io;
using lockstep::testing::expect_error;
using lockstep::testing::make;
namespace st = lockstep::testing::st;
namespace fs = std::filesystem;
using namespace std::string_literals;

namespace {

constexpr DType kAllDtypes[] = {kFloat32, kFloat64, kBFloat16, kFloat16,
                                kInt32,   kInt64,   kUInt8,    kBool};

// Every load both ways: read into memory, and memory-mapped whatever the size.
const SafetensorsLoadOptions kRead{.mmap_min_bytes = SIZE_MAX};
const SafetensorsLoadOptions kMap{.mmap_min_bytes = 0};

class SafetensorsTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return dir_.path(name); }
  st::TempDir dir_;
};

// The row-major bytes of `t` (exact comparison for every dtype, NaN and -0 included).
std::string bytes_of(const Tensor& t) {
  Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.nbytes()));
}

void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_EQ(got.dtype(), want.dtype()) << what;
  EXPECT_EQ(got.shape(), want.shape()) << what;
  // Tensor::is_contiguous() says false for some empty shapes ([2, 0, 4]) even as empty() makes
  // them.
  if (want.numel() > 0) EXPECT_TRUE(got.is_contiguous()) << what;
  EXPECT_EQ(bytes_of(got), bytes_of(want)) << what;
}

std::map<std::string, Tensor> by_name(const NamedTensors& v) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : v) EXPECT_TRUE(out.emplace(name, t).second) << name;
  return out;
}

}  // namespace

TEST_F(SafetensorsTest, ByteLayoutIsTheSafetensorsFormat) {
  Tensor a = from_vector<float>({1.0f, 2.0f, 3.0f}, {3});
  Tensor b = from_vector<int64_t>({7, 8}, {2, 1});
  save_safetensors(path("x.safetensors"), {{"a", a}, {"b", b}}, {{"format", "pt"}});
  const std::string bytes = st::read_file(path("x.safetensors"));
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i)
    hlen |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
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
  for (auto& e : fs::directory_iterator(dir_.dir())) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST_F(SafetensorsTest, RoundTripEveryDtypeShapeAndLayoutWithMetadata) {
  Generator gen(0);
  NamedTensors in;
  for (DType dt : kAllDtypes) {
    const std::string n(dtype_name(dt));
    Tensor r = randn({3, 5}, gen).mul_(3.0).to(dt);
    in.emplace_back(n, r);
    in.emplace_back(n + "_scalar", randn({}, gen).mul_(3.0).to(dt));
    in.emplace_back(n + "_empty", zeros({0, 3}, dt));
    in.emplace_back(n + "_empty_middle", zeros({2, 0, 4}, dt));
    in.emplace_back(n + "_transposed", r.t());
    in.emplace_back(n + "_strided", lockstep::testing::non_contiguous(r.select(0, 1)));
  }
  const Metadata meta{{"format", "pt"}, {"quote \" backslash \\", "line\nbreak \xe2\x9c\x93"}};
  save_safetensors(path("all.safetensors"), in, meta);
  for (const auto& opts : {kRead, kMap}) {
    auto out = load_safetensors(path("all.safetensors"), opts);
    ASSERT_EQ(out.tensors.size(), in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      EXPECT_EQ(out.tensors[i].first, in[i].first);  // file order is the order given to save
      expect_same(out.tensors[i].second, in[i].second, in[i].first);
    }
    EXPECT_EQ(out.metadata, meta);
  }
}

TEST_F(SafetensorsTest, ModuleStateDictRoundTrip) {
  Generator g1(1), g2(2);
  nn::Linear a(5, 3, g1), b(5, 3, g2);
  save_safetensors(path("m.safetensors"), a.state_dict());
  b.load_state_dict(load_safetensors(path("m.safetensors")).tensors);
  EXPECT_TRUE(equal(a.weight(), b.weight()));
  EXPECT_TRUE(equal(a.bias(), b.bias()));
}

// ---- interop: files written without lockstep ----

TEST_F(SafetensorsTest, LoadsAFileFromTheReferenceWriter) {
  // Values chosen so each dtype's encoding is checked bit for bit (bf16/f16 given as bits).
  const std::vector<st::RefTensor> ref = {
      {"f32", "F32", {2, 2}, st::bytes_of<float>({1.5f, -2.0f, 0.1f, 1e30f})},
      {"u8", "U8", {3}, st::bytes_of<uint8_t>({0, 7, 255})},  // leaves what follows misaligned
      {"f64", "F64", {2}, st::bytes_of<double>({1.0 / 3.0, -1e300})},
      {"bf16", "BF16", {3}, st::bytes_of<uint16_t>({0x3F80, 0xC000, 0x3EAB})},
      {"f16", "F16", {3}, st::bytes_of<uint16_t>({0x3C00, 0xC000, 0x3555})},
      {"i32", "I32", {2}, st::bytes_of<int32_t>({-2147483647 - 1, 123456789})},
      {"i64", "I64", {1, 2}, st::bytes_of<int64_t>({-(int64_t{1} << 53), int64_t{1} << 40})},
      {"mask", "BOOL", {3}, st::bytes_of<uint8_t>({1, 0, 1})},
      {"scalar", "F32", {}, st::bytes_of<float>({4.25f})},
      {"none", "I64", {0, 3}, ""},
      {"none2", "BOOL", {0}, ""},
  };
  const std::map<std::string, std::vector<double>> want = {
      {"f32", {1.5, -2.0, double(0.1f), double(1e30f)}},
      {"u8", {0, 7, 255}},
      {"f64", {1.0 / 3.0, -1e300}},
      {"bf16", {1.0, -2.0, 0.333984375}},
      {"f16", {1.0, -2.0, 0.333251953125}},
      {"i32", {-2147483648.0, 123456789}},
      {"i64", {-9007199254740992.0, 1099511627776.0}},
      {"mask", {1, 0, 1}},
      {"scalar", {4.25}},
      {"none", {}},
      {"none2", {}},
  };
  const std::vector<std::pair<std::string, std::string>> meta = {{"format", "pt"}, {"step", "12"}};
  // Unpadded header: the data starts at an odd offset, so the mapped load must copy.
  for (size_t align : {size_t{1}, size_t{8}}) {
    st::write_file(path("ref.safetensors"), st::file_of(ref, meta, align));
    for (const auto& opts : {kRead, kMap}) {
      auto out = load_safetensors(path("ref.safetensors"), opts);
      ASSERT_EQ(out.tensors.size(), ref.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        const auto& [name, t] = out.tensors[i];
        EXPECT_EQ(name, ref[i].name);
        EXPECT_EQ(safetensors_dtype(t.dtype()), ref[i].dtype) << name;
        EXPECT_EQ(t.shape(), Dims(ref[i].shape)) << name;
        EXPECT_EQ(bytes_of(t), ref[i].bytes) << name;
        EXPECT_EQ(t.to_vector<double>(), want.at(name)) << name;
      }
      EXPECT_EQ(out.metadata, (Metadata{{"format", "pt"}, {"step", "12"}}));
    }
  }
}

TEST_F(SafetensorsTest, EdgeCasesTheFormatAllows) {
  // Empty tensors sharing an offset with each other and with their neighbours, an empty index,
  // and a header padded with trailing spaces.
  const std::string f32 = R"("dtype":"F32","shape":[1])";
  st::write_file(path("e.safetensors"),
                 st::file_with(R"({"z":{"dtype":"I64","shape":[0],"data_offsets":[4,4]},)"
                               R"("a":{)" +
                                   f32 +
                                   R"(,"data_offsets":[0,4]},)"
                                   R"("y":{"dtype":"U8","shape":[3,0],"data_offsets":[0,0]},)"
                                   R"("b":{)" +
                                   f32 + R"(,"data_offsets":[4,8]}}     )",
                               std::string(8, '\0')));
  auto out = load_safetensors(path("e.safetensors"));
  ASSERT_EQ(out.tensors.size(), 4u);
  EXPECT_EQ(out.tensors[0].first, "y");
  EXPECT_EQ(out.tensors[1].first, "a");
  EXPECT_EQ(out.tensors[2].first, "z");
  EXPECT_EQ(out.tensors[3].first, "b");
  st::write_file(path("none.safetensors"), st::file_with("{}", ""));
  EXPECT_TRUE(load_safetensors(path("none.safetensors")).tensors.empty());
  st::write_file(path("meta.safetensors"), st::file_with(R"({"__metadata__":{}})", ""));
  EXPECT_TRUE(load_safetensors(path("meta.safetensors")).metadata.empty());
}

namespace {

// The python3 that has torch (the `safetensors` package is not needed), if any; looked up once.
// LOCKSTEP_TEST_PYTHON names the only interpreter to try.
std::optional<std::string> python_with_torch() {
  static const std::optional<std::string> found = []() -> std::optional<std::string> {
    std::vector<std::string> candidates = {"/usr/bin/python3", "python3"};
    if (const char* env = std::getenv("LOCKSTEP_TEST_PYTHON")) candidates = {env};
    for (const std::string& py : candidates) {
      const std::string cmd = "'" + py + "' -c 'import torch' >/dev/null 2>&1";
      if (std::system(cmd.c_str()) == 0) return py;
    }
    return std::nullopt;
  }();
  return found;
}

// Runs tests/io/safetensors_torch.py; returns its exit status and output.
std::pair<int, std::string> run_torch_script(const std::string& python, const std::string& verb,
                                             const std::string& file) {
  const fs::path script = fs::path(__FILE__).parent_path() / "safetensors_torch.py";
  EXPECT_TRUE(fs::exists(script)) << script;
  const std::string cmd =
      "'" + python + "' '" + script.string() + "' " + verb + " '" + file + "' 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// The tensors of expected() in safetensors_torch.py, built independently here.
NamedTensors torch_expected() {
  return {
      {"f32", make(
                  {2, 3, 4}, [](int64_t i) { return i * 0.5 - 3; }, kFloat32)},
      {"f64", make(
                  {4, 6}, [](int64_t i) { return i / 3.0; }, kFloat64)},
      {"bf16", make(
                   {6, 4}, [](int64_t i) { return i * 0.25 - 2; }, kBFloat16)},
      {"f16", make(
                  {24}, [](int64_t i) { return i * 0.125 - 1; }, kFloat16)},
      {"i32", make(
                  {3, 8}, [](int64_t i) { return i * -1000.0 + 7; }, kInt32)},
      {"i64", make(
                  {24, 1}, [](int64_t i) { return double(i - 12 + (int64_t{1} << 40)); }, kInt64)},
      {"u8", make(
                 {4, 6}, [](int64_t i) { return double(i * 11 % 256); }, kUInt8)},
      {"bool", make(
                   {2, 12}, [](int64_t i) { return i % 3 == 0 ? 1.0 : 0.0; }, kBool)},
      {"scalar", scalar_tensor(2.5, kFloat32)},
      {"empty", zeros({0, 3}, kFloat16)},
  };
}

const Metadata kTorchMetadata{{"format", "pt"}, {"note", "from \"torch\"\n\xe2\x9c\x93"}};

}  // namespace

TEST_F(SafetensorsTest, LoadsAFileWrittenByTorch) {
  const auto python = python_with_torch();
  if (!python) GTEST_SKIP() << "needs python3 with torch (Debian: python3-torch)";
  const std::string p = path("torch.safetensors");
  const auto [rc, output] = run_torch_script(*python, "write", p);
  ASSERT_EQ(rc, 0) << output;
  for (const auto& opts : {kRead, kMap}) {
    auto out = load_safetensors(p, opts);
    const auto got = by_name(out.tensors);
    const NamedTensors want = torch_expected();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, t] : want) {
      ASSERT_TRUE(got.count(name)) << name;
      expect_same(got.at(name), t, name);
    }
    EXPECT_EQ(out.metadata, kTorchMetadata);
  }
}

TEST_F(SafetensorsTest, TorchLoadsAFileWrittenByLockstep) {
  const auto python = python_with_torch();
  if (!python) GTEST_SKIP() << "needs python3 with torch (Debian: python3-torch)";
  NamedTensors tensors = torch_expected();
  // Layout is lockstep's business: what torch sees must be the same values.
  tensors[1].second = lockstep::testing::non_contiguous(tensors[1].second);
  tensors[7].second = lockstep::testing::non_contiguous(tensors[7].second);
  const std::string p = path("lockstep.safetensors");
  save_safetensors(p, tensors, kTorchMetadata);
  const auto [rc, output] = run_torch_script(*python, "check", p);
  EXPECT_EQ(rc, 0) << output;
  // The checker does compare: a changed value fails it.
  tensors[0].second = tensors[0].second.clone();
  tensors[0].second.set_at({1, 2, 3}, 99.0);
  save_safetensors(p, tensors, kTorchMetadata);
  const auto [rc2, output2] = run_torch_script(*python, "check", p);
  EXPECT_EQ(rc2, 1) << output2;
  EXPECT_THAT(output2, ::testing::HasSubstr("f32: got"));
}

// ---- validation: one case per error, each naming the file and the problem ----

namespace {

struct BadFile {
  std::string name;
  std::string bytes;
  std::vector<std::string> expect;  // substrings of the message besides the file name
};

void PrintTo(const BadFile& b, std::ostream* os) { *os << b.name; }

// A file with one F32 tensor entry whose fields are `fields`, followed by `data`.
std::string one_entry(const std::string& fields, const std::string& data) {
  return st::file_with(R"({"a":{)" + fields + "}}", data);
}

std::vector<BadFile> bad_files() {
  const std::string d4(4, '\0'), d8(8, '\0'), d12(12, '\0'), d16(16, '\0');
  const std::string ok = R"("dtype":"F32","shape":[1],"data_offsets":[0,4])";
  return {
      {"too_short", "abc", {"is 3 bytes, too short for the 8-byte header length"}},
      {"header_length_beyond_file",
       st::le64(1000) + "{}",
       {"header length 1000 is impossible", "at most the 2 bytes", "file of 10 bytes"}},
      {"header_length_all_ones",
       std::string(8, '\xff') + "{}",
       {"header length 18446744073709551615 is impossible"}},
      {"empty_header", st::file_with("", ""), {"header is not valid JSON"}},
      {"invalid_json", st::file_with("{not json", ""), {"header is not valid JSON", "parse error"}},
      {"text_after_json", st::file_with("{} {}", ""), {"header is not valid JSON"}},
      {"invalid_utf8", st::file_with("{\"\xff\":1}", ""), {"header is not valid JSON"}},
      {"header_not_object",
       st::file_with("[1,2]", ""),
       {"header must be a JSON object", "found array [1,2]"}},
      {"metadata_not_object",
       st::file_with(R"({"__metadata__":"pt"})", ""),
       {"__metadata__ must be an object of strings, found string \"pt\""}},
      {"metadata_value_not_string",
       st::file_with(R"({"__metadata__":{"epoch":3}})", ""),
       {"__metadata__ must be an object of strings, but 'epoch' is number 3"}},
      {"entry_not_object",
       st::file_with(R"({"a":[1]})", ""),
       {"tensor 'a': expected an object {dtype, shape, data_offsets}, found array [1]"}},
      {"entry_missing_field",
       one_entry(R"("dtype":"F32","shape":[1])", d4),
       {"tensor 'a' has no 'data_offsets' (expected exactly dtype, shape, data_offsets)"}},
      {"entry_extra_field",
       one_entry(ok + R"(,"crc":1)", d4),
       {"tensor 'a' has unexpected key 'crc' (expected exactly dtype, shape, data_offsets)"}},
      {"dtype_not_string",
       one_entry(R"("dtype":32,"shape":[1],"data_offsets":[0,4])", d4),
       {"tensor 'a': dtype must be a string such as \"F32\", found number 32"}},
      {"dtype_unsupported",
       one_entry(R"("dtype":"Q7","shape":[1],"data_offsets":[0,4])", d4),
       {"tensor 'a': unsupported safetensors dtype 'Q7'", "lockstep reads F32"}},
      {"shape_not_list",
       one_entry(R"("dtype":"F32","shape":4,"data_offsets":[0,16])", d16),
       {"tensor 'a': shape must be a list of non-negative integers, found number 4"}},
      {"shape_not_integer",
       one_entry(R"("dtype":"F32","shape":[2.5],"data_offsets":[0,8])", d8),
       {"shape must be a list of non-negative integers, but dimension 0 is number 2.5"}},
      {"shape_negative",
       one_entry(R"("dtype":"F32","shape":[2,-1],"data_offsets":[0,8])", d8),
       {"but dimension 1 is number -1"}},
      {"shape_beyond_int64",
       one_entry(R"("dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8])", d8),
       {"but dimension 0 is number 9223372036854775808"}},
      {"shape_too_many_dims",
       one_entry(R"("dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4])", d4),
       {"tensor 'a': shape has 9 dimensions, lockstep tensors have at most 8"}},
      {"shape_elements_overflow",
       one_entry(R"("dtype":"F32","shape":[4611686018427387905,4],"data_offsets":[0,16])", d16),
       {"tensor 'a': shape [4611686018427387905,4] has more elements than fit in 64 bits"}},
      {"empty_shape_overflow",
       one_entry(R"("dtype":"F32","shape":[4611686018427387905,4,0],"data_offsets":[0,0])", ""),
       {"has more elements than fit in 64 bits"}},
      {"shape_bytes_overflow",
       one_entry(R"("dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8])", d8),
       {"tensor 'a': shape [4611686018427387904] of F64 needs more bytes than fit in 64 bits"}},
      {"offsets_not_pair",
       one_entry(R"("dtype":"F32","shape":[1],"data_offsets":[0])", d4),
       {"data_offsets must be a list of two integers [begin, end], found array [0]"}},
      {"offsets_negative",
       one_entry(R"("dtype":"F32","shape":[1],"data_offsets":[-4,0])", d4),
       {"data_offsets must be non-negative integers, but begin is number -4"}},
      {"offsets_not_integer",
       one_entry(R"("dtype":"F32","shape":[1],"data_offsets":[0,"4"])", d4),
       {"data_offsets must be non-negative integers, but end is string \"4\""}},
      {"offsets_reversed",
       one_entry(R"("dtype":"F32","shape":[1],"data_offsets":[4,0])", d4),
       {"data_offsets [4, 0] end before they begin (expected begin <= end)"}},
      {"size_mismatch",
       one_entry(R"("dtype":"F32","shape":[3],"data_offsets":[0,16])", d16),
       {"tensor 'a' of dtype F32 and shape [3] needs 12 bytes", "[0, 16] hold 16"}},
      {"gap_at_start",
       one_entry(R"("dtype":"F32","shape":[1],"data_offsets":[4,8])", d8),
       {"tensor 'a' starts at byte 4 but the previous tensor ended at 0", "gaps"}},
      {"gap_between",
       st::file_with(R"({"a":{)" + ok +
                         R"(},"b":{"dtype":"F32","shape":[1],)"
                         R"("data_offsets":[8,12]}})",
                     d12),
       {"tensor 'b' starts at byte 8 but the previous tensor ended at 4, leaving 4 bytes unused"}},
      {"overlap",
       st::file_with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                     d8),
       {"tensor 'b' (bytes [4, 8)) overlaps tensor 'a' (bytes [0, 8))", "start at byte 8"}},
      {"same_range_twice",
       st::file_with(R"({"a":{)" + ok + R"(},"b":{)" + ok + "}}", d4),
       {"tensor 'b' (bytes [0, 4)) overlaps tensor 'a'"}},
      {"beyond_file",
       one_entry(R"("dtype":"F32","shape":[4],"data_offsets":[0,16])", d8),
       {"tensor 'a' ends at byte 16 but the file holds only 8 bytes of data (truncated?)"}},
      {"data_after_last_tensor",
       one_entry(ok, d8),
       {"4 bytes of data after the last tensor (expected the tensors to cover all 8 bytes"}},
      {"data_without_tensors", st::file_with("{}", d4), {"4 bytes of data after the last tensor"}},
      {"duplicate_names",
       st::file_with(R"({"a":{)" + ok + R"(},"a":{)" + ok + "}}", d4),
       {"tensor name 'a' appears twice in the header (expected unique names)"}},
      {"duplicate_field",
       one_entry(R"("dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4])", d4),
       {"key 'dtype' appears twice in the same object under 'a' (expected unique keys)"}},
      {"duplicate_metadata_key",
       st::file_with(R"({"__metadata__":{"k":"1","k":"2"}})", ""),
       {"key 'k' appears twice in the same object under '__metadata__'"}},
      {"bool_not_0_or_1",
       st::file_with(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", "\1\0\2"s),
       {"tensor 'm' of dtype BOOL holds 2 at element 2 (expected 0 or 1)"}},
  };
}

class SafetensorsRejects : public ::testing::TestWithParam<BadFile> {
 protected:
  st::TempDir dir_;
};

}  // namespace

TEST_P(SafetensorsRejects, WithAMessageNamingFileAndProblem) {
  const BadFile& bad = GetParam();
  const std::string p = dir_.path(bad.name + ".safetensors");
  st::write_file(p, bad.bytes);
  for (const auto& opts : {kRead, kMap}) {
    SCOPED_TRACE(opts.mmap_min_bytes == 0 ? "mapped" : "read");
    std::vector<std::string> parts = bad.expect;
    parts.push_back("load_safetensors: " + p);
    expect_error([&] { (void)load_safetensors(p, opts); }, parts);
  }
}

INSTANTIATE_TEST_SUITE_P(Safetensors, SafetensorsRejects, ::testing::ValuesIn(bad_files()),
                         [](const auto& info) { return info.param.name; });

TEST_F(SafetensorsTest, RejectsAHeaderOverTheSizeLimit) {
  // A sparse file, so the 100 MiB limit costs no disk.
  const std::string p = path("huge.safetensors");
  const uint64_t hlen = (uint64_t{100} << 20) + 1;
  st::write_file(p, st::le64(hlen) + "{");
  ASSERT_EQ(::truncate(p.c_str(), static_cast<off_t>(8 + hlen)), 0);
  expect_error([&] { (void)load_safetensors(p); },
               {p, "header length 104857601 is over the 100 MiB limit"});
}

TEST_F(SafetensorsTest, RejectsMissingFilesAndDirectories) {
  const std::string missing = path("missing.safetensors");
  expect_error([&] { (void)load_safetensors(missing); },
               {"load_safetensors: cannot open " + missing, "No such file"});
  expect_error([&] { (void)load_safetensors(dir_.dir().string()); },
               {dir_.dir().string(), "is not a regular file"});
}

// ---- memory-mapped loads ----

namespace {

// Whether `addr` lies in a mapping of file `file` (per /proc/self/maps); with addr null, whether
// any part of the file is mapped.
bool mapped_from(const std::string& file, const void* addr) {
  const std::string want = fs::canonical(file).string();
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    std::istringstream ls(line);
    std::string range, perms, offset, dev, inode, name;
    ls >> range >> perms >> offset >> dev >> inode;
    std::getline(ls >> std::ws, name);
    if (name != want) continue;
    const auto dash = range.find('-');
    const uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    const auto a = reinterpret_cast<uintptr_t>(addr);
    if (!addr || (lo <= a && a < hi)) return true;
  }
  return false;
}

}  // namespace

TEST_F(SafetensorsTest, LargeFilesAreMappedZeroCopyAndCopyOnWrite) {
  constexpr int64_t kBig = int64_t{1} << 19;  // 2 MiB of f32: over the default mmap threshold
  Tensor big = arange(0.0, static_cast<double>(kBig), 1.0, kFloat32);
  Tensor shifted = from_vector<float>({1.0f, 2.0f, 3.0f}, {3});
  const std::string p = path("big.safetensors");
  // "odd" leaves "shifted" at an odd offset: it must be copied, not pointed to.
  save_safetensors(p, {{"big", big}, {"odd", ones({1}, kUInt8)}, {"shifted", shifted}});
  const std::string on_disk = st::read_file(p);

  Tensor kept;
  {
    auto out = load_safetensors(p);
    ASSERT_EQ(out.tensors.size(), 3u);
    const Tensor& b = out.tensors[0].second;
    EXPECT_FALSE(b.storage()->owned());
    EXPECT_TRUE(mapped_from(p, b.data_ptr())) << "big should point into the mapping";
    EXPECT_EQ(b.storage()->nbytes(), static_cast<size_t>(b.nbytes()));
    const Tensor& s = out.tensors[2].second;
    EXPECT_TRUE(s.storage()->owned()) << "a misaligned tensor is copied";
    EXPECT_FALSE(mapped_from(p, s.data_ptr()));
    expect_same(s, shifted, "shifted");
    kept = b;
  }
  // The contents are gone; the tensor keeps the mapping and its values.
  EXPECT_TRUE(mapped_from(p, kept.data_ptr()));
  expect_same(kept, big, "big after the contents are destroyed");

  // Writes go to private pages: the file does not change, and a new load sees the old values.
  kept.fill_(7.0);
  EXPECT_EQ(kept.to_vector<double>()[kBig - 1], 7.0);
  EXPECT_TRUE(st::read_file(p) == on_disk) << "writing to a loaded tensor changed the file";
  expect_same(load_safetensors(p).tensors[0].second, big, "big reloaded");

  kept = Tensor();
  EXPECT_FALSE(mapped_from(p, nullptr)) << "the mapping outlived its last tensor";
}

TEST_F(SafetensorsTest, SmallFilesAreReadUnlessMappingIsAskedFor) {
  const std::string p = path("small.safetensors");
  save_safetensors(p, {{"w", ones({4, 4})}});
  const Tensor read = load_safetensors(p).tensors[0].second;
  EXPECT_TRUE(read.storage()->owned());
  const Tensor mapped = load_safetensors(p, kMap).tensors[0].second;
  EXPECT_FALSE(mapped.storage()->owned());
  EXPECT_TRUE(mapped_from(p, mapped.data_ptr()));
  expect_same(read, ones({4, 4}), "read");
  expect_same(mapped, ones({4, 4}), "mapped");
}

// ---- saving ----

TEST_F(SafetensorsTest, SaveReplacesAtomicallyAndCleansUpAfterFailures) {
  const std::string p = path("w.safetensors");
  save_safetensors(p, {{"x", ones({2})}});
  save_safetensors(p, {{"x", zeros({3})}});
  expect_same(load_safetensors(p).tensors[0].second, zeros({3}), "replaced");
  const std::string before = st::read_file(p);
  expect_error(
      [&] {
        save_safetensors(p, {{"x", ones({1})}, {"x", ones({1})}});
      },
      {"duplicate tensor name 'x'"});
  expect_error([&] { save_safetensors(p, {{"x", Tensor()}}); }, {"tensor 'x' is undefined"});
  expect_error(
      [&] {
        save_safetensors(p, {{"__metadata__", ones({1})}});
      },
      {"invalid tensor name '__metadata__'"});
  expect_error(
      [&] {
        save_safetensors(p, {{"\xff", ones({1})}});
      },
      {p, "tensor names and metadata must be valid UTF-8"});
  expect_error(
      [&] {
        save_safetensors(p, {{"x", ones({1})}}, {{"k", "\xc3"}});
      },
      {"must be valid UTF-8"});
  EXPECT_EQ(st::read_file(p), before);
  int files = 0;
  for (auto& e : fs::directory_iterator(dir_.dir())) files += e.is_regular_file();
  EXPECT_EQ(files, 1) << "a failed save left a temporary file";
  expect_error(
      [&] {
        save_safetensors(path("no/such/dir/f.safetensors"), {{"x", ones({1})}});
      },
      {"cannot create"});
}
