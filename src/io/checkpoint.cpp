// Training checkpoints on top of safetensors: naming, metadata, SHA-256, periodic files.
#include "lockstep/io/checkpoint.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "io/checkpoint_checks.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/syscall.h"

namespace lockstep::io {

// Note [Checkpoint layout]
// One safetensors file, so that Python's safetensors.torch.load_file reads it as it is:
//   tensors   "model.<name>"             the module's state_dict (parameters and buffers)
//             "optim.<param>.<field>"    optimizer state per parameter (<param> is the name
//                                         when the caller gave names, else the index)
//             "optim.step", "optim.group.<g>.lr"
//   metadata  "format": "pt", "lockstep.checkpoint": "1",
//             "step", "epoch", "epoch_samples", "world_size" (decimal),
//             "scaler.<key>" (%.17g: doubles round-trip exactly),
//             "rng.<name>": "<seed> <offset>", "user.<key>",
//             "optim.param_names": JSON array of the names <param> stands for,
//             "sha256": hex SHA-256 of the data section (all tensor bytes in file order).
// Nothing time-dependent is stored: two runs that reach the same state write the same bytes,
// which is what the exact-resume tests compare.

namespace {

constexpr const char* kFormatKey = "lockstep.checkpoint";
constexpr const char* kFormatVersion = "1";
constexpr const char* kStepSuffix = ".step";
constexpr int kStepDigits = 8;

using json = nlohmann::json;

// Note [No NaN in a checkpoint]
// A run that diverged (a learning rate too large, say) has NaN or Inf in its parameters, and
// every checkpoint it writes from then on would hold them; `--resume auto` would then pick the
// newest, and the run could never get back. So a checkpoint never holds a non-finite value:
// save_checkpoint refuses to write one (the previous files stay as they were, and every rank of
// a distributed save fails with the message), and load_checkpoint refuses to read one (a file
// written before this check), which makes latest_valid_checkpoint pass it over and say why.
// Every floating tensor counts, buffers included: a model that keeps -inf in a buffer on
// purpose (a mask) should compute it rather than store it.

// Non-finite values of a floating tensor on the host, contiguous, by their bits: all exponent
// bits set (an Inf when the mantissa is zero, else a NaN). A plain loop, not an op: a checkpoint
// may be written by a process forked from a multithreaded one, where a thread pool would hang.
template <typename Bits>
void count_non_finite(const void* data, int64_t n, Bits exponent, Bits mantissa, int64_t* bad,
                      int64_t* nan) {
  const auto* v = static_cast<const Bits*>(data);
  for (int64_t i = 0; i < n; ++i) {
    if ((v[i] & exponent) != exponent) continue;
    ++*bad;
    if ((v[i] & mantissa) != 0) ++*nan;
  }
}

std::string format_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

template <typename T>
T parse_number(const std::string& path, const std::string& key, const std::string& s) {
  T v{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  LS_CHECK(ec == std::errc() && end == s.data() + s.size(), "load_checkpoint: ", path,
           ": metadata '", key, "' should be a number, found '", s, "'");
  return v;
}

double parse_double(const std::string& path, const std::string& key, const std::string& s) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  LS_CHECK(!s.empty() && end == s.c_str() + s.size() && errno == 0, "load_checkpoint: ", path,
           ": metadata '", key, "' should be a number, found '", s, "'");
  return v;
}

// "<index>.<field>" of Optimizer::state_dict, or -1 for its other entries ("step", "group.*").
int64_t param_index(const std::string& key, std::string* field) {
  const size_t dot = key.find('.');
  if (dot == std::string::npos || dot == 0) return -1;
  int64_t index = -1;
  const auto [end, ec] = std::from_chars(key.data(), key.data() + dot, index);
  if (ec != std::errc() || end != key.data() + dot) return -1;
  *field = key.substr(dot + 1);
  return index;
}

bool is_reserved_optim_key(const std::string& key) {
  return key == "step" || key.rfind("group.", 0) == 0;
}

// The metadata, canonical (sorted by key, NUL-separated), less the digest itself: hashed before
// the data, so a corrupt step or epoch in the header is caught like corrupt weights.
void hash_metadata(Sha256& sha, const Metadata& meta) {
  for (const auto& [k, v] : meta) {
    if (k == "sha256") continue;
    sha.update(k.data(), k.size() + 1);  // with the terminating NUL
    sha.update(v.data(), v.size() + 1);
  }
}

// Calls fn(entry) for each entry of `dir`; unreadable directories and entries are skipped
// (a range-for over directory_iterator would throw from operator++).
void for_each_entry(const std::filesystem::path& dir,
                    const std::function<void(const std::filesystem::directory_entry&)>& fn) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) fn(*it);
}

