// Rank-0 checkpoint writes with a failure-carrying barrier; loading by every rank or by
// broadcast from rank 0; rank 0's choices (what to resume, whether --save is writable) for all.
#include "lockstep/distributed/checkpoint.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>

#include "distributed/checkpoint/agree.h"
#include "distributed/checkpoint/resume_choice.h"
#include "lockstep/base/log.h"

namespace lockstep::dist {

namespace {

using json = nlohmann::json;

// Rank 0's contents, sent to every rank: a JSON description (metadata, names, dtypes, shapes)
// and the data as one byte buffer.
io::SafetensorsContents broadcast_contents(ProcessGroup& pg, const std::string& path) {
  io::SafetensorsContents c;
  json desc;
  std::string error;
  if (pg.rank() == 0) {
    error = failure_of([&] {
      c = io::load_safetensors(path);
      desc["metadata"] = c.metadata;
      json tensors = json::array();
      for (const auto& [name, t] : c.tensors)
        tensors.push_back({name, io::safetensors_dtype(t.dtype()), t.shape().vec()});
      desc["tensors"] = tensors;
    });
  }
  const std::string header = broadcast_text(pg, pg.rank() == 0 && error.empty() ? desc.dump() : "");
  agree(pg, "load_checkpoint", error);
  // Everything that can fail (parsing, allocating the copies) before the data moves, so that
  // no rank is left in the broadcast when another gave up.
  int64_t total = 0;
  Tensor buffer;
  error = failure_of([&] {
    if (pg.rank() != 0) {
      desc = json::parse(header);
      c.metadata = desc["metadata"].get<io::Metadata>();
      for (const auto& t : desc["tensors"])
        c.tensors.emplace_back(t[0].get<std::string>(),
                               empty(Dims(t[2].get<std::vector<int64_t>>()),
                                     io::parse_safetensors_dtype(t[1].get<std::string>())));
    }
    for (const auto& [name, t] : c.tensors) total += t.nbytes();
    buffer = empty({total}, kUInt8);
  });
  agree(pg, "load_checkpoint", error);
  auto* bytes = static_cast<uint8_t*>(buffer.data_ptr());
  if (pg.rank() == 0) {
    int64_t at = 0;
    for (const auto& [name, t] : c.tensors) {
      std::memcpy(bytes + at, t.data_ptr(), static_cast<size_t>(t.nbytes()));
      at += t.nbytes();
    }
  }
  if (total > 0) pg.broadcast_host(buffer, {.root = 0});
  if (pg.rank() != 0) {
    int64_t at = 0;
    for (auto& [name, t] : c.tensors) {
      std::memcpy(t.data_ptr(), bytes + at, static_cast<size_t>(t.nbytes()));
      at += t.nbytes();
    }
  }
  return c;
}

// The SHA-256 the header of `path` records, "" when the file cannot be read as a checkpoint.
std::string recorded_digest(const std::string& path) {
  std::string digest;
  failure_of([&] {
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec)) digest = io::checkpoint_digest(path);
  });
  return digest;
}

}  // namespace

void save_checkpoint(ProcessGroup& pg, const std::string& path, const io::TrainingCheckpoint& ckpt,
                     int64_t keep, const std::vector<std::string>& spare) {
  std::string error;
  if (pg.rank() == 0) {
    error = failure_of([&] {
      io::save_checkpoint(path, ckpt);
      io::prune_checkpoints(path, keep, spare);
    });
  }
  // The broadcast is the barrier: the others wait until rank 0 says the file is there.
  const std::string status = broadcast_text(pg, error);
  LS_CHECK(status.empty(), "save_checkpoint failed on rank 0: ", status);
}

io::TrainingCheckpoint load_checkpoint(ProcessGroup& pg, const std::string& path,
                                       CheckpointLoad how) {
  if (pg.size() > 1 && how == CheckpointLoad::automatic) {
    // Every rank reads the file itself when it sees the very file rank 0 sees.
    const std::vector<std::string> digests = all_gather_text(pg, recorded_digest(path));
    bool same = !digests[0].empty();
    for (const std::string& d : digests) same = same && d == digests[0];
    how = same ? CheckpointLoad::every_rank : CheckpointLoad::broadcast;
  }
  if (pg.size() == 1 || how == CheckpointLoad::every_rank) {
    io::TrainingCheckpoint ckpt;
    const std::string error = failure_of([&] { ckpt = io::load_checkpoint(path); });
    if (pg.size() > 1) agree(pg, "load_checkpoint", error);
    LS_CHECK(error.empty(), error);
    return ckpt;
  }
  io::SafetensorsContents c = broadcast_contents(pg, path);
  io::TrainingCheckpoint ckpt;
  const std::string error = failure_of([&] {
    ckpt = io::checkpoint_from_contents(std::move(c), path);  // the SHA-256 checks the transfer
  });
  agree(pg, "load_checkpoint", error);
  return ckpt;
}

io::CheckpointChoice resolve_resume_with(ProcessGroup& pg, const std::string& resume,
                                         const std::string& base, const ResumeSearch& search) {
  io::CheckpointChoice choice;
  std::string error;
  if (pg.rank() == 0) {
    error = failure_of([&] {
      if (resume == "auto") {
        choice = search.latest_valid(base);
        std::string all;
        for (const auto& [path, reason] : choice.skipped) {
          if (!choice.path.empty())
            log_warning("--resume auto: skipping ", path, ", which does not verify (", reason,
                        "); it is left as it is");
          all += "\n  " + path + ": " + reason;
        }
        LS_CHECK(!choice.path.empty() || choice.skipped.empty(), "--resume auto: no ", search.what,
                 " of ", base,
                 " verifies; remove or move aside the corrupt ones to start from step 0:", all);
      } else {
        const std::string problem = search.explicit_problem(resume);
        LS_CHECK(problem.empty(), "--resume ", resume, ": ", problem);
        choice.path = resume;
      }
    });
  }
  // Rank 0's choice, or its error, for every rank.
  json answer;
  if (pg.rank() == 0) {
    answer["error"] = error;
    answer["path"] = choice.path;
    answer["skipped"] = json::array();
    for (const auto& [path, reason] : choice.skipped) answer["skipped"].push_back({path, reason});
  }
  answer = json::parse(broadcast_text(pg, answer.dump()));
  LS_CHECK(answer["error"].get<std::string>().empty(), answer["error"].get<std::string>());
  choice.path = answer["path"].get<std::string>();
  choice.skipped.clear();
  for (const auto& s : answer["skipped"])
    choice.skipped.push_back({s[0].get<std::string>(), s[1].get<std::string>()});
  return choice;
}

io::CheckpointChoice resolve_resume(ProcessGroup& pg, const std::string& resume,
                                    const std::string& base) {
  ResumeSearch search;
  search.latest_valid = io::latest_valid_checkpoint;
  search.explicit_problem = [](const std::string& path) -> std::string {
    std::error_code ec;
    return std::filesystem::is_regular_file(path, ec) ? "" : "no such checkpoint file";
  };
  return resolve_resume_with(pg, resume, base, search);
}

void check_checkpoint_path(ProcessGroup& pg, const std::string& what, const std::string& path) {
  std::string problem;
  if (pg.rank() == 0) {
    const std::string error = failure_of([&] { problem = io::checkpoint_path_problem(path); });
    if (!error.empty()) problem = error;
  }
  problem = broadcast_text(pg, problem);
  LS_CHECK(problem.empty(), what, " ", path, " cannot be written: ", problem);
}

}  // namespace lockstep::dist
