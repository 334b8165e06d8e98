// `lockstep checkpoint consolidate`: a sharded checkpoint of 3 ranks becomes one file that loads
// as a checkpoint; a missing or corrupt directory is exit code 1 naming what is wrong; --help.
#include <gmock/gmock.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "launch/launcher_process.h"
#include "lockstep/io/sharded_checkpoint.h"
#include "lockstep/lockstep.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::testing::launch;
using ::testing::HasSubstr;

namespace {

// "model.w" (5 x 3) in three uneven slices.
std::vector<std::vector<io::TensorSlice>> three_ranks(const Tensor& w) {
  const Tensor flat = w.reshape({15});
  return {{{"model.w", w.shape(), 0, flat.slice(0, 0, 4)}},
          {{"model.w", w.shape(), 4, flat.slice(0, 4, 13)}},
          {{"model.w", w.shape(), 13, flat.slice(0, 13, 15)}}};
}

}  // namespace

TEST(CheckpointCommand, ConsolidatesAShardedCheckpointIntoOneFile) {
  lockstep::testing::TempDir dir;
  Generator gen(1);
  const Tensor w = randn({5, 3}, gen);
  io::TrainingCheckpoint meta;
  meta.step = 8;
  io::save_sharded_checkpoint(dir.path("ckpt"), three_ranks(w), meta);
  const std::string out = dir.path("model.safetensors");
  const Outcome o =
      run_launcher({"checkpoint", "consolidate", dir.path("ckpt"), "-o", out}, dir.dir(), "ok");
  ASSERT_TRUE(o.exited_with(0)) << o.describe();
  EXPECT_THAT(o.err, HasSubstr("wrote " + out));
  const io::TrainingCheckpoint c = io::load_checkpoint(out);
  EXPECT_EQ(c.step, 8);
  ASSERT_EQ(c.model.size(), 1u);
  EXPECT_EQ(c.model[0].first, "w");
  EXPECT_EQ(std::memcmp(c.model[0].second.data_ptr(), w.data_ptr(), 15 * sizeof(float)), 0);
}

TEST(CheckpointCommand, AMissingOrCorruptDirectoryIsExitCodeOneNamingTheProblem) {
  lockstep::testing::TempDir dir;
  const std::string out = dir.path("model.safetensors");
  const Outcome missing =
      run_launcher({"checkpoint", "consolidate", dir.path("nothing"), "-o", out}, dir.dir(), "m");
  EXPECT_TRUE(missing.exited_with(1)) << missing.describe();
  EXPECT_THAT(missing.err, HasSubstr(dir.path("nothing") + ": no such directory"));

  Generator gen(1);
  io::save_sharded_checkpoint(dir.path("ckpt"), three_ranks(randn({5, 3}, gen)), {});
  const std::string shard = dir.path("ckpt/shard-1-of-3.safetensors");
  std::string bytes;
  {
    std::ifstream in(shard, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes.back() ^= 1;
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
  const Outcome corrupt =
      run_launcher({"checkpoint", "consolidate", dir.path("ckpt"), "-o", out}, dir.dir(), "c");
  EXPECT_TRUE(corrupt.exited_with(1)) << corrupt.describe();
  EXPECT_THAT(corrupt.err, HasSubstr(shard + " is corrupt"));
  EXPECT_FALSE(fs::exists(out));

  const Outcome unchecked = run_launcher(
      {"checkpoint", "consolidate", "--no-verify", dir.path("ckpt"), "-o", out}, dir.dir(), "u");
  EXPECT_TRUE(unchecked.exited_with(0)) << unchecked.describe();
}

TEST(CheckpointCommand, HelpAndUsageErrors) {
  lockstep::testing::TempDir dir;
  const Outcome help = run_launcher({"checkpoint", "consolidate", "--help"}, dir.dir(), "h");
  EXPECT_TRUE(help.exited_with(0)) << help.describe();
  EXPECT_THAT(help.out, HasSubstr("-o,--output"));
  EXPECT_THAT(help.out, HasSubstr("index.json"));
  const Outcome no_output =
      run_launcher({"checkpoint", "consolidate", dir.path("ckpt")}, dir.dir(), "n");
  EXPECT_TRUE(no_output.exited_with(2)) << no_output.describe();
  EXPECT_THAT(no_output.err, HasSubstr("lockstep checkpoint consolidate"));
}
