// Writing sharded checkpoints: each rank's shard file and marker, rank 0's index, the commit.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/checkpoint_checks.h"
#include "io/sharded_format.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/syscall.h"
#include "lockstep/io/sharded_checkpoint.h"

namespace lockstep::io {

// Note [Sharded checkpoint]
// A sharded checkpoint is a directory DIR:
//   shard-<r>-of-<W>.safetensors  rank r's slices, an ordinary safetensors file; key
//                                 "<name>@<start>", a 1-D tensor of the slice's elements
//   index.json                    {"format": "lockstep.sharded_checkpoint", "version": 1,
//                                  "world_size": W, "metadata": {...},
//                                  "files": [{"name", "size", "sha256"}],
//                                  "tensors": {name: {"dtype", "shape", "slices": [{"file",
//                                  "start", "count", "offset", "length"}]}}}
// "metadata" is the __metadata__ save_checkpoint writes for the same fields (Note [Checkpoint
// layout]); "offset" and "length" are the slice's bytes in its file, so a reader preads them
// without parsing the shard's header. A tensor's slices tile its flattened [0, numel) exactly.
//
// The directory appears whole or not at all:
//   1. Every rank writes its shard into DIR.tmp-<token> (one token per save, rank 0's), fsyncs
//      it, and then writes shard-<r>-of-<W>.json, its marker: the file's size, SHA-256 and
//      slices. The marker is written last, atomically (temporary file, fsync, rename), so it
//      exists only once the shard is whole on disk. A rank of a background save that fails
//      leaves shard-<r>-of-<W>.failed with its error instead, so that rank 0 stops waiting.
//   2. Rank 0 learns that every marker exists — a barrier in dist::save_sharded_checkpoint; in
//      dist::AsyncShardedSaver, whose background thread may not use the process group (its
//      collectives would interleave with training's), by polling the directory with a timeout —
//      then writes index.json from the markers (fsynced, atomic) and removes the markers.
//   3. Rank 0 renames DIR.tmp-<token> to DIR. An older DIR is swapped with it in one step
//      (renameat2 RENAME_EXCHANGE) and then removed, so DIR always names a whole checkpoint,
//      the older or the newer. Where the file system cannot exchange, the older DIR is renamed
//      to DIR.old-<token> first: a crash between the two renames leaves no DIR but the previous
//      periodic checkpoints, which --resume auto then finds. The parent directory is fsynced.
// A crash before 3 leaves DIR.tmp-<token>, which is no checkpoint: latest_valid_sharded_checkpoint
// never lists it (its name is no periodic checkpoint's), and the next commit of the series
// removes it. Shard files of one save never mix with another's: each save has its own directory.

namespace {

using json = nlohmann::ordered_json;
namespace fs = std::filesystem;

constexpr auto kPollInterval = std::chrono::milliseconds(20);
constexpr const char* kOldInfix = ".old-";

// Writes `text` to `path` through a temporary file, fsynced and renamed: `path` exists only whole
// (AtomicFile, whose temporary name is the writer's own, so two writers never share one).
void write_file_atomic(const std::string& path, const std::string& text, const std::string& what) {
  AtomicFile f(path, what);
  f.write(text.data(), text.size());
  f.commit();
}

// "run/ckpt/" names the directory "run/ckpt", whose parent is "run".
std::string without_trailing_slash(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Temporary and set-aside directories of `dir`'s series left by saves that did not finish.
void remove_stale_directories(const std::string& dir) {
  const std::string series = checkpoint_series(dir);
  std::error_code ec;
  fs::directory_iterator it(parent_directory(dir), ec), end;
  std::vector<fs::path> stale;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    for (const char* infix : {sharded::kTempInfix, kOldInfix}) {
      const size_t at = name.rfind(infix);
      if (at == std::string::npos || at == 0) continue;
      const std::string owner = (fs::path(dir).parent_path() / name.substr(0, at)).string();
      std::error_code dir_ec;
      if (checkpoint_series(owner) == series && it->is_directory(dir_ec))
        stale.push_back(it->path());
    }
  }
  for (const fs::path& p : stale) fs::remove_all(p, ec);
}

}  // namespace

std::string sharded_temp_dir(const std::string& dir, const std::string& token) {
  LS_CHECK(!dir.empty() && !token.empty(), "sharded_temp_dir: expected a directory and a token");
  return without_trailing_slash(dir) + sharded::kTempInfix + token;
}

std::string new_sharded_token() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

void write_checkpoint_shard(const std::string& tmp_dir, int rank, int world,
                            const std::vector<TensorSlice>& slices) {
  LS_CHECK(world >= 1 && rank >= 0 && rank < world,
           "write_checkpoint_shard: expected 0 <= rank < world, got rank ", rank, " of ", world);
  autograd::NoGradGuard no_grad;
  const std::string file = sharded::shard_name(rank, world, ".safetensors");
  const std::string path = (fs::path(tmp_dir) / file).string();
  const std::string what = "write_checkpoint_shard: " + path;
  std::error_code ec;
  fs::create_directories(tmp_dir, ec);
  LS_CHECK(!ec, what, ": cannot create the directory ", tmp_dir, ": ", ec.message());

  NamedTensors tensors;
  json entries = json::array();
  for (const TensorSlice& s : slices) {
    LS_CHECK(starts_with(s.name, "model.") || starts_with(s.name, "optim."), what,
             ": tensor name '", s.name,
             "' should start with 'model.' or 'optim.' (Note [Checkpoint layout])");
    LS_CHECK(s.data.defined(), what, ": the slice of '", s.name, "' at ", s.start, " has no data");
    const int64_t count = s.data.numel();
    LS_CHECK(s.start >= 0 && s.start + count <= s.shape.numel(), what, ": the slice of '", s.name,
             "' holds elements [", s.start, ", ", s.start + count,
             "), expected a range inside [0, ", s.shape.numel(), ") for shape ", s.shape.str());
    Tensor flat = s.data.to(kCPU).contiguous().reshape({count});
    const std::string bad = non_finite_values(flat);
    LS_CHECK(bad.empty(), what, ": tensor '", s.name, "' (elements from ", s.start, "): ", bad,
             "; the training has diverged, and a checkpoint holding NaN or Inf is not written "
             "(the checkpoints already written are left as they are)");
    tensors.emplace_back(sharded::slice_key(s.name, s.start), flat);
    entries.push_back({{"name", s.name},
                       {"dtype", safetensors_dtype(flat.dtype())},
                       {"shape", s.shape.vec()},
                       {"start", s.start},
                       {"count", count}});
  }
  const Metadata meta = {{sharded::kFormat, std::to_string(sharded::kVersion)},
                         {"rank", std::to_string(rank)},
                         {"world_size", std::to_string(world)}};
  save_safetensors(path, tensors, meta);

  // Where each slice landed and the file's SHA-256: the header from the file, the data (written
  // from these very tensors, in this order, without gaps) from memory, which spares a read-back.
  Fd fd(LS_SYSCHECK_MSG(::open(path.c_str(), O_RDONLY | O_CLOEXEC), what, ": cannot reopen it"));
  const sharded::Header h = sharded::read_header(fd.get(), path, what + ": ");
  std::vector<char> head(static_cast<size_t>(h.bytes));
  sharded::pread_all(fd.get(), head.data(), head.size(), 0, path);
  Sha256 sha;
  sha.update(head.data(), head.size());
  int64_t at = h.bytes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [key, t] = tensors[i];
    const sharded::HeaderEntry& e = h.entries.at(key);
    LS_CHECK(e.begin == at && e.end - e.begin == t.nbytes(), what, ": '", key, "' is at bytes [",
             e.begin, ", ", e.end, "), expected it at ", at, " (", t.nbytes(), " bytes)");
    sha.update(t.data_ptr(), static_cast<size_t>(t.nbytes()));
    entries[i]["offset"] = at;
    entries[i]["length"] = t.nbytes();
    at = e.end;
  }
  struct stat st {};
  LS_SYSCHECK_MSG(::fstat(fd.get(), &st), what, ": cannot stat it");
  LS_CHECK(st.st_size == at, what, ": it is ", st.st_size, " bytes, expected ", at);

