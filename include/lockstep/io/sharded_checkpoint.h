// Sharded checkpoints: each rank writes only its slices of the tensors, one index says where each
// slice lives, and a reader takes any element range of any tensor, so a checkpoint written at
// one world size and layout loads at any other.
//
//   DIR/index.json                      format, world size, metadata, every tensor's slices
//   DIR/shard-<rank>-of-<world>.safetensors   rank's slices, keys "<name>@<start>", 1-D
//
// Writing is a protocol in three steps (Note [Sharded checkpoint] in
// src/io/sharded_checkpoint_write.cpp): every rank write_checkpoint_shard()s into a temporary
// sibling directory, rank 0 write_sharded_index()es once every rank's shard is there, and
// commit_sharded_checkpoint() renames the directory into place. dist::save_sharded_checkpoint
// and dist::AsyncShardedSaver run it across ranks; save_sharded_checkpoint below runs it in one
// process. `consolidate` turns a sharded checkpoint into one ordinary checkpoint file.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/io/checkpoint.h"

namespace lockstep::io {

// Elements [start, start + data.numel()) of the tensor `name` of shape `shape`, flattened in
// row-major order. Names follow Note [Checkpoint layout]: "model.<name>" for the module's state,
// "optim.<param>.<field>" (and "optim.step", "optim.group.<g>.lr") for the optimizer's, so that
// `consolidate` writes an ordinary checkpoint.
struct TensorSlice {
  std::string name;
  Dims shape;         // the whole tensor's shape
  int64_t start = 0;  // first element this slice holds
  Tensor data;        // its elements, any shape and device; the dtype is the tensor's
};

// What a reader asks for: `count` elements of `name` from `start` (-1: to the end).
struct SliceRequest {
  std::string name;
  int64_t start = 0;
  int64_t count = -1;
};

// The temporary directory a save of `dir` writes into: "<dir>.tmp-<token>". Every rank of one
// save must use the same token (dist:: broadcasts rank 0's).
std::string sharded_temp_dir(const std::string& dir, const std::string& token);
// A fresh token for sharded_temp_dir: random, so two saves never share a directory.
std::string new_sharded_token();

// Step 1, on every rank: writes this rank's slices to
// `tmp_dir`/shard-<rank>-of-<world>.safetensors (fsynced), then the marker that says it is whole
// (shard-<rank>-of-<world>.json: its size, SHA-256 and slices). Creates `tmp_dir` if needed.
// Slices are copied to the host here; a non-finite value is refused (Note [No NaN in a
// checkpoint]).
void write_checkpoint_shard(const std::string& tmp_dir, int rank, int world,
                            const std::vector<TensorSlice>& slices);
// What a rank whose step 1 failed leaves for rank 0 (shard-<rank>-of-<world>.failed), so that an
// asynchronous commit fails at once naming it instead of waiting out its timeout. Never throws.
void write_checkpoint_shard_failure(const std::string& tmp_dir, int rank, int world,
                                    const std::string& error);
// Waits until every rank's marker is in `tmp_dir` (polling the directory); throws naming the
// ranks missing at `timeout`, or the first rank that left a failure.
void wait_for_checkpoint_shards(const std::string& tmp_dir, int world,
                                std::chrono::milliseconds timeout);

// Step 2, on rank 0 once every rank's marker is there: checks that the ranks agree on each
// tensor's shape and dtype and that its slices tile it, then writes `tmp_dir`/index.json
// (fsynced) with `meta`'s non-tensor fields (step, epoch, rng, scaler, user, ...; its model and
// optimizer must be empty: tensors are slices) and removes the markers.
void write_sharded_index(const std::string& tmp_dir, int world, const TrainingCheckpoint& meta);

// Step 3: makes `tmp_dir` the checkpoint `dir`, atomically; an older `dir` is replaced and
// removed. Then removes temporary directories that earlier, interrupted saves of `dir`'s series
// left behind.
void commit_sharded_checkpoint(const std::string& tmp_dir, const std::string& dir);

// The three steps in one process, `shards[r]` being rank r's slices (tools, tests).
void save_sharded_checkpoint(const std::string& dir,
                             const std::vector<std::vector<TensorSlice>>& shards,
                             const TrainingCheckpoint& meta);

// A tensor of the index.
struct ShardedTensorInfo {
  std::string name;
  Dims shape;
  DType dtype = DType::f32;
  int64_t numel() const { return shape.numel(); }
};

// Reads a sharded checkpoint. Opening reads and validates index.json and checks that every file
// it names exists with the size it records (a missing or truncated shard is an error here, naming
// the file); the data is read only by read(), by pread of the byte ranges asked for. SHA-256 is
// checked only by verify(), which reads every file in full. Errors name the file and what was
// expected. A read returns the whole range asked for or throws.
class ShardedCheckpointReader {
 public:
  explicit ShardedCheckpointReader(const std::string& dir);

