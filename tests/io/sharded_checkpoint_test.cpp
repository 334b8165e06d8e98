// Sharded checkpoints in one process: written as 4 uneven "ranks", read back bit for bit in the
// ranges a 1-, 2- and 3-rank layout asks for; consolidated into one file that load_safetensors,
// load_checkpoint and a standard-library Python parser read; every broken directory is an error
// naming the file; an unfinished save never replaces or hides the previous checkpoint.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "lockstep/io/sharded_checkpoint.h"
#include "lockstep/lockstep.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::TempDir;
namespace fs = std::filesystem;

namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                     static_cast<size_t>(a.nbytes())) == 0;
}

// Tensors whose sizes 4 does not divide, of several dtypes, a scalar and an empty one.
io::NamedTensors reference_tensors() {
  Generator gen(7);
  return {{"model.w", randn({7, 5}, gen)},
          {"model.b", randn({13}, gen).to(kBFloat16)},
          {"model.count", full({}, 42.0, kInt64)},
          {"model.empty", empty({0, 3})},
          {"optim.w.exp_avg", randn({7, 5}, gen, kFloat64)},
          {"optim.step", full({}, 3.0, kFloat64)}};
}

// [start, end) of `rank` when `numel` elements are cut in proportion to `weights`.
std::pair<int64_t, int64_t> range_of(int64_t numel, const std::vector<double>& weights, int rank) {
  double total = 0, before = 0;
  for (size_t r = 0; r < weights.size(); ++r) {
    total += weights[r];
    if (static_cast<int>(r) < rank) before += weights[r];
  }
  const auto at = [&](double w) { return static_cast<int64_t>(numel * (w / total)); };
  const int64_t start = at(before);
  const int64_t end =
      rank + 1 == static_cast<int>(weights.size()) ? numel : at(before + weights[rank]);
  return {start, end};
}

Tensor flat(const Tensor& t) { return t.contiguous().reshape({t.numel()}); }

// Each rank's slices in the uneven layout `weights` (rank 0 keeps the empty tensor's empty slice;
// a rank with no elements of a tensor gives no slice of it).
std::vector<std::vector<io::TensorSlice>> shards_of(const io::NamedTensors& tensors,
                                                    const std::vector<double>& weights) {
  std::vector<std::vector<io::TensorSlice>> shards(weights.size());
  for (const auto& [name, t] : tensors) {
    for (int r = 0; r < static_cast<int>(weights.size()); ++r) {
      const auto [start, end] = range_of(t.numel(), weights, r);
      if (end == start && !(t.numel() == 0 && r == 0)) continue;
      shards[r].push_back({name, t.shape(), start, flat(t).slice(0, start, end)});
    }
  }
  return shards;
}

io::TrainingCheckpoint meta_of(int64_t step) {
  io::TrainingCheckpoint m;
  m.step = step;
  m.epoch = 2;
  m.epoch_samples = 640;
  m.world_size = 4;
  m.scaler = {{"scale", 1024.0}};
  m.rng = {{"dropout", {5, 99}}};
  m.user = {{"model", "gpt"}};
  return m;
}

const std::vector<double> kUneven = {0.1, 0.4, 0.2, 0.3};

// Writes the reference as 4 ranks through the three steps of the protocol.
void write_four_ranks(const std::string& dir, int64_t step = 10) {
  const auto shards = shards_of(reference_tensors(), kUneven);
  const std::string tmp = io::sharded_temp_dir(dir, io::new_sharded_token());
  for (int r = 0; r < 4; ++r) io::write_checkpoint_shard(tmp, r, 4, shards[r]);
  io::wait_for_checkpoint_shards(tmp, 4, std::chrono::seconds(5));
  io::write_sharded_index(tmp, 4, meta_of(step));
  io::commit_sharded_checkpoint(tmp, dir);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

}  // namespace

