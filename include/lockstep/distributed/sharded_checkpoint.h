// Sharded checkpoints across ranks: every rank writes its own slices (io/sharded_checkpoint.h),
// at once or in the background while training goes on; every rank reads the ranges it needs.
//
//   std::vector<io::TensorSlice> mine = ...;   // this rank's part of each parameter and state
//   dist::save_sharded_checkpoint(*pg, io::checkpoint_path_for_step("run/ckpt", step), mine,
//                                 meta, /*keep=*/3);
//   ...
//   io::CheckpointChoice c = dist::resolve_sharded_resume(*pg, "auto", "run/ckpt");
//   auto loaded = dist::load_sharded_checkpoint(*pg, c.path, {{"model.w", start, count}, ...});
//
// The ranks must share the file system the checkpoint is written to: rank 0 writes the index
// once every rank's file is in the checkpoint's (temporary) directory.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/distributed/process_group.h"
#include "lockstep/io/sharded_checkpoint.h"

namespace lockstep::dist {

// Collective. Every rank writes `slices` into the checkpoint `dir`; rank 0 writes the index
// (from `meta`: step, epoch, rng, ...; its model and optimizer empty; the other ranks' `meta` is
// not used), commits the directory (Note [Sharded checkpoint]) and keeps only the newest `keep`
// periodic sharded checkpoints of dir's series up to it (0: all; `spare` never deleted). Every
// rank returns once `dir` is complete; a failure on any rank is an error on every rank naming
// the rank and its message (which names the file), and leaves any older `dir` as it was.
void save_sharded_checkpoint(ProcessGroup& pg, const std::string& dir,
                             const std::vector<io::TensorSlice>& slices,
                             const io::TrainingCheckpoint& meta, int64_t keep = 0,
                             const std::vector<std::string>& spare = {});

struct AsyncSaveOptions {
  // How long rank 0's background commit waits for the other ranks' shards.
  std::chrono::milliseconds commit_timeout = std::chrono::minutes(10);
  int64_t keep = 0;                // as save_sharded_checkpoint
  std::vector<std::string> spare;  // as save_sharded_checkpoint
};

// Saves sharded checkpoints on a background thread while training goes on. save() copies the
// slices to host buffers of its own (the only cost the training step pays) and returns; a thread
// writes them, and on rank 0 waits for every rank's shard through the file system — never the
// process group, whose collectives belong to training (Note [Sharded checkpoint]) — and commits.
// One save at a time: save() first waits for the previous one.
//
// Errors: a failure of the background work surfaces on every rank at the next save() or wait()
// (one small all-gather in each), naming the rank and the file, as a lockstep::Error. The
// checkpoint that failed is not committed; the previous one stays whole.
class AsyncShardedSaver {
 public:
  // `pg` must outlive the saver; it is used only on the calling thread, inside save() and wait().
  explicit AsyncShardedSaver(ProcessGroup& pg, AsyncSaveOptions opts = {});
  // Waits for the save in flight; logs its failure (a destructor never throws).
  ~AsyncShardedSaver();
  AsyncShardedSaver(const AsyncShardedSaver&) = delete;
  AsyncShardedSaver& operator=(const AsyncShardedSaver&) = delete;

  // Collective. Waits for the previous save and throws if it failed on any rank; then snapshots
  // `slices` and starts writing `dir` in the background (`meta` as in save_sharded_checkpoint).
  void save(const std::string& dir, const std::vector<io::TensorSlice>& slices,
            const io::TrainingCheckpoint& meta);
  // Collective. Returns once the save in flight is committed (every rank returns after rank 0's
  // commit); throws on every rank if it failed on any.
  void wait();
  // Whether this rank's background work is still running (never blocks).
  bool busy() const;

 private:
  struct State;
  // This rank's background work's error ("" when none or nothing ran), after joining it.
  std::string join();

  ProcessGroup& pg_;
  AsyncSaveOptions opts_;
  std::unique_ptr<State> state_;
};

// `--resume` over sharded checkpoints, as dist::resolve_resume for files: "auto" is rank 0's
// io::latest_valid_sharded_checkpoint(base) ("" when there is none yet; newer ones that do not
// verify in `skipped`, warned on rank 0; an error when some exist and none verifies); any other
// value is a directory that must be a sharded checkpoint on rank 0.
io::CheckpointChoice resolve_sharded_resume(ProcessGroup& pg, const std::string& resume,
                                            const std::string& base);

struct ShardedLoad {
  io::TrainingCheckpoint meta;          // the non-tensor fields; model and optimizer empty
  std::vector<io::TensorSlice> slices;  // what was asked for, in that order
};
// Collective. Every rank opens `dir` and reads the ranges it asks for (any layout, any world
// size); a failure on any rank is an error on every rank naming the rank.
ShardedLoad load_sharded_checkpoint(ProcessGroup& pg, const std::string& dir,
                                    const std::vector<io::SliceRequest>& wanted);

}  // namespace lockstep::dist