  const json marker = {{"file", file}, {"rank", rank},        {"world_size", world},
                       {"size", at},   {"sha256", sha.hex()}, {"slices", entries}};
  write_file_atomic((fs::path(tmp_dir) / sharded::shard_name(rank, world, ".json")).string(),
                    marker.dump(), what);
}

void write_checkpoint_shard_failure(const std::string& tmp_dir, int rank, int world,
                                    const std::string& error) {
  try {
    std::error_code ec;
    fs::create_directories(tmp_dir, ec);
    write_file_atomic((fs::path(tmp_dir) / sharded::shard_name(rank, world, ".failed")).string(),
                      error, "write_checkpoint_shard_failure");
  } catch (const std::exception&) {
    // Rank 0 then names this rank at its timeout instead.
  }
}

void wait_for_checkpoint_shards(const std::string& tmp_dir, int world,
                                std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::vector<int> missing;
    for (int r = 0; r < world; ++r) {
      const fs::path dir(tmp_dir);
      std::error_code ec;
      if (fs::exists(dir / sharded::shard_name(r, world, ".json"), ec)) continue;
      const fs::path failed = dir / sharded::shard_name(r, world, ".failed");
      LS_CHECK(!fs::exists(failed, ec), "sharded checkpoint ", tmp_dir, ": rank ", r,
               " could not write its shard: ", read_text(failed.string()));
      missing.push_back(r);
    }
    if (missing.empty()) return;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string ranks;
      for (int r : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      LS_THROW("sharded checkpoint ", tmp_dir, ": after ", timeout.count(), " ms, ", missing.size(),
               " of ", world, " ranks had not written their shard (ranks ", ranks,
               "; expected shard-<rank>-of-", world,
               ".json from each); the ranks must share this file system");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

void write_sharded_index(const std::string& tmp_dir, int world, const TrainingCheckpoint& meta) {
  const std::string index_path = (fs::path(tmp_dir) / sharded::kIndexName).string();
  const std::string what = "write_sharded_index: " + index_path;
  LS_CHECK(meta.model.empty() && meta.optimizer.empty(), what,
           ": the metadata's model and optimizer should be empty (tensors are given as slices), "
           "got ",
           meta.model.size(), " and ", meta.optimizer.size(), " tensors");
  // The same metadata save_checkpoint writes for these fields, parsed back by the reader with
  // checkpoint_from_contents; its sha256 covers the metadata alone.
  const Metadata metadata = checkpoint_contents(meta).metadata;

  json files = json::array();
  json tensors = json::object();
  std::map<std::string, std::string> first_file;  // a tensor's first file, for messages
  for (int r = 0; r < world; ++r) {
    const std::string marker_path =
        (fs::path(tmp_dir) / sharded::shard_name(r, world, ".json")).string();
    json m;
    try {
      m = json::parse(read_text(marker_path));
      LS_CHECK(m.at("rank").get<int>() == r && m.at("world_size").get<int>() == world, what, ": ",
               marker_path, " is rank ", m.at("rank").get<int>(), " of ",
               m.at("world_size").get<int>(), ", expected rank ", r, " of ", world);
      const std::string file = m.at("file").get<std::string>();
      files.push_back({{"name", file}, {"size", m.at("size")}, {"sha256", m.at("sha256")}});
      for (const json& s : m.at("slices")) {
        const std::string name = s.at("name").get<std::string>();
        if (!tensors.contains(name)) {
          tensors[name] = {
              {"dtype", s.at("dtype")}, {"shape", s.at("shape")}, {"slices", json::array()}};
          first_file[name] = file;
        }
        json& t = tensors[name];
        LS_CHECK(t["dtype"] == s.at("dtype") && t["shape"] == s.at("shape"), what, ": tensor '",
                 name, "' is ", t["dtype"].get<std::string>(), " ", t["shape"].dump(), " in ",
                 first_file[name], " but ", s.at("dtype").get<std::string>(), " ",
                 s.at("shape").dump(), " in ", file, " (the ranks should agree)");
        t["slices"].push_back({{"file", file},
                               {"start", s.at("start")},
                               {"count", s.at("count")},
                               {"offset", s.at("offset")},
                               {"length", s.at("length")}});
      }
    } catch (const json::exception& e) {
      LS_THROW(what, ": the marker ", marker_path, " is not what write_checkpoint_shard writes (",
               e.what(), ")");
    }
  }
  for (auto& [name, t] : tensors.items()) {
    json& slices = t["slices"];
    std::sort(slices.begin(), slices.end(), [](const json& a, const json& b) {
      return a["start"].get<int64_t>() < b["start"].get<int64_t>();
    });
    std::vector<std::pair<int64_t, int64_t>> ranges;
    std::vector<std::string> in_files;
    for (const json& s : slices) {
      ranges.emplace_back(s["start"].get<int64_t>(), s["count"].get<int64_t>());
      in_files.push_back(s["file"].get<std::string>());
    }
    sharded::check_tiling(what, name, Dims(t["shape"].get<std::vector<int64_t>>()).numel(), ranges,
                          in_files);
  }
  const json index = {{"format", sharded::kFormat},
                      {"version", sharded::kVersion},
                      {"world_size", world},
                      {"metadata", metadata},
                      {"files", files},
                      {"tensors", tensors}};
  write_file_atomic(index_path, index.dump(1), what);
  std::error_code ec;
  for (int r = 0; r < world; ++r)
    fs::remove(fs::path(tmp_dir) / sharded::shard_name(r, world, ".json"), ec);
}

void commit_sharded_checkpoint(const std::string& tmp_dir, const std::string& dir_arg) {
  const std::string dir = without_trailing_slash(dir_arg);
  const std::string what = "commit_sharded_checkpoint: " + dir;
  std::error_code ec;
  LS_CHECK(fs::is_regular_file(fs::path(tmp_dir) / sharded::kIndexName, ec), what, ": ", tmp_dir,
           " has no ", sharded::kIndexName, "; expected write_sharded_index to have run");
  fsync_directory(tmp_dir, what);
  const std::string parent = parent_directory(dir);
  if (fs::exists(fs::symlink_status(dir, ec))) {
    LS_CHECK(is_sharded_checkpoint(dir), what, ": ", dir,
             " exists and is not a sharded checkpoint (no ", sharded::kIndexName,
             "); it is not replaced: move it away or save elsewhere");
    // Note [Sharded checkpoint], step 3.
    if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_directory(parent, what);
      fs::remove_all(tmp_dir, ec);  // now the older checkpoint
    } else {
      const int err = errno;
      LS_CHECK(err == EINVAL || err == ENOSYS || err == ENOTSUP, what, ": exchanging ", tmp_dir,
               " with ", dir, " failed: ", errno_text(err));
      const std::string token =
          tmp_dir.substr(tmp_dir.rfind(sharded::kTempInfix) + std::strlen(sharded::kTempInfix));
      const std::string aside = dir + kOldInfix + token;
      LS_SYSCHECK_MSG(::rename(dir.c_str(), aside.c_str()), what, ": renaming ", dir, " to ",
                      aside);
      LS_SYSCHECK_MSG(::rename(tmp_dir.c_str(), dir.c_str()), what, ": renaming ", tmp_dir, " to ",
                      dir);
      fsync_directory(parent, what);
      fs::remove_all(aside, ec);
    }
  } else {
    LS_SYSCHECK_MSG(::rename(tmp_dir.c_str(), dir.c_str()), what, ": renaming ", tmp_dir, " to ",
                    dir);
    fsync_directory(parent, what);
  }
  remove_stale_directories(dir);
}

void save_sharded_checkpoint(const std::string& dir,
                             const std::vector<std::vector<TensorSlice>>& shards,
                             const TrainingCheckpoint& meta) {
  LS_CHECK(!shards.empty(), "save_sharded_checkpoint: ", dir, ": expected at least one shard");
  const std::string tmp = sharded_temp_dir(dir, new_sharded_token());
  const int world = static_cast<int>(shards.size());
  try {
    for (int r = 0; r < world; ++r) write_checkpoint_shard(tmp, r, world, shards[r]);
    write_sharded_index(tmp, world, meta);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  commit_sharded_checkpoint(tmp, dir);
}

}  // namespace lockstep::io
