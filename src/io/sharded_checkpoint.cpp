// Reading sharded checkpoints (the index, ranges by pread, verification), consolidation into one
// file, and sharded checkpoints as a series (resume, pruning). Note [Sharded checkpoint] in
// sharded_checkpoint_write.cpp has the format.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/checkpoint_checks.h"
#include "io/sharded_format.h"
#include "lockstep/base/syscall.h"
#include "lockstep/io/sharded_checkpoint.h"

namespace lockstep::io {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace sharded {

namespace {
constexpr size_t kLengthBytes = 8;
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // as load_safetensors
constexpr size_t kVerifyChunk = size_t{4} << 20;
}  // namespace

std::string shard_name(int rank, int world, const char* ext) {
  return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ext;
}

std::string slice_key(const std::string& name, int64_t start) {
  return name + "@" + std::to_string(start);
}

void pread_all(int fd, void* out, size_t n, int64_t offset, const std::string& path) {
  char* p = static_cast<char*>(out);
  size_t done = 0;
  while (done < n) {
    const ssize_t r =
        LS_SYSCHECK_MSG(retry_on_eintr([&] {
                          return ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
                        }),
                        "sharded checkpoint: reading ", path);
    LS_CHECK(r > 0, "sharded checkpoint: ", path, " ends at byte ", offset + done, ", expected ", n,
             " bytes from byte ", offset, " (the file is truncated)");
    done += static_cast<size_t>(r);
  }
}

Header read_header(int fd, const std::string& path, const std::string& where) {
  unsigned char len_le[kLengthBytes];
  pread_all(fd, len_le, kLengthBytes, 0, path);
  uint64_t n = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) n |= static_cast<uint64_t>(len_le[i]) << (8 * i);
  LS_CHECK(n <= kMaxHeaderBytes, where, path, ": header length ", n,
           " is not plausible (expected a safetensors file)");
  std::string text(n, '\0');
  pread_all(fd, text.data(), n, kLengthBytes, path);
  Header h;
  h.bytes = static_cast<int64_t>(kLengthBytes + n);
  try {
    const json j = json::parse(text);
    for (const auto& [key, v] : j.items()) {
      if (key == "__metadata__") continue;
      HeaderEntry e;
      e.dtype = parse_safetensors_dtype(v.at("dtype").get<std::string>());
      e.shape = v.at("shape").get<std::vector<int64_t>>();
      e.begin = h.bytes + v.at("data_offsets").at(0).get<int64_t>();
      e.end = h.bytes + v.at("data_offsets").at(1).get<int64_t>();
      h.entries[key] = std::move(e);
    }
  } catch (const nlohmann::json::exception& e) {
    LS_THROW(where, path, ": the safetensors header does not parse (", e.what(), ")");
  }
  return h;
}

void check_tiling(const std::string& where, const std::string& name, int64_t numel,
                  const std::vector<std::pair<int64_t, int64_t>>& ranges,
                  const std::vector<std::string>& files) {
  int64_t covered = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const auto [start, count] = ranges[i];
    LS_CHECK(count >= 0 && start >= 0 && start + count <= numel, where, ": tensor '", name,
             "': the slice in ", files[i], " holds elements [", start, ", ", start + count,
             "), outside [0, ", numel, ")");
    if (count == 0) continue;
    LS_CHECK(start <= covered, where, ": tensor '", name, "': no slice holds elements [", covered,
             ", ", start, ") (a gap before the slice in ", files[i], ")");
    LS_CHECK(start >= covered, where, ": tensor '", name, "': elements [", start, ", ",
             std::min(covered, start + count), ") are in two slices (an overlap: the slice in ",
             files[i], " starts at ", start, ")");
    covered = start + count;
  }
  LS_CHECK(covered == numel, where, ": tensor '", name, "': no slice holds elements [", covered,
           ", ", numel, ") (expected slices covering all ", numel, " elements)");
}

}  // namespace sharded

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LS_CHECK(in.good(), "sharded checkpoint: cannot open ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Fd open_file(const std::string& path) {
  return Fd(LS_SYSCHECK_MSG(::open(path.c_str(), O_RDONLY | O_CLOEXEC),
                            "sharded checkpoint: cannot open ", path));
}

}  // namespace