TEST(ShardedCheckpoint, FourUnevenRanksReadBackBitForBitInAnyOtherLayout) {
  TempDir dir;
  const std::string ckpt = dir.path("ckpt");
  write_four_ranks(ckpt);
  EXPECT_TRUE(io::is_sharded_checkpoint(ckpt));
  EXPECT_TRUE(fs::exists(dir.path("ckpt/shard-3-of-4.safetensors")));
  EXPECT_FALSE(fs::exists(dir.path("ckpt/shard-3-of-4.json")));  // markers are gone

  const io::ShardedCheckpointReader reader(ckpt);
  EXPECT_EQ(reader.world_size(), 4);
  EXPECT_EQ(reader.checkpoint().step, 10);
  EXPECT_EQ(reader.checkpoint().epoch_samples, 640);
  EXPECT_EQ(reader.checkpoint().scaler.at("scale"), 1024.0);
  EXPECT_EQ(reader.checkpoint().rng.at("dropout"), (io::GeneratorState{5, 99}));
  EXPECT_EQ(reader.checkpoint().user.at("model"), "gpt");
  const io::NamedTensors ref = reference_tensors();
  ASSERT_EQ(reader.tensors().size(), ref.size());
  for (const auto& [name, t] : ref) {
    ASSERT_TRUE(reader.contains(name)) << name;
    EXPECT_EQ(reader.info(name).shape, t.shape());
    EXPECT_EQ(reader.info(name).dtype, t.dtype());
    EXPECT_TRUE(same_bits(reader.read(name), t)) << name;
    // Even layouts of 1, 2 and 3 ranks: their ranges cross the 4 uneven slices' boundaries.
    for (int world : {1, 2, 3}) {
      for (int r = 0; r < world; ++r) {
        const auto [start, end] = range_of(t.numel(), std::vector<double>(world, 1.0), r);
        EXPECT_TRUE(same_bits(reader.read(name, start, end - start), flat(t).slice(0, start, end)))
            << name << " rank " << r << " of " << world;
      }
    }
  }
  // A range inside one slice and one across three.
  const Tensor w = flat(ref[0].second);
  EXPECT_TRUE(same_bits(reader.read("model.w", 4, 2), w.slice(0, 4, 6)));
  EXPECT_TRUE(same_bits(reader.read("model.w", 2, 30), w.slice(0, 2, 32)));
  EXPECT_NO_THROW(reader.verify());
}

