// Checkpoints across ranks: rank 0 writes and the others return only once the file is complete;
// a failed write is an error on every rank; loading by every rank and by broadcast from rank 0
// give the same checkpoint, and `automatic` falls back to broadcast where a rank lacks the file;
// --resume auto passes over a corrupt newest checkpoint; --save is checked before a run.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string_view>

#include "lockstep/base/log.h"
#include "lockstep/distributed/checkpoint.h"
#include "lockstep/lockstep.h"
#include "testing.h"
#include "distributed/thread_ranks.h"

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
      2, [&](int, ProcessGroupPtr pg) { EXPECT_EQ(resolve_resume(*pg, "auto", base).path, ""); }));
  io::save_checkpoint(io::checkpoint_path_for_step(base, 20), checkpoint_of(0, 20));
  io::save_checkpoint(io::checkpoint_path_for_step(base, 40), checkpoint_of(0, 40));
  expect_no_errors(lockstep::testing::run_ranks(2, [&](int, ProcessGroupPtr pg) {
    const io::CheckpointChoice choice = resolve_resume(*pg, "auto", base);
    EXPECT_EQ(choice.path, io::checkpoint_path_for_step(base, 40));
    EXPECT_TRUE(choice.skipped.empty());
  }));
  const auto errors = lockstep::testing::run_ranks(
      2, [&](int, ProcessGroupPtr pg) { resolve_resume(*pg, dir.path("nope.safetensors"), base); });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("no such checkpoint file"), std::string::npos) << errors[r];
}

namespace {

void corrupt_last_byte(const std::string& path) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(-1, std::ios::end);
  const char c = static_cast<char>(f.get() ^ 0x20);
  f.seekp(-1, std::ios::end);
  f.put(c);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Warnings logged while it lives (the log is process-wide: every thread-rank's lines).
class WarningsCaught {
 public:
  WarningsCaught() {
    set_log_sink([this](LogLevel level, std::string_view text) {
      std::lock_guard<std::mutex> lock(mu_);
      if (level == LogLevel::kWarning) text_ += text;
    });
  }
  ~WarningsCaught() { set_log_sink(nullptr); }
  std::string text() {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }

 private:
  std::mutex mu_;
  std::string text_;
};

}  // namespace

// A corrupt newest checkpoint beside a valid older one: "auto" resumes the older one on every
// rank, with one warning (rank 0's) naming the skipped file and why, and leaves it as it is. An
// explicit path to the corrupt file is not replaced: loading it fails. With no checkpoint that
// verifies, "auto" fails on every rank, listing each.
TEST(DistCheckpoint, ResolveResumeAutoFallsBackPastACorruptNewestCheckpoint) {
  TempDir dir;
  const std::string base = dir.path("ck.safetensors");
  const std::string older = io::checkpoint_path_for_step(base, 20);
  const std::string newest = io::checkpoint_path_for_step(base, 40);
  io::save_checkpoint(older, checkpoint_of(0, 20));
  io::save_checkpoint(newest, checkpoint_of(0, 40));
  corrupt_last_byte(newest);
  const std::string corrupt_bytes = file_bytes(newest);
  {
    WarningsCaught warnings;
    expect_no_errors(lockstep::testing::run_ranks(2, [&](int r, ProcessGroupPtr pg) {
      const io::CheckpointChoice choice = resolve_resume(*pg, "auto", base);
      EXPECT_EQ(choice.path, older) << "rank " << r;
      ASSERT_EQ(choice.skipped.size(), 1u) << "rank " << r;
      EXPECT_EQ(choice.skipped[0].path, newest);
      EXPECT_THAT(choice.skipped[0].reason, ::testing::HasSubstr("corrupt"));
      EXPECT_EQ(load_checkpoint(*pg, choice.path).step, 20);
    }));
    const std::string text = warnings.text();
    EXPECT_THAT(text, ::testing::HasSubstr("skipping " + newest));
    EXPECT_THAT(text, ::testing::HasSubstr("corrupt"));
    EXPECT_EQ(text.find("skipping"), text.rfind("skipping")) << "one warning, rank 0's: " << text;
  }
  EXPECT_EQ(file_bytes(newest), corrupt_bytes);

  const auto explicit_errors = lockstep::testing::run_ranks(2, [&](int, ProcessGroupPtr pg) {
    load_checkpoint(*pg, resolve_resume(*pg, newest, base).path);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_THAT(explicit_errors[r], ::testing::HasSubstr("corrupt")) << "rank " << r;

  corrupt_last_byte(older);
  const auto errors = lockstep::testing::run_ranks(
      2, [&](int, ProcessGroupPtr pg) { resolve_resume(*pg, "auto", base); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("no checkpoint of " + base + " verifies"));
    EXPECT_THAT(errors[r], ::testing::HasSubstr(newest + ": "));
    EXPECT_THAT(errors[r], ::testing::HasSubstr(older + ": "));
  }
  EXPECT_TRUE(fs::exists(older));
  EXPECT_TRUE(fs::exists(newest));
}

// --save checked before a run: rank 0's verdict on every rank, naming the flag, the path, the
// reason. (A path under a regular file fails for root too, unlike a read-only directory.)
TEST(DistCheckpoint, CheckCheckpointPathFailsEveryRankWithRankZerosReason) {
  TempDir dir;
  expect_no_errors(lockstep::testing::run_ranks(2, [&](int, ProcessGroupPtr pg) {
    check_checkpoint_path(*pg, "--save", dir.path("run/ck.safetensors"));
  }));
  EXPECT_TRUE(fs::is_directory(dir.path("run")));
  std::ofstream(dir.path("file")) << "x";
  const std::string bad = dir.path("file/sub/ck.safetensors");
  const auto errors = lockstep::testing::run_ranks(
      2, [&](int, ProcessGroupPtr pg) { check_checkpoint_path(*pg, "--save", bad); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("--save " + bad + " cannot be written"));
    EXPECT_THAT(errors[r], ::testing::HasSubstr("Not a directory"));
  }
}