ShardedCheckpointReader::ShardedCheckpointReader(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  LS_CHECK(fs::is_directory(dir, ec), "sharded checkpoint ", dir,
           ": no such directory (expected a directory holding ", sharded::kIndexName, ")");
  const std::string index_path = (fs::path(dir) / sharded::kIndexName).string();
  LS_CHECK(fs::is_regular_file(index_path, ec), "sharded checkpoint ", dir, ": no ",
           sharded::kIndexName,
           " in it; the index is written last, so this is no complete sharded checkpoint");
  const std::string where = "sharded checkpoint " + index_path;
  json index;
  try {
    index = json::parse(read_text(index_path));
  } catch (const json::exception& e) {
    LS_THROW(where, ": not valid JSON (", e.what(), ")");
  }
  try {
    LS_CHECK(index.is_object() && index.value("format", "") == sharded::kFormat, where,
             ": expected \"format\": \"", sharded::kFormat, "\"");
    const int version = index.at("version").get<int>();
    LS_CHECK(version == sharded::kVersion, where, ": format version ", version,
             ", this build reads version ", sharded::kVersion);
    world_size_ = index.at("world_size").get<int64_t>();
    meta_ = checkpoint_from_contents({{}, index.at("metadata").get<Metadata>()}, index_path);

    std::map<std::string, size_t> file_at;
    for (const json& f : index.at("files")) {
      File file{f.at("name").get<std::string>(), f.at("size").get<int64_t>(),
                f.at("sha256").get<std::string>()};
      LS_CHECK(!file.name.empty() && file.name.find('/') == std::string::npos, where,
               ": file name '", file.name, "' should be a plain name inside the directory");
      const std::string path = path_of(file);
      struct stat st {};
      LS_CHECK(::stat(path.c_str(), &st) == 0, "sharded checkpoint ", dir, ": the index names ",
               path, ", which cannot be read: ", errno_text(errno));
      LS_CHECK(st.st_size == file.size, "sharded checkpoint ", dir, ": ", path, " is ", st.st_size,
               " bytes, the index expects ", file.size,
               (st.st_size < file.size ? " (the file is truncated)" : " (the file was changed)"));
      file_at[file.name] = files_.size();
      files_.push_back(std::move(file));
    }
    for (const auto& [name, t] : index.at("tensors").items()) {
      ShardedTensorInfo info{name, Dims(t.at("shape").get<std::vector<int64_t>>()),
                             parse_safetensors_dtype(t.at("dtype").get<std::string>())};
      const int64_t esize = dtype_size(info.dtype);
      std::vector<Slice> slices;
      std::vector<std::pair<int64_t, int64_t>> ranges;
      std::vector<std::string> names;
      for (const json& s : t.at("slices")) {
        const std::string file = s.at("file").get<std::string>();
        auto it = file_at.find(file);
        LS_CHECK(it != file_at.end(), where, ": tensor '", name, "' has a slice in ", file,
                 ", which is not among the index's files");
        Slice slice{s.at("start").get<int64_t>(), s.at("count").get<int64_t>(), it->second,
                    s.at("offset").get<int64_t>()};
        const int64_t length = s.at("length").get<int64_t>();
        LS_CHECK(length == slice.count * esize, where, ": tensor '", name, "': its slice in ", file,
                 " is ", length, " bytes, expected ", slice.count, " elements of ",
                 safetensors_dtype(info.dtype), " = ", slice.count * esize, " bytes");
        LS_CHECK(slice.offset >= 0 && slice.offset + length <= files_[it->second].size, where,
                 ": tensor '", name, "': its slice in ", file, " is at bytes [", slice.offset, ", ",
                 slice.offset + length, "), beyond the file's ", files_[it->second].size);
        slices.push_back(slice);
      }
      std::sort(slices.begin(), slices.end(),
                [](const Slice& a, const Slice& b) { return a.start < b.start; });
      for (const Slice& s : slices) {
        ranges.emplace_back(s.start, s.count);
        names.push_back(files_[s.file].name);
      }
      sharded::check_tiling(where, name, info.numel(), ranges, names);
      slices.erase(
          std::remove_if(slices.begin(), slices.end(), [](const Slice& s) { return s.count == 0; }),
          slices.end());
      tensors_.push_back(std::move(info));
      slices_.push_back(std::move(slices));
    }
  } catch (const json::exception& e) {
    LS_THROW(where, ": not a sharded checkpoint index (", e.what(), ")");
  }
}