// The step of a periodic checkpoint's file name "<stem>.step<digits>[.<ext>]" and the file name
// of its series "<stem>[.<ext>]", or -1.
int64_t periodic_step(const std::string& name, std::string* series_name) {
  for (size_t at = name.rfind(kStepSuffix); at != std::string::npos && at > 0;
       at = name.rfind(kStepSuffix, at - 1)) {
    const size_t first = at + std::strlen(kStepSuffix);
    size_t last = first;
    while (last < name.size() && std::isdigit(static_cast<unsigned char>(name[last]))) ++last;
    if (last == first || (last < name.size() && name[last] != '.')) continue;
    int64_t step = -1;
    const auto [end, ec] = std::from_chars(name.data() + first, name.data() + last, step);
    if (ec != std::errc() || end != name.data() + last) continue;
    if (series_name) *series_name = name.substr(0, at) + name.substr(last);
    return step;
  }
  return -1;
}

std::filesystem::path parent_dir(const std::string& base) {
  std::filesystem::path dir = std::filesystem::path(base).parent_path();
  return dir.empty() ? std::filesystem::path(".") : dir;
}

}  // namespace

std::string non_finite_values(const Tensor& t) {
  int64_t bad = 0, nan = 0;
  const int64_t n = t.numel();
  switch (t.dtype()) {
    case kFloat64:
      count_non_finite<uint64_t>(t.data_ptr(), n, 0x7ff0000000000000ull, 0x000fffffffffffffull,
                                 &bad, &nan);
      break;
    case kFloat32:
      count_non_finite<uint32_t>(t.data_ptr(), n, 0x7f800000u, 0x007fffffu, &bad, &nan);
      break;
    case kBFloat16:
      count_non_finite<uint16_t>(t.data_ptr(), n, 0x7f80, 0x007f, &bad, &nan);
      break;
    case kFloat16:
      count_non_finite<uint16_t>(t.data_ptr(), n, 0x7c00, 0x03ff, &bad, &nan);
      break;
    default:
      LS_CHECK(!is_floating(t.dtype()), "checkpoint: no finiteness check for dtype ",
               dtype_name(t.dtype()));
  }
  if (bad == 0) return "";
  return std::to_string(bad) + " of its " + std::to_string(n) + " values are not finite (" +
         std::to_string(nan) + " NaN, " + std::to_string(bad - nan) + " Inf)";
}

