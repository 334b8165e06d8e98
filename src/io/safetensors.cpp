// safetensors writer and validating reader (JSON through nlohmann-json, large files mmapped).
#include "lockstep/io/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <set>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/syscall.h"
#include "lockstep/tensor/tensor_impl.h"

namespace lockstep::io {

namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; lockstep writes and reads it as raw bytes");

// A header this large is not a tensor index but a corrupt length field.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr size_t kHeaderAlignment = 8;
constexpr size_t kLengthBytes = 8;
// How much of a JSON value an error message quotes.
constexpr size_t kQuoteChars = 40;
constexpr int kQuoteDepth = 3;

// Ordered so that "the first problem" is the first in the header as written.
using json = nlohmann::ordered_json;

// A private, writable (copy-on-write) mapping of a whole file: tensors may be modified in place
// without the file ever changing. Tensors that point into it share ownership (MappedStorage).
// Note: if another process truncates the file while it is mapped, touching the lost pages raises
// SIGBUS; safetensors files are written once and renamed into place, so we accept that.
class Mapping {
 public:
  Mapping(int fd, size_t size, const std::string& path) : size_(size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    LS_CHECK(p != MAP_FAILED, "load_safetensors: cannot map ", path, " (", size,
             " bytes): ", errno_text(errno));
    data_ = static_cast<unsigned char*>(p);
  }
  ~Mapping() { ::munmap(data_, size_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  unsigned char* data() const { return data_; }

 private:
  unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

// A borrowed StorageImpl bundled with the mapping it points into; handed out through
// shared_ptr's aliasing constructor, so the mapping lives as long as any tensor's storage.
struct MappedStorage {
  MappedStorage(std::shared_ptr<const Mapping> m, void* data, size_t nbytes)
      : mapping(std::move(m)), storage(data, nbytes, kCPU) {}
  std::shared_ptr<const Mapping> mapping;
  StorageImpl storage;
};

// The bytes of the file being loaded: the mapping, or (small files) a heap copy.
struct FileBytes {
  std::shared_ptr<const Mapping> mapping;
  std::vector<unsigned char> buffer;
  const unsigned char* data = nullptr;
  uint64_t size = 0;
};

FileBytes open_file(const std::string& path, const SafetensorsLoadOptions& opts) {
  Fd f(LS_SYSCHECK_MSG(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "load_safetensors: cannot open ",
                       path));
  struct stat st {};
  LS_SYSCHECK_MSG(::fstat(f.get(), &st), "load_safetensors: cannot stat ", path);
  LS_CHECK(S_ISREG(st.st_mode), "load_safetensors: ", path,
           " is not a regular file (expected a .safetensors file)");
  FileBytes out;
  out.size = static_cast<uint64_t>(st.st_size);
  LS_CHECK(out.size >= kLengthBytes, "load_safetensors: ", path, " is ", out.size,
           " bytes, too short for the 8-byte header length");
  if (out.size >= opts.mmap_min_bytes) {
    auto m = std::make_shared<const Mapping>(f.get(), static_cast<size_t>(out.size), path);
    out.data = m->data();
    out.mapping = std::move(m);
    return out;
  }
  out.buffer.resize(static_cast<size_t>(out.size));
  size_t done = 0;
  while (done < out.buffer.size()) {
    const ssize_t r = LS_SYSCHECK_MSG(
        retry_on_eintr(
            [&] { return ::read(f.get(), out.buffer.data() + done, out.buffer.size() - done); }),
        "load_safetensors: reading ", path, " failed");
    LS_CHECK(r > 0, "load_safetensors: ", path, " shrank from ", out.size, " to ", done,
             " bytes while being read");
    done += static_cast<size_t>(r);
  }
  out.data = out.buffer.data();
  return out;
}

// Appends a short rendering of `v`. Containers are cut after kQuoteChars characters or
// kQuoteDepth levels: json::dump recurses, and a corrupt header may nest a million levels deep.
void render(const json& v, std::string& out, int depth) {
  if (!v.is_structured()) {
    out += v.dump(-1, ' ', false, json::error_handler_t::replace);
    return;
  }
  out += v.is_array() ? '[' : '{';
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (out.size() > kQuoteChars || depth >= kQuoteDepth) {
      out += "...";
      break;
    }
    if (!first) out += ',';
    first = false;
    if (v.is_object())
      out += json(it.key()).dump(-1, ' ', false, json::error_handler_t::replace) + ":";
    render(*it, out, depth + 1);
  }
  out += v.is_array() ? ']' : '}';
}

// "number -3", "string \"abc\"", "array [1,2]" for error messages.
std::string describe(const json& v) {
  if (v.is_null()) return "null";
  std::string s;
  render(v, s, 0);
  if (s.size() > kQuoteChars) s = s.substr(0, kQuoteChars) + "...";
  return std::string(v.type_name()) + " " + s;
}

// nlohmann::json::parse keeps the last of duplicate keys without a word, which would let one
// tensor hide another; this callback refuses any key seen twice in the same object.
json parse_header_json(const char* first, const char* last, const std::string& where) {
  std::vector<std::set<std::string>> open_objects;
  std::string entry;  // the top-level key whose value is being parsed
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == json::parse_event_t::key) {
      const std::string& k = parsed.get_ref<const std::string&>();
      const bool fresh = open_objects.back().insert(k).second;
      if (depth == 1) {
        LS_CHECK(fresh, where, "tensor name '", k,
                 "' appears twice in the header (expected unique names)");
        entry = k;
      } else {
        LS_CHECK(fresh, where, "key '", k, "' appears twice in the same object",
                 entry.empty() ? "" : " under '" + entry + "'", " (expected unique keys)");
      }
    }
    return true;
  };
  try {
    return json::parse(first, last, callback);
  } catch (const json::exception& e) {
    LS_THROW(where, "header is not valid JSON (", e.what(), ")");
  }
}

std::optional<DType> find_dtype(const std::string& s) {
  for (DType t : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool})
    if (safetensors_dtype(t) == s) return t;
  return std::nullopt;
}