std::string ShardedCheckpointReader::path_of(const File& f) const {
  return (fs::path(dir_) / f.name).string();
}

size_t ShardedCheckpointReader::index_of(const std::string& name) const {
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (tensors_[i].name == name) return i;
  std::string some;
  for (size_t i = 0; i < tensors_.size() && i < 5; ++i) some += (i ? ", " : "") + tensors_[i].name;
  LS_THROW("sharded checkpoint ", dir_, ": no tensor '", name, "' (it holds ", tensors_.size(),
           " tensors: ", some, tensors_.size() > 5 ? ", ..." : "", ")");
}

bool ShardedCheckpointReader::contains(const std::string& name) const {
  return std::any_of(tensors_.begin(), tensors_.end(),
                     [&](const ShardedTensorInfo& t) { return t.name == name; });
}

const ShardedTensorInfo& ShardedCheckpointReader::info(const std::string& name) const {
  return tensors_[index_of(name)];
}

Tensor ShardedCheckpointReader::read(const std::string& name, int64_t start, int64_t count) const {
  const size_t i = index_of(name);
  const ShardedTensorInfo& t = tensors_[i];
  LS_CHECK(start >= 0 && count >= 0 && start + count <= t.numel(), "sharded checkpoint ", dir_,
           ": elements [", start, ", ", start + count, ") of '", name,
           "' are out of range: expected a range inside [0, ", t.numel(), ") (shape ",
           t.shape.str(), ")");
  Tensor out = empty({count}, t.dtype);
  auto* bytes = static_cast<char*>(out.data_ptr());
  const int64_t esize = dtype_size(t.dtype);
  const int64_t end = start + count;
  const std::vector<Slice>& slices = slices_[i];
  // The last slice starting at or before `start`, then on while slices begin before `end`.
  auto it = std::upper_bound(slices.begin(), slices.end(), start,
                             [](int64_t v, const Slice& s) { return v < s.start; });
  if (it != slices.begin()) --it;
  size_t open_file_index = files_.size();
  Fd fd;
  for (; it != slices.end() && it->start < end && count > 0; ++it) {
    const int64_t lo = std::max(start, it->start), hi = std::min(end, it->start + it->count);
    if (lo >= hi) continue;
    const std::string path = path_of(files_[it->file]);
    if (it->file != open_file_index) {
      fd = open_file(path);
      open_file_index = it->file;
    }
    sharded::pread_all(fd.get(), bytes + (lo - start) * esize,
                       static_cast<size_t>((hi - lo) * esize),
                       it->offset + (lo - it->start) * esize, path);
  }
  return out;
}

Tensor ShardedCheckpointReader::read(const std::string& name) const {
  const ShardedTensorInfo& t = info(name);
  return read(name, 0, t.numel()).view(t.shape);
}

TensorSlice ShardedCheckpointReader::read(const SliceRequest& r) const {
  const ShardedTensorInfo& t = info(r.name);
  const int64_t count = r.count < 0 ? t.numel() - r.start : r.count;
  return {r.name, t.shape, r.start, read(r.name, r.start, count)};
}

void ShardedCheckpointReader::verify() const {
  std::vector<char> buf(sharded::kVerifyChunk);
  for (size_t f = 0; f < files_.size(); ++f) {
    const std::string path = path_of(files_[f]);
    Fd fd = open_file(path);
    Sha256 sha;
    for (int64_t at = 0; at < files_[f].size;) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(buf.size(), files_[f].size - at));
      sharded::pread_all(fd.get(), buf.data(), n, at, path);
      sha.update(buf.data(), n);
      at += static_cast<int64_t>(n);
    }
    const std::string digest = sha.hex();
    LS_CHECK(digest == files_[f].sha256, "sharded checkpoint ", dir_, ": ", path,
             " is corrupt: its SHA-256 is ", digest, " but the index recorded ", files_[f].sha256);
    const sharded::Header h = sharded::read_header(fd.get(), path, "sharded checkpoint: ");
    for (size_t i = 0; i < tensors_.size(); ++i) {
      for (const Slice& s : slices_[i]) {
        if (s.file != f) continue;
        const std::string key = sharded::slice_key(tensors_[i].name, s.start);
        auto e = h.entries.find(key);
        LS_CHECK(e != h.entries.end(), "sharded checkpoint ", dir_, ": ", path, " has no '", key,
                 "', which the index places there");
        LS_CHECK(e->second.dtype == tensors_[i].dtype &&
                     e->second.shape == std::vector<int64_t>{s.count} &&
                     e->second.begin == s.offset,
                 "sharded checkpoint ", dir_, ": ", path, ": '", key, "' is ",
                 safetensors_dtype(e->second.dtype), " ", Dims(e->second.shape).str(), " at byte ",
                 e->second.begin, ", the index expects ", safetensors_dtype(tensors_[i].dtype),
                 " [", s.count, "] at byte ", s.offset);
      }
    }
  }
}

