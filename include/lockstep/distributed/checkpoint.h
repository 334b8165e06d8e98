// Checkpoints in a distributed run: rank 0 writes, every rank loads (see io/checkpoint.h for
// the file).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/distributed/process_group.h"
#include "lockstep/io/checkpoint.h"

namespace lockstep::dist {

// Rank 0 writes `ckpt` to `path` (io::save_checkpoint: atomic) and then keeps only the newest
// `keep` periodic checkpoints beside it (0: all); the other ranks' `ckpt` is not used. Every rank
// returns once the file is complete on disk, the barrier of the save. When rank 0 fails to
// write, every rank throws with rank 0's message: no rank waits for a file that never comes.
// The paths in `spare` are never deleted by the pruning (io::prune_checkpoints).
void save_checkpoint(ProcessGroup& pg, const std::string& path, const io::TrainingCheckpoint& ckpt,
                     int64_t keep = 0, const std::vector<std::string>& spare = {});

enum class CheckpointLoad {
  automatic,   // every_rank when every rank sees the file rank 0 sees, else broadcast
  every_rank,  // each rank reads the file (a shared or copied file system)
  broadcast,   // rank 0 reads it and sends it to the others (the file is on rank 0's node only)
};

// Every rank gets the checkpoint at rank 0's `path`, verified (SHA-256) where it is used. A
// failure on any rank is an error on every rank, with the failing rank's message.
io::TrainingCheckpoint load_checkpoint(ProcessGroup& pg, const std::string& path,
                                       CheckpointLoad how = CheckpointLoad::automatic);

// `--resume` for every rank. "auto" is rank 0's io::latest_valid_checkpoint(base): the newest
// checkpoint that verifies ("" when there is none yet), with the newer ones that did not in
// `skipped` and a warning on rank 0 for each (they are left untouched); when checkpoints exist
// but none verifies, it is an error listing them all. Any other value is a file that must exist
// on rank 0 (a corrupt one then fails in load_checkpoint: an explicit choice is not replaced).
io::CheckpointChoice resolve_resume(ProcessGroup& pg, const std::string& resume,
                                    const std::string& base);

// Every rank learns whether rank 0 can write a checkpoint to `path`
// (io::checkpoint_path_problem); if not, every rank throws an error naming `what` (a flag, say),
// the path and the reason. For a check before the work whose result the checkpoint would hold.
void check_checkpoint_path(ProcessGroup& pg, const std::string& what, const std::string& path);

}  // namespace lockstep::dist