SafetensorsContents checkpoint_contents(const TrainingCheckpoint& ckpt) {
  autograd::NoGradGuard no_grad;
  NamedTensors tensors;
  tensors.reserve(ckpt.model.size() + ckpt.optimizer.size());
  for (const auto& [name, t] : ckpt.model) tensors.emplace_back("model." + name, t);
  const auto& names = ckpt.optimizer_param_names;
  for (const auto& [key, t] : ckpt.optimizer) {
    std::string field;
    const int64_t index = param_index(key, &field);
    if (index >= 0 && !names.empty()) {
      LS_CHECK(index < static_cast<int64_t>(names.size()), "save_checkpoint: optimizer state '",
               key, "' is for parameter ", index, " but optimizer_param_names has ", names.size(),
               " names");
      tensors.emplace_back("optim." + names[index] + "." + field, t);
    } else {
      tensors.emplace_back("optim." + key, t);
    }
  }
  for (const std::string& n : names)
    LS_CHECK(!n.empty() && !is_reserved_optim_key(n), "save_checkpoint: parameter name '", n,
             "' cannot name optimizer state ('step' and 'group.*' are reserved)");

  Metadata meta;
  meta["format"] = "pt";
  meta[kFormatKey] = kFormatVersion;
  meta["step"] = std::to_string(ckpt.step);
  meta["epoch"] = std::to_string(ckpt.epoch);
  meta["epoch_samples"] = std::to_string(ckpt.epoch_samples);
  meta["world_size"] = std::to_string(ckpt.world_size);
  for (const auto& [k, v] : ckpt.scaler) meta["scaler." + k] = format_double(v);
  for (const auto& [k, g] : ckpt.rng)
    meta["rng." + k] = std::to_string(g.seed) + " " + std::to_string(g.offset);
  for (const auto& [k, v] : ckpt.user) meta["user." + k] = v;
  if (!names.empty()) meta["optim.param_names"] = json(names).dump();

  // The data section is these tensors' bytes, contiguous, in this order (save_safetensors).
  Sha256 sha;
  hash_metadata(sha, meta);
  for (auto& [name, t] : tensors) {
    LS_CHECK(t.defined(), "save_checkpoint: tensor '", name, "' is undefined");
    t = t.to(kCPU).contiguous();
    const std::string bad = non_finite_values(t);
    LS_CHECK(bad.empty(), "save_checkpoint: step ", ckpt.step, ": tensor '", name, "': ", bad,
             "; the training has diverged, and a checkpoint holding NaN or Inf is not written "
             "(the checkpoints already written are left as they are)");
    sha.update(t.data_ptr(), static_cast<size_t>(t.nbytes()));
  }
  meta["sha256"] = sha.hex();
  return {std::move(tensors), std::move(meta)};
}

void save_checkpoint(const std::string& path, const TrainingCheckpoint& ckpt) {
  SafetensorsContents c = checkpoint_contents(ckpt);
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
    std::filesystem::create_directories(dir, ec);
    LS_CHECK(!ec, "save_checkpoint: cannot create the directory ", dir.string(), " for ", path,
             ": ", ec.message());
  }
  save_safetensors(path, c.tensors, c.metadata);
}

TrainingCheckpoint load_checkpoint(const std::string& path) {
  return checkpoint_from_contents(load_safetensors(path), path);
}

TrainingCheckpoint checkpoint_from_contents(SafetensorsContents c, const std::string& path) {
  const Metadata& meta = c.metadata;
  auto get = [&](const std::string& key) -> const std::string& {
    auto it = meta.find(key);
    LS_CHECK(it != meta.end(), "load_checkpoint: ", path, " has no metadata '", key,
             "'; it is not a lockstep training checkpoint (a file of model weights only loads "
             "with load_safetensors)");
    return it->second;
  };
  LS_CHECK(get(kFormatKey) == kFormatVersion, "load_checkpoint: ", path,
           ": checkpoint format version ", get(kFormatKey), ", this build reads version ",
           kFormatVersion);
  Sha256 sha;
  hash_metadata(sha, meta);
  for (const auto& [name, t] : c.tensors) sha.update(t.data_ptr(), static_cast<size_t>(t.nbytes()));
  const std::string digest = sha.hex();
  LS_CHECK(digest == get("sha256"), "load_checkpoint: ", path,
           ": the data is corrupt: its SHA-256 is ", digest, " but the header recorded ",
           get("sha256"));
  for (const auto& [name, t] : c.tensors) {
    const std::string bad = non_finite_values(t);
    LS_CHECK(bad.empty(), "load_checkpoint: ", path, ": tensor '", name, "': ", bad,
             "; the run that wrote it had diverged, and it cannot be resumed from");
  }

  TrainingCheckpoint ckpt;
  ckpt.step = parse_number<int64_t>(path, "step", get("step"));
  ckpt.epoch = parse_number<int64_t>(path, "epoch", get("epoch"));
  ckpt.epoch_samples = parse_number<int64_t>(path, "epoch_samples", get("epoch_samples"));
  ckpt.world_size = parse_number<int64_t>(path, "world_size", get("world_size"));
  if (auto it = meta.find("optim.param_names"); it != meta.end()) {
    try {
      ckpt.optimizer_param_names = json::parse(it->second).get<std::vector<std::string>>();
    } catch (const json::exception& e) {
      LS_THROW("load_checkpoint: ", path,
               ": metadata 'optim.param_names' is not a JSON list of "
               "strings (",
               e.what(), ")");
    }
  }
  std::map<std::string, int64_t> index_of;
  for (size_t i = 0; i < ckpt.optimizer_param_names.size(); ++i)
    index_of[ckpt.optimizer_param_names[i]] = static_cast<int64_t>(i);
  for (const auto& [k, v] : meta) {
    if (k.rfind("scaler.", 0) == 0) {
      ckpt.scaler[k.substr(7)] = parse_double(path, k, v);
    } else if (k.rfind("rng.", 0) == 0) {
      const size_t space = v.find(' ');
      LS_CHECK(space != std::string::npos, "load_checkpoint: ", path, ": metadata '", k,
               "' should be '<seed> <offset>', found '", v, "'");
      ckpt.rng[k.substr(4)] = {parse_number<uint64_t>(path, k, v.substr(0, space)),
                               parse_number<uint64_t>(path, k, v.substr(space + 1))};
    } else if (k.rfind("user.", 0) == 0) {
      ckpt.user[k.substr(5)] = v;
    }
  }
  for (auto& [name, t] : c.tensors) {
    if (name.rfind("model.", 0) == 0) {
      ckpt.model.emplace_back(name.substr(6), t);
      continue;
    }
    LS_CHECK(name.rfind("optim.", 0) == 0, "load_checkpoint: ", path, ": tensor '", name,
             "' is neither model.* nor optim.*");
    std::string key = name.substr(6);
    if (!index_of.empty() && !is_reserved_optim_key(key)) {
      const size_t dot = key.rfind('.');
      auto it = dot == std::string::npos ? index_of.end() : index_of.find(key.substr(0, dot));
      LS_CHECK(it != index_of.end(), "load_checkpoint: ", path, ": optimizer state '", name,
               "' names no parameter of optim.param_names");
      key = std::to_string(it->second) + key.substr(dot);
    }
    ckpt.optimizer.emplace_back(std::move(key), t);
  }
  return ckpt;
}

