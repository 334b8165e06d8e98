// Sharded checkpoints across ranks (threads): a collective save at 4 ranks loads at 1, 2 and 3;
// a failure on one rank is an error on every rank; the background saver keeps the previous
// checkpoint whole, snapshots what it saves and reports its errors at the next call; --keep
// prunes directories; --resume picks the newest that verifies.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "lockstep/distributed/sharded_checkpoint.h"
#include "lockstep/lockstep.h"
#include "lockstep/tensor/cuda.h"
#include "testing.h"
#include "distributed/thread_ranks.h"

using namespace lockstep;
using namespace lockstep::dist;
using lockstep::testing::TempDir;
namespace fs = std::filesystem;

namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.numel() == b.numel() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                     static_cast<size_t>(a.nbytes())) == 0;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Sizes that no world of 2, 3 or 4 divides evenly.
io::NamedTensors reference_tensors() {
  Generator gen(3);
  return {{"model.w", randn({11, 7}, gen)},
          {"model.b", randn({5}, gen).to(kBFloat16)},
          {"optim.w.exp_avg", randn({11, 7}, gen)},
          {"optim.step", full({}, 4.0, kFloat64)}};
}

// Flat-parameter sharding: rank r of `world` holds ceil(numel / world) elements (the last
// fewer, possibly none).
std::pair<int64_t, int64_t> shard_range(int64_t numel, int rank, int world) {
  const int64_t per = (numel + world - 1) / world;
  const int64_t start = std::min(numel, per * rank);
  return {start, std::min(numel, start + per) - start};
}

Tensor flat(const Tensor& t) { return t.contiguous().reshape({t.numel()}); }

std::vector<io::TensorSlice> slices_of(const io::NamedTensors& tensors, int rank, int world) {
  std::vector<io::TensorSlice> out;
  for (const auto& [name, t] : tensors) {
    const auto [start, count] = shard_range(t.numel(), rank, world);
    if (count > 0) out.push_back({name, t.shape(), start, flat(t).slice(0, start, start + count)});
  }
  return out;
}

io::TrainingCheckpoint meta_of(int64_t step, int world) {
  io::TrainingCheckpoint m;
  m.step = step;
  m.world_size = world;
  m.user = {{"note", "sharded"}};
  return m;
}

}  // namespace

TEST(DistShardedCheckpoint, SavedAtFourRanksLoadsAtOneTwoAndThree) {
  TempDir dir;
  const std::string ckpt = dir.path("ckpt");
  const io::NamedTensors ref = reference_tensors();
  expect_no_errors(lockstep::testing::run_ranks(4, [&](int rank, ProcessGroupPtr pg) {
    save_sharded_checkpoint(*pg, ckpt, slices_of(ref, rank, 4), meta_of(12, 4));
    // Every rank returns with the directory complete.
    EXPECT_NO_THROW(io::ShardedCheckpointReader(ckpt).verify());
  }));
  for (int world : {1, 2, 3}) {
    expect_no_errors(lockstep::testing::run_ranks(world, [&](int rank, ProcessGroupPtr pg) {
      std::vector<io::SliceRequest> wanted;
      for (const auto& [name, t] : ref) {
        const auto [start, count] = shard_range(t.numel(), rank, world);
        wanted.push_back({name, start, count});
      }
      const ShardedLoad loaded = load_sharded_checkpoint(*pg, ckpt, wanted);
      EXPECT_EQ(loaded.meta.step, 12);
      EXPECT_EQ(loaded.meta.user.at("note"), "sharded");
      ASSERT_EQ(loaded.slices.size(), ref.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        const auto [start, count] = shard_range(ref[i].second.numel(), rank, world);
        EXPECT_EQ(loaded.slices[i].shape, ref[i].second.shape());
        EXPECT_TRUE(
            same_bits(loaded.slices[i].data, flat(ref[i].second).slice(0, start, start + count)))
            << ref[i].first << " rank " << rank << " of " << world;
      }
    }));
  }
}