TEST(ShardedCheckpoint, ConsolidatesIntoOneCheckpointThatLoadsEverywhere) {
  TempDir dir;
  write_four_ranks(dir.path("ckpt"), 25);
  const std::string out = dir.path("model.safetensors");
  io::consolidate(dir.path("ckpt"), out);

  const io::SafetensorsContents c = io::load_safetensors(out);
  const io::NamedTensors ref = reference_tensors();
  for (const auto& [name, t] : ref) {
    auto it = std::find_if(c.tensors.begin(), c.tensors.end(),
                           [&](const auto& e) { return e.first == name; });
    ASSERT_NE(it, c.tensors.end()) << name;
    EXPECT_TRUE(same_bits(it->second, t)) << name;
  }
  EXPECT_EQ(c.tensors.size(), ref.size());
  const io::TrainingCheckpoint loaded = io::load_checkpoint(out);  // SHA-256 and all
  EXPECT_EQ(loaded.step, 25);
  EXPECT_EQ(loaded.user.at("model"), "gpt");

  // Python's view of the format, with the standard library only: the header parses, every
  // entry's bytes are dtype size x shape, the data offsets tile the data, the sizes add up.
  if (std::system("python3 -c pass >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string script = dir.path("check.py");
  write_file(script, R"(import json, struct, sys
SIZES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}
data = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", data[:8])
header = json.loads(data[8:8 + n])
meta = header.pop("__metadata__")
assert meta["step"] == "25", meta
at = 0
for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
    count = 1
    for d in e["shape"]:
        count *= d
    begin, end = e["data_offsets"]
    assert begin == at, (name, begin, at)
    assert end - begin == count * SIZES[e["dtype"]], (name, e)
    at = end
assert 8 + n + at == len(data), (8 + n + at, len(data))
w = header["model.w"]
assert w["dtype"] == "F32" and w["shape"] == [7, 5], w
assert header["model.b"]["dtype"] == "BF16" and header["optim.step"]["shape"] == [], header
print(len(header))
)");
  const std::string result = dir.path("python.out");
  ASSERT_EQ(std::system(("python3 " + script + " " + out + " > " + result + " 2>&1").c_str()), 0)
      << read_file(result);
  EXPECT_EQ(read_file(result), std::to_string(ref.size()) + "\n");
}

TEST(ShardedCheckpoint, ADirectoryWithoutItsIndexIsNoCheckpoint) {
  TempDir dir;
  const auto shards = shards_of(reference_tensors(), kUneven);
  const std::string tmp = io::sharded_temp_dir(dir.path("ckpt"), "abc");
  for (int r = 0; r < 4; ++r) io::write_checkpoint_shard(tmp, r, 4, shards[r]);
  expect_error([&] { io::ShardedCheckpointReader reader(tmp); }, {tmp, "no index.json"});
  expect_error([&] { io::ShardedCheckpointReader reader(dir.path("nothing")); },
               {dir.path("nothing"), "no such directory"});
  expect_error([&] { io::commit_sharded_checkpoint(tmp, dir.path("ckpt")); },
               {tmp, "has no index.json"});
  EXPECT_FALSE(fs::exists(dir.path("ckpt")));
}

TEST(ShardedCheckpoint, AMissingOrTruncatedShardIsAnErrorNamingTheFile) {
  TempDir dir;
  const std::string ckpt = dir.path("ckpt");
  write_four_ranks(ckpt);
  const std::string shard1 = dir.path("ckpt/shard-1-of-4.safetensors");
  const auto size = fs::file_size(shard1);
  fs::resize_file(shard1, size - 3);
  expect_error(
      [&] { io::ShardedCheckpointReader reader(ckpt); },
      {shard1, "is " + std::to_string(size - 3) + " bytes", std::to_string(size), "truncated"});
  fs::remove(dir.path("ckpt/shard-2-of-4.safetensors"));
  fs::resize_file(shard1, size);
  expect_error([&] { io::ShardedCheckpointReader reader(ckpt); },
               {dir.path("ckpt/shard-2-of-4.safetensors"), "the index names"});
}

TEST(ShardedCheckpoint, VerifyReadsEveryByteWhileOpeningChecksOnlySizes) {
  TempDir dir;
  const std::string ckpt = dir.path("ckpt");
  write_four_ranks(ckpt);
  const std::string shard3 = dir.path("ckpt/shard-3-of-4.safetensors");
  std::string bytes = read_file(shard3);
  bytes[bytes.size() - 1] ^= 0x40;  // the last data byte
  write_file(shard3, bytes);
  const io::ShardedCheckpointReader reader(ckpt);
  expect_error([&] { reader.verify(); }, {shard3, "is corrupt", "SHA-256"});
  EXPECT_THAT(io::sharded_checkpoint_problem(ckpt), ::testing::HasSubstr(shard3));
}

TEST(ShardedCheckpoint, GapsAndOverlapsAreErrorsNamingTheTensor) {
  TempDir dir;
  const io::NamedTensors one = {{"model.w", reference_tensors()[0].second}};
  auto shards = shards_of(one, {1, 1});  // [0, 17) and [17, 35)
  auto gap = shards;
  gap[1][0].start = 18;
  gap[1][0].data = gap[1][0].data.slice(0, 0, 17);
  expect_error([&] { io::save_sharded_checkpoint(dir.path("gap"), gap, meta_of(1)); },
               {"model.w", "no slice holds elements [17, 18)", "shard-1-of-2.safetensors"});
  auto overlap = shards;
  overlap[1][0].start = 16;
  overlap[1][0].data = flat(one[0].second).slice(0, 16, 35);
  expect_error([&] { io::save_sharded_checkpoint(dir.path("overlap"), overlap, meta_of(1)); },
               {"model.w", "in two slices"});
  auto missing_end = shards;
  missing_end[1][0].data = missing_end[1][0].data.slice(0, 0, 10);
  expect_error([&] { io::save_sharded_checkpoint(dir.path("short"), missing_end, meta_of(1)); },
               {"model.w", "no slice holds elements [27, 35)"});
  auto disagree = shards;
  disagree[1][0].data = disagree[1][0].data.to(kFloat64);
  expect_error([&] { io::save_sharded_checkpoint(dir.path("dtype"), disagree, meta_of(1)); },
               {"model.w", "F32", "F64", "shard-0-of-2.safetensors", "shard-1-of-2.safetensors"});
  for (const char* d : {"gap", "overlap", "short", "dtype"}) EXPECT_FALSE(fs::exists(dir.path(d)));

  // An index edited to leave a gap is refused on opening.
  io::save_sharded_checkpoint(dir.path("ok"), shards, meta_of(1));
  const std::string index_path = dir.path("ok/index.json");
  auto index = nlohmann::json::parse(read_file(index_path));
  index["tensors"]["model.w"]["slices"].erase(1);
  write_file(index_path, index.dump());
  expect_error([&] { io::ShardedCheckpointReader reader(dir.path("ok")); },
               {index_path, "model.w", "no slice holds elements [17, 35)"});
}

TEST(ShardedCheckpoint, ARangeOutsideTheTensorOrAnUnknownNameIsAnError) {
  TempDir dir;
  write_four_ranks(dir.path("ckpt"));
  const io::ShardedCheckpointReader reader(dir.path("ckpt"));
  expect_error([&] { reader.read("model.w", 30, 10); },
               {"elements [30, 40) of 'model.w'", "inside [0, 35)", "[7, 5]"});
  expect_error([&] { reader.read("model.w", -1, 2); }, {"out of range"});
  expect_error([&] { reader.read("model.nope"); }, {"no tensor 'model.nope'", "model.w"});
  // A slice outside its tensor, or an undefined one, is refused when written.
  io::TensorSlice bad{"model.x", {4}, 3, zeros({2})};
  expect_error([&] { io::save_sharded_checkpoint(dir.path("bad"), {{bad}}, meta_of(1)); },
               {"elements [3, 5)", "inside [0, 4)"});
  io::TensorSlice unnamed{"w", {2}, 0, zeros({2})};
  expect_error([&] { io::save_sharded_checkpoint(dir.path("bad"), {{unnamed}}, meta_of(1)); },
               {"'w'", "'model.' or 'optim.'"});
  io::TensorSlice nan{"model.x", {2}, 0, full({2}, std::nan(""))};
  expect_error([&] { io::save_sharded_checkpoint(dir.path("bad"), {{nan}}, meta_of(1)); },
               {"model.x", "NaN", "diverged"});
}

TEST(ShardedCheckpoint, AnUnfinishedSaveLeavesThePreviousCheckpointAndIsIgnored) {
  TempDir dir;
  const std::string base = dir.path("ckpt");
  const std::string step10 = io::checkpoint_path_for_step(base, 10);
  write_four_ranks(step10, 10);
  // A crash after three of four ranks wrote the step-20 checkpoint, and one during a rewrite
  // of step 10 itself: temporary directories without an index.
  const auto shards = shards_of(reference_tensors(), kUneven);
  const std::string tmp20 = io::sharded_temp_dir(io::checkpoint_path_for_step(base, 20), "dead1");
  const std::string tmp10 = io::sharded_temp_dir(step10, "dead2");
  for (int r = 0; r < 3; ++r) io::write_checkpoint_shard(tmp20, r, 4, shards[r]);
  io::write_checkpoint_shard(tmp10, 0, 4, shards[0]);

  const io::CheckpointChoice choice = io::latest_valid_sharded_checkpoint(base);
  EXPECT_EQ(choice.path, step10);
  EXPECT_TRUE(choice.skipped.empty());
  EXPECT_NO_THROW(io::ShardedCheckpointReader(step10).verify());
  // The next commit of the series clears what the crashed saves left.
  write_four_ranks(io::checkpoint_path_for_step(base, 30), 30);
  EXPECT_FALSE(fs::exists(tmp20));
  EXPECT_FALSE(fs::exists(tmp10));
  EXPECT_EQ(io::latest_valid_sharded_checkpoint(base).path, io::checkpoint_path_for_step(base, 30));
}

TEST(ShardedCheckpoint, ReplacingADirectoryLeavesAWholeOneEvenWhenKilledMidSave) {
  TempDir dir;
  const std::string ckpt = dir.path("ckpt");
  write_four_ranks(ckpt, 1);
  // Replacing in one process: the newer one is there, the older one gone.
  write_four_ranks(ckpt, 2);
  EXPECT_EQ(io::ShardedCheckpointReader(ckpt).checkpoint().step, 2);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.dir()), fs::directory_iterator()), 1);

  // A child rewrites `ckpt` in a loop; killed at several moments, it always leaves a whole one.
  const auto shards = shards_of(reference_tensors(), kUneven);
  for (int delay_ms : {1, 5, 20, 50}) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      try {
        for (int64_t step = 100;; ++step) io::save_sharded_checkpoint(ckpt, shards, meta_of(step));
      } catch (...) {
        ::_exit(1);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    const io::ShardedCheckpointReader reader(ckpt);
    EXPECT_NO_THROW(reader.verify()) << "killed after " << delay_ms << " ms";
    EXPECT_TRUE(same_bits(reader.read("model.w"), reference_tensors()[0].second));
  }
}