std::string checkpoint_path_for_step(const std::string& base, int64_t step) {
  LS_CHECK(step >= 0, "checkpoint_path_for_step: step must be >= 0, got ", step);
  const std::filesystem::path p(base);
  char digits[32];
  std::snprintf(digits, sizeof digits, "%0*lld", kStepDigits, static_cast<long long>(step));
  return (p.parent_path() / (p.stem().string() + kStepSuffix + digits + p.extension().string()))
      .string();
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& base) {
  const std::filesystem::path p(base);
  const std::string base_name = p.filename().string();
  std::vector<std::pair<int64_t, std::string>> out;
  for_each_entry(parent_dir(base), [&](const std::filesystem::directory_entry& e) {
    const std::string name = e.path().filename().string();
    std::string series;
    const int64_t step = periodic_step(name, &series);
    if (step >= 0 && series == base_name) out.emplace_back(step, (p.parent_path() / name).string());
  });
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// The metadata `key` of a lockstep checkpoint, reading only the header (a large checkpoint is
// not read to learn its step); "" if `path` is not a readable lockstep checkpoint.
std::string header_value(const std::string& path, const char* key) {
  try {
    const Metadata meta = load_safetensors_metadata(path);
    auto it = meta.find(key);
    return meta.count(kFormatKey) && it != meta.end() ? it->second : "";
  } catch (const Error&) {
    return "";
  }
}

}  // namespace

int64_t checkpoint_step(const std::string& path) {
  const std::string s = header_value(path, "step");
  int64_t step = -1;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), step);
  return !s.empty() && ec == std::errc() && end == s.data() + s.size() ? step : -1;
}

std::string checkpoint_digest(const std::string& path) { return header_value(path, "sha256"); }

std::string latest_checkpoint(const std::string& base) {
  std::string best;
  int64_t best_step = -1;
  // A periodic file's name is its step; `base` (the end-of-run checkpoint) says it in its header.
  for (const auto& [step, path] : list_checkpoints(base)) {
    if (step > best_step) best_step = step, best = path;
  }
  std::error_code ec;
  if (std::filesystem::exists(base, ec)) {
    const int64_t step = checkpoint_step(base);
    if (step >= 0 && step >= best_step) best_step = step, best = base;
  }
  return best;
}

std::string checkpoint_problem(const std::string& path) {
  try {
    load_checkpoint(path);
    return "";
  } catch (const Error& e) {
    return e.message();
  } catch (const std::exception& e) {
    return e.what()[0] ? e.what() : "unknown error";
  }
}