TEST(DistShardedCheckpoint, AFailureOnOneRankIsAnErrorOnEveryRankAndTheOldCheckpointStays) {
  TempDir dir;
  const std::string ckpt = dir.path("ckpt");
  const io::NamedTensors ref = reference_tensors();
  expect_no_errors(lockstep::testing::run_ranks(4, [&](int rank, ProcessGroupPtr pg) {
    save_sharded_checkpoint(*pg, ckpt, slices_of(ref, rank, 4), meta_of(1, 4));
  }));
  const auto errors = lockstep::testing::run_ranks(4, [&](int rank, ProcessGroupPtr pg) {
    auto slices = slices_of(ref, rank, 4);
    if (rank == 2) slices[0].data = full(slices[0].data.shape(), std::nan(""));
    save_sharded_checkpoint(*pg, ckpt, slices, meta_of(2, 4));
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("failed on rank 2")) << r;
    EXPECT_THAT(errors[r], ::testing::HasSubstr("shard-2-of-4.safetensors")) << r;
    EXPECT_THAT(errors[r], ::testing::HasSubstr("NaN")) << r;
  }
  const io::ShardedCheckpointReader reader(ckpt);
  EXPECT_EQ(reader.checkpoint().step, 1);
  EXPECT_NO_THROW(reader.verify());
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.dir()), fs::directory_iterator()), 1)
      << "the failed save's temporary directory is removed";
}

TEST(DistShardedCheckpoint, KeepPrunesOlderDirectoriesAndResumeAutoFindsTheNewest) {
  TempDir dir;
  const std::string base = dir.path("ckpt");
  const io::NamedTensors ref = reference_tensors();
  expect_no_errors(lockstep::testing::run_ranks(3, [&](int rank, ProcessGroupPtr pg) {
    EXPECT_EQ(resolve_sharded_resume(*pg, "auto", base).path, "");  // nothing yet
    for (int64_t step : {10, 20, 30, 40})
      save_sharded_checkpoint(*pg, io::checkpoint_path_for_step(base, step),
                              slices_of(ref, rank, 3), meta_of(step, 3), /*keep=*/2);
    EXPECT_EQ(resolve_sharded_resume(*pg, "auto", base).path,
              io::checkpoint_path_for_step(base, 40));
    EXPECT_THROW(resolve_sharded_resume(*pg, dir.path("nothing"), base), Error);
  }));
  EXPECT_FALSE(fs::exists(io::checkpoint_path_for_step(base, 10)));
  EXPECT_FALSE(fs::exists(io::checkpoint_path_for_step(base, 20)));
  EXPECT_TRUE(io::is_sharded_checkpoint(io::checkpoint_path_for_step(base, 30)));
  EXPECT_TRUE(io::is_sharded_checkpoint(io::checkpoint_path_for_step(base, 40)));
}

// A training-like loop: each rank's parameter slice changes every step, is saved in the
// background every step, and is overwritten right after save() returns (as the next optimizer
// step would). Each checkpoint must hold the values of its own step, and the previous one must
// be whole whenever save() returns.
TEST(DistShardedCheckpoint, AsyncSavesEveryStepKeepThePreviousWholeAndHoldTheirStepsValues) {
  TempDir dir;
  const std::string base = dir.path("ckpt");
  constexpr int kWorld = 4;
  constexpr int64_t kNumel = 1001;
  constexpr int64_t kSteps = 6;
  const auto value = [](int64_t step, int64_t i) { return static_cast<float>(step * 10000 + i); };
  expect_no_errors(lockstep::testing::run_ranks(kWorld, [&](int rank, ProcessGroupPtr pg) {
    const auto [start, count] = shard_range(kNumel, rank, kWorld);
    Tensor param = empty({count});
    AsyncSaveOptions opts;
    opts.keep = 2;
    AsyncShardedSaver saver(*pg, opts);
    for (int64_t step = 1; step <= kSteps; ++step) {
      auto* p = param.data<float>();
      for (int64_t i = 0; i < count; ++i) p[i] = value(step, start + i);
      saver.save(io::checkpoint_path_for_step(base, step), {{"model.w", {kNumel}, start, param}},
                 meta_of(step, kWorld));
      for (int64_t i = 0; i < count; ++i) p[i] = -1.0f;  // training goes on
      if (step > 1) {
        const io::ShardedCheckpointReader previous(io::checkpoint_path_for_step(base, step - 1));
        previous.verify();
        EXPECT_EQ(previous.checkpoint().step, step - 1);
        const Tensor mine = previous.read("model.w", start, count);
        for (int64_t i = 0; i < count; ++i)
          ASSERT_EQ(mine.data<float>()[i], value(step - 1, start + i)) << "step " << step - 1;
      }
    }
    saver.wait();
    EXPECT_FALSE(saver.busy());
    const Tensor all =
        io::ShardedCheckpointReader(io::checkpoint_path_for_step(base, kSteps)).read("model.w");
    for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(all.data<float>()[i], value(kSteps, i));
  }));
  // keep 2: the last two steps' directories and nothing else (no temporary ones either).
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.dir())) left.push_back(e.path().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{io::checkpoint_path_for_step(base, kSteps - 1),
                                            io::checkpoint_path_for_step(base, kSteps)}));
}

