// Training checkpoints: everything a run needs to continue exactly where it stopped, in one
// safetensors file that Python loads too.
//
//   io::TrainingCheckpoint ckpt;
//   ckpt.model = model.state_dict();
//   ckpt.optimizer = opt.state_dict();
//   ckpt.optimizer_param_names = names of opt's parameters, in its order (optional)
//   ckpt.scaler = scaler.state_dict();
//   ckpt.step = steps; ckpt.epoch = epoch; ckpt.epoch_samples = consumed; ...
//   io::save_checkpoint("run/ckpt.safetensors", ckpt);
//
// File layout (Note [Checkpoint layout] in src/io/checkpoint.cpp): tensors "model.<name>" and
// "optim.<param>.<state>", the rest in __metadata__, with the SHA-256 of the data section.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "lockstep/io/safetensors.h"

namespace lockstep::io {

// A Generator's position: Generator(seed) advanced to offset reproduces its next draws.
struct GeneratorState {
  uint64_t seed = 0;
  uint64_t offset = 0;
  bool operator==(const GeneratorState&) const = default;
};

struct TrainingCheckpoint {
  NamedTensors model;      // nn::Module::state_dict()
  NamedTensors optimizer;  // optim::Optimizer::state_dict(): "<index>.<field>", "step", ...
  // The optimizer's parameters by name, in its order: the file then says
  // "optim.fc1.weight.momentum_buffer" instead of "optim.0.momentum_buffer". Optional.
  std::vector<std::string> optimizer_param_names;
  std::map<std::string, double> scaler;  // amp::GradScaler::state_dict(); empty without one
  int64_t step = 0;                      // optimizer steps taken since the run began
  int64_t epoch = 0;                     // the sampler epoch training was in
  // Samples of that epoch that all ranks together had consumed: a prefix of the epoch's order
  // (DistributedSampler::set_start_index resumes after it, with any rank count).
  int64_t epoch_samples = 0;
  int64_t world_size = 1;                     // ranks of the run that wrote it
  std::map<std::string, GeneratorState> rng;  // named generators
  Metadata user;                              // anything else (strings)
};

// Writes `ckpt` to `path` atomically: a temporary file in the same directory, fsynced, renamed
// over `path`, directory fsynced. A crash or SIGKILL at any moment leaves either the previous
// file or the new one.
void save_checkpoint(const std::string& path, const TrainingCheckpoint& ckpt);

// Reads and verifies a checkpoint: the safetensors checks, the format marker, the SHA-256 of
// the data section. Errors name the file and what was expected.
TrainingCheckpoint load_checkpoint(const std::string& path);

// The two halves of save/load, for callers that move the contents another way (dist's
// rank-0-loads-and-broadcasts): the tensors and metadata save_checkpoint writes, and the
// checkpoint they hold, verified (`source` names them in errors).
SafetensorsContents checkpoint_contents(const TrainingCheckpoint& ckpt);
TrainingCheckpoint checkpoint_from_contents(SafetensorsContents contents,
                                            const std::string& source);

// Periodic checkpoints of a run live beside its --save path: "run/ckpt.safetensors" has
// "run/ckpt.step00000040.safetensors" for step 40.
std::string checkpoint_path_for_step(const std::string& base, int64_t step);
// (step, path) of the periodic checkpoints of `base`, oldest first.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& base);
// The newest checkpoint of `base` (its periodic ones and `base` itself, by the step recorded in
// them), or "" if there is none. It is not read beyond its header: see latest_valid_checkpoint.
std::string latest_checkpoint(const std::string& base);

// A checkpoint that latest_valid_checkpoint passed over, and why (load_checkpoint's message).
struct SkippedCheckpoint {
  std::string path;
  std::string reason;
};
struct CheckpointChoice {
  std::string path;                        // "" when no checkpoint of the series verifies
  std::vector<SkippedCheckpoint> skipped;  // newer ones that did not, newest first
};
// What `--resume auto` continues from: the newest checkpoint of `base` that loads and verifies
// (load_checkpoint, SHA-256 included, so each candidate is read in full), newest first as
// latest_checkpoint orders them; `base` itself comes first when its header cannot be read, so
// that it is reported rather than passed over in silence. Nothing is deleted, moved or written.
CheckpointChoice latest_valid_checkpoint(const std::string& base);
// Why `path` does not load as a checkpoint (load_checkpoint's message), "" when it does.
std::string checkpoint_problem(const std::string& path);

// Why a checkpoint cannot be written to `path`, "" when it can: `path` is not a directory, its
// directory exists or is created now, and a file can be created there (one is created and
// removed). For a program to check its --save before the work whose result it would hold.
std::string checkpoint_path_problem(const std::string& path);
// The `base` a periodic checkpoint belongs to ("run/ckpt.step00000040.safetensors" ->
// "run/ckpt.safetensors"); any other path is its own base.
std::string checkpoint_series(const std::string& path);
// Deletes all but the newest `keep` periodic checkpoints of checkpoint_series(path) (keep 0:
// delete none), and temporary files of writers that no longer run. Returns the paths deleted.
// The paths in `spare` (checkpoints a resume found corrupt, kept for the user to inspect) are
// neither deleted nor counted among the `keep`.
std::vector<std::string> prune_checkpoints(const std::string& path, int64_t keep,
                                           const std::vector<std::string>& spare = {});

// The step recorded in a checkpoint's header, reading only the header (-1 if it is not a
// readable lockstep checkpoint).
int64_t checkpoint_step(const std::string& path);
// The SHA-256 a checkpoint's header records ("" if it is not a readable lockstep checkpoint).
std::string checkpoint_digest(const std::string& path);

}  // namespace lockstep::io
