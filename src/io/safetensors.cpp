// safetensors writer and validating reader (JSON through nlohmann-json).
#include "lockstep/io/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>

#include <fcntl.h>
#include <unistd.h>

#include "lockstep/autograd/grad_mode.h"

namespace lockstep::io {

namespace {

// A header this large is not a tensor index but a corrupt length field.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr size_t kHeaderAlignment = 8;

using json = nlohmann::json;

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    LS_CHECK(w > 0, "save_safetensors: writing ", path, " failed: ", std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

std::string safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
    case DType::b8: return "BOOL";
  }
  return "?";
}

DType parse_safetensors_dtype(const std::string& s) {
  for (DType t : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool})
    if (safetensors_dtype(t) == s) return t;
  LS_THROW("unsupported safetensors dtype '", s, "' (lockstep reads F32, F64, BF16, F16, I32, I64, U8, BOOL)");
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata) {
  autograd::NoGradGuard no_grad;
  json header = json::object();
  std::set<std::string> names;
  std::vector<Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    LS_CHECK(name != "__metadata__" && !name.empty(), "save_safetensors: invalid tensor name '",
             name, "'");
    LS_CHECK(names.insert(name).second, "save_safetensors: duplicate tensor name '", name, "'");
    LS_CHECK(t.defined(), "save_safetensors: tensor '", name, "' is undefined");
    Tensor c = t.to(kCPU).contiguous();
    const uint64_t n = static_cast<uint64_t>(c.nbytes());
    header[name] = {{"dtype", safetensors_dtype(c.dtype())},
                    {"shape", c.shape().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    data.push_back(c);
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h = header.dump();
  // Pad with spaces so the data starts 8-byte aligned, as the reference implementation does.
  while ((h.size() + 8) % kHeaderAlignment) h.push_back(' ');
  uint64_t hlen = h.size();
  unsigned char len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(hlen >> (8 * i));

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LS_CHECK(fd >= 0, "save_safetensors: cannot create ", tmp, ": ", std::strerror(errno));
  try {
    write_all(fd, len_le, 8, tmp);
    write_all(fd, h.data(), h.size(), tmp);
    for (const Tensor& c : data) write_all(fd, c.data_ptr(), static_cast<size_t>(c.nbytes()), tmp);
    LS_CHECK(::fsync(fd) == 0, "save_safetensors: fsync of ", tmp, " failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    LS_THROW("save_safetensors: renaming ", tmp, " to ", path, " failed: ", std::strerror(err));
  }
}

SafetensorsContents load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LS_CHECK(in.good(), "load_safetensors: cannot open ", path, ": ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  LS_CHECK(file_size >= 8, "load_safetensors: ", path, " is ", file_size,
           " bytes, too short for the 8-byte header length");
  unsigned char len_le[8];
  in.read(reinterpret_cast<char*>(len_le), 8);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= static_cast<uint64_t>(len_le[i]) << (8 * i);
  LS_CHECK(hlen <= kMaxHeaderBytes && hlen <= file_size - 8, "load_safetensors: ", path,
           ": header length ", hlen, " is impossible for a file of ", file_size, " bytes");
  std::string h(hlen, '\0');
  in.read(h.data(), static_cast<std::streamsize>(hlen));
  json header;
  try {
    header = json::parse(h);
  } catch (const json::exception& e) {
    LS_THROW("load_safetensors: ", path, ": header is not valid JSON (", e.what(), ")");
  }
  LS_CHECK(header.is_object(), "load_safetensors: ", path, ": header is not a JSON object");

  const uint64_t data_size = file_size - 8 - hlen;
  SafetensorsContents out;
  struct Entry {
    std::string name;
    DType dtype;
    Dims shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m = it.value().begin(); m != it.value().end(); ++m)
          out.metadata[m.key()] = m.value().get<std::string>();
        continue;
      }
      const json& v = it.value();
      Entry e{it.key(), parse_safetensors_dtype(v.at("dtype").get<std::string>()), {}, 0, 0};
      for (const auto& d : v.at("shape")) {
        LS_CHECK(d.get<int64_t>() >= 0, "negative dimension");
        e.shape.push_back(d.get<int64_t>());
      }
      const auto& off = v.at("data_offsets");
      LS_CHECK(off.size() == 2, "data_offsets must have two entries");
      e.begin = off[0].get<uint64_t>();
      e.end = off[1].get<uint64_t>();
      entries.push_back(std::move(e));
    }
  } catch (const json::exception& e) {
    LS_THROW("load_safetensors: ", path, ": malformed header entry (", e.what(), ")");
  } catch (const Error& e) {
    LS_THROW("load_safetensors: ", path, ": ", e.message());
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin < b.begin;
  });
  uint64_t expect = 0;
  for (const Entry& e : entries) {
    uint64_t need = 0;
    try {
      int64_t bytes = 0;
      LS_CHECK(!__builtin_mul_overflow(e.shape.numel(), dtype_size(e.dtype), &bytes),
               "byte size overflows");
      need = static_cast<uint64_t>(bytes);
    } catch (const Error&) {
      LS_THROW("load_safetensors: ", path, ": tensor '", e.name, "' has shape ", e.shape.str(),
               " whose size does not fit in 64 bits (corrupt header?)");
    }
    LS_CHECK(e.end >= e.begin && e.end - e.begin == need, "load_safetensors: ", path, ": tensor '",
             e.name, "' of dtype ", safetensors_dtype(e.dtype), " and shape ", e.shape.str(),
             " needs ", need, " bytes but its data_offsets [", e.begin, ", ", e.end, "] hold ",
             e.end - e.begin);
    LS_CHECK(e.begin == expect, "load_safetensors: ", path, ": tensor '", e.name,
             "' starts at byte ", e.begin, " but the previous tensor ended at ", expect,
             " (gaps and overlaps are not allowed)");
    LS_CHECK(e.end <= data_size, "load_safetensors: ", path, ": tensor '", e.name, "' ends at byte ",
             e.end, " but the file holds only ", data_size, " bytes of data (truncated?)");
    expect = e.end;
  }
  LS_CHECK(expect == data_size, "load_safetensors: ", path, ": ", data_size - expect,
           " bytes of data after the last tensor");
  for (const Entry& e : entries) {
    Tensor t = empty(e.shape, e.dtype);
    in.seekg(static_cast<std::streamoff>(8 + hlen + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    LS_CHECK(in.good() || e.end == e.begin, "load_safetensors: ", path, ": read of tensor '",
             e.name, "' failed");
    out.tensors.emplace_back(e.name, t);
  }
  return out;
}

}  // namespace lockstep::io