constexpr const char* kSupportedDtypes = "F32, F64, BF16, F16, I32, I64, U8, BOOL";

// A JSON integer >= 0 and <= max, else nullopt.
std::optional<uint64_t> non_negative_integer(const json& v, uint64_t max) {
  uint64_t u = 0;
  if (v.is_number_unsigned()) {
    u = v.get<uint64_t>();
  } else if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < 0) return std::nullopt;
    u = static_cast<uint64_t>(i);
  } else {
    return std::nullopt;
  }
  if (u > max) return std::nullopt;
  return u;
}

struct Entry {
  std::string name;
  DType dtype = kFloat32;
  Dims shape;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<Entry> entries;  // in header order
  Metadata metadata;
};

Entry parse_entry(const std::string& name, const json& v, const std::string& where) {
  const std::string what = where + "tensor '" + name + "'";
  constexpr const char* kFields = "(expected exactly dtype, shape, data_offsets)";
  LS_CHECK(v.is_object(), what, ": expected an object {dtype, shape, data_offsets}, found ",
           describe(v));
  for (const auto& [k, unused] : v.items())
    LS_CHECK(k == "dtype" || k == "shape" || k == "data_offsets", what, " has unexpected key '", k,
             "' ", kFields);
  for (const char* k : {"dtype", "shape", "data_offsets"})
    LS_CHECK(v.contains(k), what, " has no '", k, "' ", kFields);
  Entry e;
  e.name = name;

  const json& dt = v.at("dtype");
  LS_CHECK(dt.is_string(), what, ": dtype must be a string such as \"F32\", found ", describe(dt));
  const auto dtype = find_dtype(dt.get_ref<const std::string&>());
  LS_CHECK(dtype.has_value(), what, ": unsupported safetensors dtype '",
           dt.get_ref<const std::string&>(), "' (lockstep reads ", kSupportedDtypes, ")");
  e.dtype = *dtype;

  const json& shape = v.at("shape");
  LS_CHECK(shape.is_array(), what, ": shape must be a list of non-negative integers, found ",
           describe(shape));
  LS_CHECK(shape.size() <= static_cast<size_t>(Dims::kMaxDims), what, ": shape has ", shape.size(),
           " dimensions, lockstep tensors have at most ", Dims::kMaxDims);
  // Strides multiply the non-zero dimensions even when another one is 0, so that product must
  // fit too (an empty tensor may not carry an absurd shape).
  int64_t extent = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const auto d = non_negative_integer(shape[i], std::numeric_limits<int64_t>::max());
    LS_CHECK(d.has_value(), what, ": shape must be a list of non-negative integers, but dimension ",
             i, " is ", describe(shape[i]));
    e.shape.push_back(static_cast<int64_t>(*d));
    LS_CHECK(!__builtin_mul_overflow(extent, std::max<int64_t>(e.shape[i], 1), &extent), what,
             ": shape ", shape.dump(), " has more elements than fit in 64 bits (corrupt header?)");
  }
  int64_t need = 0;
  LS_CHECK(!__builtin_mul_overflow(e.shape.numel(), dtype_size(e.dtype), &need), what, ": shape ",
           e.shape.str(), " of ", dt.get_ref<const std::string&>(),
           " needs more bytes than fit in 64 bits (corrupt header?)");

  const json& off = v.at("data_offsets");
  LS_CHECK(off.is_array() && off.size() == 2, what,
           ": data_offsets must be a list of two integers [begin, end], found ", describe(off));
  for (size_t i = 0; i < 2; ++i)
    LS_CHECK(non_negative_integer(off[i], std::numeric_limits<uint64_t>::max()).has_value(), what,
             ": data_offsets must be non-negative integers, but ", i == 0 ? "begin" : "end", " is ",
             describe(off[i]));
  e.begin = *non_negative_integer(off[0], std::numeric_limits<uint64_t>::max());
  e.end = *non_negative_integer(off[1], std::numeric_limits<uint64_t>::max());
  LS_CHECK(e.begin <= e.end, what, ": data_offsets [", e.begin, ", ", e.end,
           "] end before they begin (expected begin <= end)");
  LS_CHECK(e.end - e.begin == static_cast<uint64_t>(need), what, " of dtype ",
           safetensors_dtype(e.dtype), " and shape ", e.shape.str(), " needs ", need,
           " bytes but its data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin);
  return e;
}