TEST(ShardedCheckpoint, ResumeSkipsACorruptNewestAndKeepPrunesOnlyOlderDirectories) {
  TempDir dir;
  const std::string base = dir.path("ckpt");
  for (int64_t step : {10, 20, 30, 40})
    write_four_ranks(io::checkpoint_path_for_step(base, step), step);
  const std::string step40 = io::checkpoint_path_for_step(base, 40);
  std::string bytes = read_file(step40 + "/shard-0-of-4.safetensors");
  bytes[bytes.size() - 1] ^= 1;
  write_file(step40 + "/shard-0-of-4.safetensors", bytes);
  io::CheckpointChoice choice = io::latest_valid_sharded_checkpoint(base);
  EXPECT_EQ(choice.path, io::checkpoint_path_for_step(base, 30));
  ASSERT_EQ(choice.skipped.size(), 1u);
  EXPECT_EQ(choice.skipped[0].path, step40);
  EXPECT_THAT(choice.skipped[0].reason, ::testing::HasSubstr("shard-0-of-4.safetensors"));

  // `base` itself counts by the step in its index.
  write_four_ranks(base, 35);
  EXPECT_EQ(io::latest_valid_sharded_checkpoint(base).path, base);

  // keep 2 at step 30: 10 goes, 20 and 30 stay, 40 (a later step) and the spared one stay.
  fs::create_directories(dir.path("ckpt.step00000005"));  // no index: not ours to delete
  const auto removed = io::prune_sharded_checkpoints(io::checkpoint_path_for_step(base, 30), 2);
  EXPECT_EQ(removed, std::vector<std::string>{io::checkpoint_path_for_step(base, 10)});
  for (int64_t step : {20, 30, 40})
    EXPECT_TRUE(fs::exists(io::checkpoint_path_for_step(base, step))) << step;
  EXPECT_TRUE(fs::exists(dir.path("ckpt.step00000005")));
  EXPECT_TRUE(fs::exists(base));
  EXPECT_TRUE(io::prune_sharded_checkpoints(step40, 0).empty());
}

TEST(ShardedCheckpoint, WaitingForShardsNamesTheMissingRanksOrTheOneThatFailed) {
  TempDir dir;
  const auto shards = shards_of(reference_tensors(), kUneven);
  const std::string tmp = io::sharded_temp_dir(dir.path("ckpt"), "t");
  io::write_checkpoint_shard(tmp, 0, 4, shards[0]);
  io::write_checkpoint_shard(tmp, 2, 4, shards[2]);
  expect_error([&] { io::wait_for_checkpoint_shards(tmp, 4, std::chrono::milliseconds(50)); },
               {tmp, "2 of 4 ranks had not written their shard (ranks 1, 3"});
  io::write_checkpoint_shard_failure(tmp, 3, 4, "disk full on rank 3's node");
  expect_error([&] { io::wait_for_checkpoint_shards(tmp, 4, std::chrono::minutes(10)); },
               {"rank 3 could not write its shard: disk full on rank 3's node"});
}
