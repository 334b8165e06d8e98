// An independent safetensors writer for the tests: builds files byte by byte, the JSON header
// written as text by hand, so that load_safetensors is tested without save_safetensors or
// nlohmann-json. Also a per-test temporary directory.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "testing.h"

namespace lockstep::testing::st {

// A tensor as the format stores it: dtype string, shape, raw little-endian bytes.
struct RefTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// The raw bytes of `values` (the test machines are little-endian, like the format).
template <typename T>
std::string bytes_of(const std::vector<T>& values) {
  std::string out(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

inline std::string le64(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out;
}

// A JSON string literal; escapes what JSON requires (quote, backslash, control characters).
inline std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The header text for `tensors` stored back to back in the given order.
inline std::string header_of(const std::vector<RefTensor>& tensors,
                             const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::string h = "{";
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i)
      h += (i ? "," : "") + quote(metadata[i].first) + ":" + quote(metadata[i].second);
    h += "}";
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const RefTensor& t = tensors[i];
    h += (i || !metadata.empty() ? ", " : "") + quote(t.name) + ": {\"dtype\": " + quote(t.dtype) +
         ", \"shape\": [";
    for (size_t d = 0; d < t.shape.size(); ++d) h += (d ? ", " : "") + std::to_string(t.shape[d]);
    h += "], \"data_offsets\": [" + std::to_string(offset) + ", " +
         std::to_string(offset + t.bytes.size()) + "]}";
    offset += t.bytes.size();
  }
  return h + "}";
}

// A whole file: length, header (space-padded so the data starts at a multiple of `align`), data.
inline std::string file_of(const std::vector<RefTensor>& tensors,
                           const std::vector<std::pair<std::string, std::string>>& metadata = {},
                           size_t align = 8) {
  std::string h = header_of(tensors, metadata);
  while ((8 + h.size()) % align) h += ' ';
  std::string out = le64(h.size()) + h;
  for (const RefTensor& t : tensors) out += t.bytes;
  return out;
}

// A file with the given header text and data bytes.
inline std::string file_with(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

inline std::string read_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline void write_file(const std::string& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "writing " << p;
}

// A fresh directory per test (tests/testing.h).
using ::lockstep::testing::TempDir;

}  // namespace lockstep::testing::st