Header parse_header(const char* first, const char* last, const std::string& where) {
  const json root = parse_header_json(first, last, where);
  LS_CHECK(root.is_object(), where,
           "header must be a JSON object {name: {dtype, shape, data_offsets}}, found ",
           describe(root));
  Header h;
  for (const auto& [name, v] : root.items()) {
    if (name == "__metadata__") {
      LS_CHECK(v.is_object(), where, "__metadata__ must be an object of strings, found ",
               describe(v));
      for (const auto& [k, s] : v.items()) {
        LS_CHECK(s.is_string(), where, "__metadata__ must be an object of strings, but '", k,
                 "' is ", describe(s));
        h.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    h.entries.push_back(parse_entry(name, v, where));
  }
  return h;
}

// Sorts by offset and checks that the tensors tile the data exactly.
void check_layout(std::vector<Entry>& entries, uint64_t data_size, const std::string& where) {
  // Stable, and by end too: empty tensors may share an offset with each other and a neighbour.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : entries) {
    LS_CHECK(e.begin >= expect, where, "tensor '", e.name, "' (bytes [", e.begin, ", ", e.end,
             ")) overlaps tensor '", prev ? prev->name : "", "' (bytes [", prev ? prev->begin : 0,
             ", ", expect, ")): expected it to start at byte ", expect,
             " (gaps and overlaps are not allowed)");
    LS_CHECK(e.begin == expect, where, "tensor '", e.name, "' starts at byte ", e.begin,
             " but the previous tensor ended at ", expect, ", leaving ", e.begin - expect,
             " bytes unused (gaps and overlaps are not allowed)");
    LS_CHECK(e.end <= data_size, where, "tensor '", e.name, "' ends at byte ", e.end,
             " but the file holds only ", data_size, " bytes of data (truncated?)");
    expect = e.end;
    prev = &e;
  }
  LS_CHECK(expect == data_size, where, data_size - expect,
           " bytes of data after the last tensor (expected the tensors to cover all ", data_size,
           " bytes of data)");
}

// lockstep's kernels read BOOL bytes as C++ bool, for which anything but 0 or 1 is undefined.
void check_bool_bytes(const Entry& e, const unsigned char* p, const std::string& where) {
  for (uint64_t i = 0; i < e.end - e.begin; ++i)
    LS_CHECK(p[i] <= 1, where, "tensor '", e.name, "' of dtype BOOL holds ", static_cast<int>(p[i]),
             " at element ", i, " (expected 0 or 1)");
}

}  // namespace

std::string safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
    case DType::b8:
      return "BOOL";
  }
  return "?";
}

