// `lockstep checkpoint consolidate`: reads a sharded checkpoint, verifies it and writes it whole.
#include "checkpoint_cmd.h"

#include <cstdio>

#include "agent.h"
#include "lockstep/base/error.h"
#include "lockstep/io/sharded_checkpoint.h"

namespace lockstep::launch {

CLI::App* add_checkpoint_command(CLI::App& app, CheckpointArgs& args) {
  CLI::App* checkpoint = app.add_subcommand("checkpoint", "Work on checkpoints");
  checkpoint->require_subcommand(1);
  CLI::App* consolidate = checkpoint->add_subcommand(
      "consolidate",
      "Write a sharded checkpoint (a directory with index.json and one file per rank) as one "
      "safetensors checkpoint file, every tensor whole");
  consolidate->footer(
      "\nUsage: lockstep checkpoint consolidate DIR -o model.safetensors\nThe file is an ordinary "
      "lockstep checkpoint (tensors model.* and optim.*, the metadata of the run), written "
      "atomically; Python reads it with safetensors.torch.load_file.\nExit codes: 0 written, 1 "
      "the checkpoint is missing or broken or the file cannot be written, 2 bad usage.");
  consolidate->add_option("dir", args.dir, "the sharded checkpoint's directory")->required();
  consolidate->add_option("-o,--output", args.output, "the safetensors file to write")->required();
  consolidate->add_flag("--no-verify", args.no_verify,
                        "skip checking each shard's SHA-256 (which reads every file twice)");
  return consolidate;
}

int run_checkpoint(const CheckpointArgs& args) {
  try {
    const io::ShardedCheckpointReader reader(args.dir);
    if (!args.no_verify) reader.verify();
    io::consolidate(args.dir, args.output);
    std::fprintf(stderr,
                 "lockstep checkpoint: wrote %s (%zu tensors, step %lld, from %lld ranks)\n",
                 args.output.c_str(), reader.tensors().size(),
                 static_cast<long long>(reader.checkpoint().step),
                 static_cast<long long>(reader.world_size()));
    return kExitOk;
  } catch (const Error& e) {
    std::fprintf(stderr, "lockstep checkpoint: %s\n", e.message().c_str());
    return kExitJobFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep checkpoint: %s\n", e.what());
    return kExitJobFailed;
  }
}

}  // namespace lockstep::launch
