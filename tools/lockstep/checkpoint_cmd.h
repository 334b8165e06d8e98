// `lockstep checkpoint consolidate DIR -o FILE`: a sharded checkpoint (io/sharded_checkpoint.h)
// written by any number of ranks, as one ordinary checkpoint file that Python's safetensors reads.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace lockstep::launch {

struct CheckpointArgs {
  std::string dir;         // the sharded checkpoint
  std::string output;      // the file to write
  bool no_verify = false;  // skip checking every shard's SHA-256 first
};

// Adds `checkpoint` and its `consolidate` to `app`; returns `consolidate`, whose parsed() says
// to call run_checkpoint.
CLI::App* add_checkpoint_command(CLI::App& app, CheckpointArgs& args);

// Exit codes: 0 written; 1 the checkpoint is missing or broken, or the file cannot be written.
int run_checkpoint(const CheckpointArgs& args);

}  // namespace lockstep::launch