  const std::string& dir() const { return dir_; }
  int64_t world_size() const { return world_size_; }  // ranks that wrote it
  // The non-tensor fields (step, epoch, rng, ...); model and optimizer are empty.
  const TrainingCheckpoint& checkpoint() const { return meta_; }
  // In the order of the index (rank 0's order first).
  const std::vector<ShardedTensorInfo>& tensors() const { return tensors_; }
  bool contains(const std::string& name) const;
  const ShardedTensorInfo& info(const std::string& name) const;

  // Elements [start, start + count) of `name`, flattened: a contiguous 1-D CPU tensor.
  Tensor read(const std::string& name, int64_t start, int64_t count) const;
  // The whole tensor, in its shape.
  Tensor read(const std::string& name) const;
  // read(r.name, r.start, r.count) as a slice of the tensor's shape.
  TensorSlice read(const SliceRequest& r) const;

  // Reads every file in full and checks its SHA-256 and that its safetensors header holds each
  // slice where the index says, with its dtype.
  void verify() const;

 private:
  struct Slice {
    int64_t start = 0, count = 0;
    size_t file = 0;     // into files_
    int64_t offset = 0;  // of its first byte in the file
  };
  struct File {
    std::string name;  // relative to dir_
    int64_t size = 0;
    std::string sha256;
  };
  size_t index_of(const std::string& name) const;
  std::string path_of(const File& f) const;

  std::string dir_;
  int64_t world_size_ = 0;
  TrainingCheckpoint meta_;
  std::vector<ShardedTensorInfo> tensors_;
  std::vector<std::vector<Slice>> slices_;  // per tensor, by start
  std::vector<File> files_;
};

// Writes the whole checkpoint in `dir` to `out_path` as one ordinary lockstep checkpoint
// (save_checkpoint: atomic; load_checkpoint and Python's safetensors read it), every tensor whole
// under its name in the index, with the metadata. The whole checkpoint is held in memory meanwhile.
void consolidate(const std::string& dir, const std::string& out_path);

// Sharded checkpoints as a series, as io::checkpoint.h has for files: `base` is "run/ckpt",
// periodic ones checkpoint_path_for_step(base, step) ("run/ckpt.step00000040"), each a directory
// recognised by its index.json.

// Whether `path` is a directory holding an index.json (a sharded checkpoint, valid or not).
bool is_sharded_checkpoint(const std::string& path);
// The step its index records, -1 when the index cannot be read.
int64_t sharded_checkpoint_step(const std::string& dir);
// Why `dir` does not open and verify (the reader's message), "" when it does.
std::string sharded_checkpoint_problem(const std::string& dir);
// What `--resume auto` continues from, as latest_valid_checkpoint for files: the newest sharded
// checkpoint of `base` (periodic ones by the step in their names, `base` by the step in its
// index) that opens and verifies (every file read in full), with the newer ones that did not.
// Temporary directories of unfinished saves are never candidates.
CheckpointChoice latest_valid_sharded_checkpoint(const std::string& base);
// Deletes all but the newest `keep` periodic sharded checkpoints of checkpoint_series(dir) up to
// dir's step (keep 0: none), never those in `spare`. Returns the directories deleted.
std::vector<std::string> prune_sharded_checkpoints(const std::string& dir, int64_t keep,
                                                   const std::vector<std::string>& spare = {});

}  // namespace lockstep::io