DType parse_safetensors_dtype(const std::string& s) {
  const auto t = find_dtype(s);
  LS_CHECK(t.has_value(), "unsupported safetensors dtype '", s, "' (lockstep reads ",
           kSupportedDtypes, ")");
  return *t;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata) {
  autograd::NoGradGuard no_grad;
  json header = json::object();
  // First, as the Python implementation writes it.
  if (!metadata.empty()) header["__metadata__"] = metadata;
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
  std::string h;
  try {
    h = header.dump();
  } catch (const json::exception& e) {
    LS_THROW("save_safetensors: ", path, ": tensor names and metadata must be valid UTF-8 (",
             e.what(), ")");
  }
  // Pad with spaces so the data starts 8-byte aligned, as the reference implementation does.
  while ((h.size() + kLengthBytes) % kHeaderAlignment) h.push_back(' ');
  const uint64_t hlen = h.size();
  unsigned char len_le[kLengthBytes];
  for (size_t i = 0; i < kLengthBytes; ++i) len_le[i] = static_cast<unsigned char>(hlen >> (8 * i));

  AtomicFile file(path, "save_safetensors");
  file.write(len_le, kLengthBytes);
  file.write(h.data(), h.size());
  for (const Tensor& c : data) file.write(c.data_ptr(), static_cast<size_t>(c.nbytes()));
  file.commit();
}

Metadata load_safetensors_metadata(const std::string& path) {
  const std::string where = "load_safetensors_metadata: " + path + ": ";
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  LS_CHECK(in.good(), where, "cannot open: ", errno_text(errno));
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  LS_CHECK(size >= kLengthBytes, where, "the file is ", size,
           " bytes, too short for the 8-byte header length");
  in.seekg(0);
  unsigned char len_le[kLengthBytes];
  in.read(reinterpret_cast<char*>(len_le), kLengthBytes);
  uint64_t hlen = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) hlen |= static_cast<uint64_t>(len_le[i]) << (8 * i);
  LS_CHECK(hlen <= size - kLengthBytes && hlen <= kMaxHeaderBytes, where, "header length ", hlen,
           " is impossible for a file of ", size, " bytes");
  std::string text(hlen, '\0');
  LS_CHECK(in.read(text.data(), static_cast<std::streamsize>(hlen)), where,
           "cannot read the header: ", errno_text(errno));
  return parse_header(text.data(), text.data() + hlen, where).metadata;
}

SafetensorsContents load_safetensors(const std::string& path, const SafetensorsLoadOptions& opts) {
  const std::string where = "load_safetensors: " + path + ": ";
  const FileBytes file = open_file(path, opts);
  uint64_t hlen = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) hlen |= static_cast<uint64_t>(file.data[i]) << (8 * i);
  LS_CHECK(hlen <= file.size - kLengthBytes, where, "header length ", hlen,
           " is impossible: expected at most the ", file.size - kLengthBytes,
           " bytes that follow the 8-byte length in a file of ", file.size, " bytes");
  LS_CHECK(hlen <= kMaxHeaderBytes, where, "header length ", hlen, " is over the ",
           kMaxHeaderBytes >> 20, " MiB limit (corrupt length field?)");
  const char* text = reinterpret_cast<const char*>(file.data + kLengthBytes);
  Header header = parse_header(text, text + hlen, where);

  const uint64_t data_size = file.size - kLengthBytes - hlen;
  const unsigned char* data = file.data + kLengthBytes + hlen;
  check_layout(header.entries, data_size, where);
  for (const Entry& e : header.entries)
    if (e.dtype == kBool) check_bool_bytes(e, data + e.begin, where);

  SafetensorsContents out;
  out.metadata = std::move(header.metadata);
  for (const Entry& e : header.entries) {
    const unsigned char* p = data + e.begin;
    const size_t nbytes = static_cast<size_t>(e.end - e.begin);
    const bool aligned = reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) == 0;
    Tensor t;
    if (file.mapping && nbytes > 0 && aligned) {
      // Zero copy: the tensor's storage points into the mapping and keeps it alive.
      auto owner =
          std::make_shared<MappedStorage>(file.mapping, const_cast<unsigned char*>(p), nbytes);
      Storage storage(owner, &owner->storage);
      t = Tensor(std::make_shared<TensorImpl>(std::move(storage), e.shape,
                                              contiguous_strides(e.shape), 0, e.dtype));
    } else {
      t = empty(e.shape, e.dtype);
      if (nbytes > 0) std::memcpy(t.data_ptr(), p, nbytes);
    }
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace lockstep::io
