// The on-disk names and checks that the sharded checkpoint's writer and reader share.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "lockstep/tensor/tensor.h"

namespace lockstep::io::sharded {

inline constexpr const char* kIndexName = "index.json";
inline constexpr const char* kFormat = "lockstep.sharded_checkpoint";
inline constexpr int kVersion = 1;
inline constexpr const char* kTempInfix = ".tmp-";  // "<dir>.tmp-<token>"

// "shard-<rank>-of-<world>" + ext (".safetensors", ".json" the marker, ".failed").
std::string shard_name(int rank, int world, const char* ext);
// "<name>@<start>": a slice's key in its shard file.
std::string slice_key(const std::string& name, int64_t start);

// One tensor entry of a safetensors header, offsets from the file's first byte.
struct HeaderEntry {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;
};
struct Header {
  int64_t bytes = 0;  // the 8-byte length and the JSON: where the data starts
  std::map<std::string, HeaderEntry> entries;
};
// Reads and parses the header of the safetensors file at `path` (open as `fd`); errors start with
// `where`.
Header read_header(int fd, const std::string& path, const std::string& where);

// Checks that non-empty ranges (start, count), sorted by start, tile [0, numel) of tensor `name`;
// throws naming the tensor, `where` and the first gap or overlap. `files[i]` names the file of
// range i for the message.
void check_tiling(const std::string& where, const std::string& name, int64_t numel,
                  const std::vector<std::pair<int64_t, int64_t>>& ranges,
                  const std::vector<std::string>& files);

// Reads `n` bytes at `offset` of `fd` into `out`; a short read is a truncated file.
void pread_all(int fd, void* out, size_t n, int64_t offset, const std::string& path);

}  // namespace lockstep::io::sharded
