// safetensors files: the tensor container the Python ecosystem loads with
// safetensors.torch.load_file. Layout: 8-byte little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}), then the raw data.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/tensor/tensor.h"

namespace lockstep::io {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using Metadata = std::map<std::string, std::string>;

struct SafetensorsContents {
  NamedTensors tensors;  // in file order (by data offset)
  Metadata metadata;
};

struct SafetensorsLoadOptions {
  // Files of at least this many bytes are memory-mapped (copy-on-write) and their suitably aligned
  // tensors point into the mapping; smaller files are read into memory and copied out.
  size_t mmap_min_bytes = size_t{1} << 20;
};

// Writes to a temporary file beside `path`, fsyncs it, renames it into place and fsyncs the
// directory, so a crash never leaves a half-written file under `path`. Names must be unique;
// tensors are written contiguous, little-endian, in the given order.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata = {});

// Reads and validates the whole file: header length, JSON (no duplicate keys), entry fields and
// dtypes, shapes against byte ranges, ranges inside the data and covering it without gaps or
// overlaps, BOOL bytes 0 or 1. Any problem is an Error that names the file, what was expected and
// what was found. A tensor that points into a memory-mapped file keeps the mapping alive; writing
// to it never changes the file.
SafetensorsContents load_safetensors(const std::string& path,
                                     const SafetensorsLoadOptions& opts = {});

// Only the header's __metadata__, validated as load_safetensors validates the header, without
// reading the data (a checkpoint's step, its digest).
Metadata load_safetensors_metadata(const std::string& path);

// The safetensors dtype string ("F32", "BF16", ...) for a DType, and back.
std::string safetensors_dtype(DType t);
DType parse_safetensors_dtype(const std::string& s);

}  // namespace lockstep::io
