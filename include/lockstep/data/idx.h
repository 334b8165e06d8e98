// Reader for IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed.
#pragma once

#include <string>

#include "lockstep/tensor/tensor.h"

namespace lockstep::data {

// Reads an IDX file: magic 0x00 0x00 <type> <ndim>, ndim big-endian u32 sizes, then the data
// big-endian in row-major order. gzip files are recognised by their content, not their name.
// Type codes and the dtype they become: 0x08 u8 -> u8, 0x09 i8 -> i32, 0x0B i16 -> i32,
// 0x0C i32 -> i32, 0x0D f32 -> f32, 0x0E f64 -> f64. The result has the file's dims.
// Throws lockstep::Error naming the file and what was wrong (bad magic, unknown type code,
// truncated header or data, bytes after the data, a broken gzip stream).
Tensor read_idx(const std::string& path);

}  // namespace lockstep::data
