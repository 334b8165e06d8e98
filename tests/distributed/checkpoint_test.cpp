// Checkpoints across ranks: rank 0 writes and the others return only once the file is complete;
// a failed write is an error on every rank; loading by every rank and by broadcast from rank 0
// give the same checkpoint, and `automatic` falls back to broadcast where a rank lacks the file.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "lockstep/distributed/checkpoint.h"
#include "lockstep/lockstep.h"
#include "testing.h"
#include "thread_ranks.h"

using namespace lockstep;
using namespace lockstep::dist;
using lockstep::testing::TempDir;
namespace fs = std::filesystem;

namespace {

// Rank r's checkpoint: different values per rank, so a test sees whose file it read.
io::TrainingCheckpoint checkpoint_of(int rank, int64_t step = 10) {
  Generator gen(static_cast<uint64_t>(rank) + 1);
  io::TrainingCheckpoint c;
  c.model = {{"w", randn({64, 33}, gen)}, {"b", randn({33}, gen)}, {"n", full({}, 3.0, kInt64)}};
  c.optimizer = {{"0.momentum_buffer", randn({64, 33}, gen)}, {"step", full({}, 2.0, kFloat64)}};
  c.scaler = {{"scale", 1024.0 * (rank + 1)}};
  c.step = step;
  c.epoch_samples = 640;
  c.world_size = 2;
  c.user = {{"writer", std::to_string(rank)}};
  return c;
}

bool same(const io::NamedTensors& a, const io::NamedTensors& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.shape() != b[i].second.shape() ||
        a[i].second.dtype() != b[i].second.dtype() ||
        std::memcmp(a[i].second.data_ptr(), b[i].second.data_ptr(),
                    static_cast<size_t>(a[i].second.nbytes())) != 0)
      return false;
  }
  return true;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace

TEST(DistCheckpoint, RankZeroWritesAndEveryRankReturnsWithTheFileComplete) {
  TempDir dir;
  const std::string path = dir.path("ck.safetensors");
  expect_no_errors(lockstep::testing::run_ranks(3, [&](int r, ProcessGroupPtr pg) {
    save_checkpoint(*pg, path, checkpoint_of(r));
    // Every rank, rank 2 included, finds rank 0's complete file the moment save returns.
    const io::TrainingCheckpoint back = io::load_checkpoint(path);
    EXPECT_EQ(back.user.at("writer"), "0") << "rank " << r;
    EXPECT_TRUE(same(back.model, io::load_checkpoint(path).model));
  }));
}

TEST(DistCheckpoint, AFailedWriteIsAnErrorOnEveryRank) {
  TempDir dir;
  std::ofstream(dir.path("file")) << "x";
  const std::string path = dir.path("file/ck.safetensors");  // its directory is a file
  const auto errors = lockstep::testing::run_ranks(
      2, [&](int r, ProcessGroupPtr pg) { save_checkpoint(*pg, path, checkpoint_of(r)); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("save_checkpoint failed on rank 0"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find(path), std::string::npos) << errors[r];
  }
}

TEST(DistCheckpoint, EveryRankAndBroadcastLoadTheSameCheckpoint) {
  TempDir dir;
  const std::string path = dir.path("ck.safetensors");
  io::save_checkpoint(path, checkpoint_of(0));
  const io::TrainingCheckpoint want = io::load_checkpoint(path);
  for (CheckpointLoad how :
       {CheckpointLoad::every_rank, CheckpointLoad::broadcast, CheckpointLoad::automatic}) {
    expect_no_errors(lockstep::testing::run_ranks(2, [&](int r, ProcessGroupPtr pg) {
      const io::TrainingCheckpoint got = load_checkpoint(*pg, path, how);
      EXPECT_TRUE(same(got.model, want.model)) << "rank " << r;
      EXPECT_TRUE(same(got.optimizer, want.optimizer)) << "rank " << r;
      EXPECT_EQ(got.scaler, want.scaler);
      EXPECT_EQ(got.step, 10);
      EXPECT_EQ(got.epoch_samples, 640);
      EXPECT_EQ(got.user.at("writer"), "0");
    }));
  }
}

// The file exists on rank 0's machine only (rank 1's path names nothing there): automatic must
// broadcast rather than fail, and every rank ends up with rank 0's checkpoint.
TEST(DistCheckpoint, AutomaticBroadcastsWhenARankLacksTheFile) {
  TempDir dir;
  const std::string path = dir.path("ck.safetensors");
  io::save_checkpoint(path, checkpoint_of(0));
  const io::TrainingCheckpoint want = io::load_checkpoint(path);
  expect_no_errors(lockstep::testing::run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    const std::string mine = r == 0 ? path : dir.path("not-on-this-node.safetensors");
    const io::TrainingCheckpoint got = load_checkpoint(*pg, mine);
    EXPECT_TRUE(same(got.model, want.model)) << "rank " << r;
  }));
  // Without the fallback, every_rank fails on rank 1 and so on every rank.
  const auto errors = lockstep::testing::run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    load_checkpoint(*pg, r == 0 ? path : dir.path("absent.safetensors"),
                    CheckpointLoad::every_rank);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("load_checkpoint failed on rank 1"), std::string::npos) << errors[r];
}

TEST(DistCheckpoint, CorruptFileFailsEveryRankWhicheverWayItLoads) {
  TempDir dir;
  const std::string path = dir.path("ck.safetensors");
  io::save_checkpoint(path, checkpoint_of(0));
  {
    std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  for (CheckpointLoad how : {CheckpointLoad::every_rank, CheckpointLoad::broadcast}) {
    const auto errors = lockstep::testing::run_ranks(
        2, [&](int, ProcessGroupPtr pg) { load_checkpoint(*pg, path, how); });
    for (int r = 0; r < 2; ++r)
      EXPECT_NE(errors[r].find("corrupt"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

TEST(DistCheckpoint, ResolveResume) {
  TempDir dir;
  const std::string base = dir.path("ck.safetensors");
  expect_no_errors(lockstep::testing::run_ranks(
      2, [&](int, ProcessGroupPtr pg) { EXPECT_EQ(resolve_resume(*pg, "auto", base), ""); }));
  io::save_checkpoint(io::checkpoint_path_for_step(base, 20), checkpoint_of(0, 20));
  io::save_checkpoint(io::checkpoint_path_for_step(base, 40), checkpoint_of(0, 40));
  expect_no_errors(lockstep::testing::run_ranks(2, [&](int, ProcessGroupPtr pg) {
    EXPECT_EQ(resolve_resume(*pg, "auto", base), io::checkpoint_path_for_step(base, 40));
  }));
  const auto errors = lockstep::testing::run_ranks(
      2, [&](int, ProcessGroupPtr pg) { resolve_resume(*pg, dir.path("nope.safetensors"), base); });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("no such checkpoint file"), std::string::npos) << errors[r];
}