void consolidate(const std::string& dir, const std::string& out_path) {
  const ShardedCheckpointReader reader(dir);
  TrainingCheckpoint ckpt = reader.checkpoint();
  for (const ShardedTensorInfo& t : reader.tensors()) {
    const bool model = t.name.rfind("model.", 0) == 0;
    LS_CHECK(model || t.name.rfind("optim.", 0) == 0, "consolidate: ", dir, ": tensor '", t.name,
             "' is neither model.* nor optim.* (Note [Checkpoint layout])");
    (model ? ckpt.model : ckpt.optimizer).emplace_back(t.name.substr(6), reader.read(t.name));
  }
  save_checkpoint(out_path, ckpt);
}

bool is_sharded_checkpoint(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) &&
         fs::is_regular_file(fs::path(path) / sharded::kIndexName, ec);
}

int64_t sharded_checkpoint_step(const std::string& dir) {
  try {
    return ShardedCheckpointReader(dir).checkpoint().step;
  } catch (const std::exception&) {
    return -1;
  }
}

std::string sharded_checkpoint_problem(const std::string& dir) {
  try {
    ShardedCheckpointReader(dir).verify();
    return "";
  } catch (const Error& e) {
    return e.message();
  } catch (const std::exception& e) {
    return e.what()[0] ? e.what() : "unknown error";
  }
}

CheckpointChoice latest_valid_sharded_checkpoint(const std::string& base) {
  // As latest_valid_checkpoint: periodic ones newest first by the step in their names, `base`
  // by the step its index records, before a periodic one of the same step.
  std::vector<std::pair<int64_t, std::string>> candidates;
  for (const auto& c : list_checkpoints(base)) {
    std::error_code ec;
    if (fs::is_directory(c.second, ec)) candidates.push_back(c);
  }
  std::reverse(candidates.begin(), candidates.end());
  std::error_code ec;
  if (fs::is_directory(base, ec)) {
    const int64_t step = sharded_checkpoint_step(base);
    auto at = std::find_if(candidates.begin(), candidates.end(),
                           [&](const auto& c) { return step >= 0 && c.first <= step; });
    candidates.insert(step < 0 ? candidates.begin() : at, {step, base});
  }
  CheckpointChoice choice;
  for (const auto& [step, path] : candidates) {
    std::string reason = sharded_checkpoint_problem(path);
    if (reason.empty()) {
      choice.path = path;
      break;
    }
    choice.skipped.push_back({path, std::move(reason)});
  }
  return choice;
}

std::vector<std::string> prune_sharded_checkpoints(const std::string& dir, int64_t keep,
                                                   const std::vector<std::string>& spare) {
  LS_CHECK(keep >= 0, "prune_sharded_checkpoints: keep must be >= 0, got ", keep);
  std::vector<std::string> removed;
  if (keep == 0) return removed;
  const std::string base = checkpoint_series(dir);
  // Later steps than `dir` are not this run's past (as prune_checkpoints).
  int64_t upto = -1;
  for (const auto& [step, path] : list_checkpoints(base))
    if (fs::path(path).filename() == fs::path(dir).filename()) upto = step;
  std::vector<std::string> mine;
  for (const auto& [step, path] : list_checkpoints(base)) {
    if ((upto >= 0 && step > upto) || !is_sharded_checkpoint(path)) continue;
    if (std::find(spare.begin(), spare.end(), path) != spare.end()) continue;
    mine.push_back(path);
  }
  std::error_code ec;
  for (size_t i = 0; i + static_cast<size_t>(keep) < mine.size(); ++i) {
    if (fs::remove_all(mine[i], ec) > 0 && !ec) removed.push_back(mine[i]);
  }
  return removed;
}

}  // namespace lockstep::io