CheckpointChoice latest_valid_checkpoint(const std::string& base) {
  // Newest first: periodic files by the step in their names, `base` by the step in its header
  // (before a periodic file of its step, as in latest_checkpoint).
  std::vector<std::pair<int64_t, std::string>> candidates = list_checkpoints(base);
  std::reverse(candidates.begin(), candidates.end());
  std::error_code ec;
  if (std::filesystem::exists(base, ec)) {
    const int64_t step = checkpoint_step(base);
    auto at = std::find_if(candidates.begin(), candidates.end(),
                           [&](const auto& c) { return step >= 0 && c.first <= step; });
    candidates.insert(step < 0 ? candidates.begin() : at, {step, base});
  }
  CheckpointChoice choice;
  for (const auto& [step, path] : candidates) {
    std::string reason = checkpoint_problem(path);
    if (reason.empty()) {
      choice.path = path;
      break;
    }
    choice.skipped.push_back({path, std::move(reason)});
  }
  return choice;
}

std::string checkpoint_path_problem(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty()) return "the path is empty";
  if (fs::is_directory(path, ec)) return path + " is a directory, not a file";
  const fs::path dir = parent_dir(path);
  if (!fs::is_directory(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) return "cannot create the directory " + dir.string() + ": " + ec.message();
  }
  // The check a write would make first: a new file in that directory (the atomic save creates
  // its temporary file there), removed again at once.
  const fs::path probe =
      dir / (fs::path(path).filename().string() + ".writable." + std::to_string(::getpid()));
  Fd fd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) return "cannot create a file in " + dir.string() + ": " + errno_text(errno);
  fd.reset();
  ::unlink(probe.c_str());
  return "";
}

std::string checkpoint_series(const std::string& path) {
  const std::filesystem::path p(path);
  std::string series;
  if (periodic_step(p.filename().string(), &series) < 0) return path;
  return (p.parent_path() / series).string();
}

std::vector<std::string> prune_checkpoints(const std::string& path, int64_t keep,
                                           const std::vector<std::string>& spare) {
  LS_CHECK(keep >= 0, "prune_checkpoints: keep must be >= 0, got ", keep);
  const std::string base = checkpoint_series(path);
  const std::string base_name = std::filesystem::path(base).filename().string();
  // Files of later steps than `path` are not this run's past (another run's, or the future a
  // resumed run is about to rewrite): they are left alone.
  const int64_t upto = periodic_step(std::filesystem::path(path).filename().string(), nullptr);
  std::vector<std::string> removed;
  std::error_code ec;
  if (keep > 0) {
    auto all = list_checkpoints(base);
    const auto spared = [&](const std::string& p) {
      return std::find(spare.begin(), spare.end(), p) != spare.end();
    };
    all.erase(std::remove_if(
                  all.begin(), all.end(),
                  [&](const auto& c) { return (upto >= 0 && c.first > upto) || spared(c.second); }),
              all.end());
    for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
      if (std::filesystem::remove(all[i].second, ec)) removed.push_back(all[i].second);
    }
  }
  // Temporary files "<file>.tmp.<pid>[.<n>]" of this series' writers killed mid-write
  // (save_safetensors); a writer is alive while its pid is (on this machine).
  for_each_entry(parent_dir(base), [&](const std::filesystem::directory_entry& e) {
    const std::string name = e.path().filename().string();
    const size_t tmp = name.rfind(".tmp.");
    if (tmp == std::string::npos) return;
    std::string series = name.substr(0, tmp);
    if (series != base_name) {
      if (periodic_step(series, &series) < 0 || series != base_name) return;
    }
    int pid = 0;
    const std::string rest = name.substr(tmp + 5);
    const std::string digits = rest.substr(0, rest.find('.'));
    const auto [end, perr] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
    if (perr != std::errc() || end != digits.data() + digits.size() || pid <= 0) return;
    if (::kill(pid, 0) == 0 || errno != ESRCH) return;  // its writer still runs
    if (std::filesystem::remove(e.path(), ec)) removed.push_back(e.path().string());
  });
  return removed;
}

}  // namespace lockstep::io