TEST(DistShardedCheckpoint, AsyncErrorsSurfaceOnEveryRankAtTheNextSaveOrWait) {
  TempDir dir;
  const std::string base = dir.path("ckpt");
  const io::NamedTensors ref = reference_tensors();
  for (bool at_wait : {false, true}) {
    const auto errors = lockstep::testing::run_ranks(3, [&](int rank, ProcessGroupPtr pg) {
      AsyncShardedSaver saver(*pg);
      saver.save(io::checkpoint_path_for_step(base, 1), slices_of(ref, rank, 3), meta_of(1, 3));
      auto slices = slices_of(ref, rank, 3);
      if (rank == 1) slices[0].data = full(slices[0].data.shape(), INFINITY);
      saver.save(io::checkpoint_path_for_step(base, 2), slices, meta_of(2, 3));  // fails later
      if (at_wait) {
        saver.wait();
      } else {
        saver.save(io::checkpoint_path_for_step(base, 3), slices_of(ref, rank, 3), meta_of(3, 3));
      }
    });
    for (size_t r = 0; r < errors.size(); ++r) {
      EXPECT_THAT(errors[r],
                  ::testing::HasSubstr("the save of " + io::checkpoint_path_for_step(base, 2)))
          << r;
      EXPECT_THAT(errors[r], ::testing::HasSubstr("rank 1")) << r;
      EXPECT_THAT(errors[r], ::testing::HasSubstr("Inf")) << r;
    }
    EXPECT_NO_THROW(io::ShardedCheckpointReader(io::checkpoint_path_for_step(base, 1)).verify());
    EXPECT_FALSE(fs::exists(io::checkpoint_path_for_step(base, 2)));
    EXPECT_FALSE(fs::exists(io::checkpoint_path_for_step(base, 3)));  // never started
  }
}

// The background saver's snapshot of a device tensor is a host copy taken in save(): the device
// memory is overwritten at once, and the checkpoint holds the values at save() time. Runs on a
// GPU, or on emulated ones (LOCKSTEP_TEST_EMULATE_GPUS=1); skips elsewhere.
TEST(DistShardedCheckpoint, AsyncSaveOfDeviceTensorsHoldsTheirValuesAtSaveTime) {
  if (!cuda::emulated() && !cuda::is_available())
    GTEST_SKIP() << "needs a GPU or emulated ones (LOCKSTEP_TEST_EMULATE_GPUS=1)";
  TempDir dir;
  const std::string ckpt = dir.path("ckpt");
  constexpr int64_t kNumel = 37;
  expect_no_errors(lockstep::testing::run_ranks(2, [&](int rank, ProcessGroupPtr pg) {
    cuda::set_device(0);
    const auto [start, count] = shard_range(kNumel, rank, 2);
    Tensor param = arange(static_cast<double>(start), static_cast<double>(start + count), 1.0,
                          TensorOptions(kFloat32).with_device(cuda_device(0)));
    AsyncShardedSaver saver(*pg);
    saver.save(ckpt, {{"model.w", {kNumel}, start, param}}, meta_of(1, 2));
    param.fill_(-1.0);
    saver.wait();
    const Tensor all = io::ShardedCheckpointReader(ckpt).read("model.w");
    for (int64_t i = 0; i < kNumel; ++i) ASSERT_EQ(all.data<float>()[i], static_cast<float>(i));
  }));
}
