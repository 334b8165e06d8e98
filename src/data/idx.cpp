// IDX reader: a byte stream over a plain or gzip file (zlib inflate), then header and data checks.
#include "lockstep/data/idx.h"

#include <zlib.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "lockstep/base/syscall.h"

namespace lockstep::data {

namespace {

constexpr int64_t kIdxMagicBytes = 4;
constexpr int64_t kIdxDimBytes = 4;
constexpr size_t kChunkBytes = 1 << 16;
constexpr int64_t kMaxElements = int64_t{1} << 52;
// deflate cannot expand data by more than about 1032:1; a header asking for more than this many
// bytes per compressed byte is corrupt, and saying so beats trying to allocate it.
constexpr int64_t kMaxDeflateRatio = 1032;
constexpr int kGzipWindowBits = 15 + 16;  // 2^15 window, expect a gzip wrapper
constexpr unsigned char kGzipMagic0 = 0x1f;
constexpr unsigned char kGzipMagic1 = 0x8b;

struct IdxType {
  uint8_t code;
  const char* name;
  int64_t file_bytes;  // bytes per element in the file
  DType dtype;         // what it becomes
};

constexpr IdxType kIdxTypes[] = {
    {0x08, "u8", 1, DType::u8},   {0x09, "i8", 1, DType::i32},  {0x0B, "i16", 2, DType::i32},
    {0x0C, "i32", 4, DType::i32}, {0x0D, "f32", 4, DType::f32}, {0x0E, "f64", 8, DType::f64},
};

const IdxType* find_type(uint8_t code) {
  for (const IdxType& t : kIdxTypes)
    if (t.code == code) return &t;
  return nullptr;
}

std::string hex(uint32_t v, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%0*X", digits, v);
  return buf;
}

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};

// The file's bytes, inflated when the file is gzip. read() returns fewer bytes than asked only
// at the end of the data; a broken gzip stream (corrupt, truncated, followed by garbage) throws.
class ByteSource {
 public:
  explicit ByteSource(const std::string& path) : path_(path) {
    file_.reset(std::fopen(path.c_str(), "rb"));
    LS_CHECK(file_ != nullptr, "read_idx: cannot open ", path, ": ", errno_text(errno));
    LS_CHECK(std::fseek(file_.get(), 0, SEEK_END) == 0, "read_idx: cannot seek in ", path);
    file_bytes_ = std::ftell(file_.get());
    std::rewind(file_.get());
    in_.resize(kChunkBytes);
    fill();
    gzip_ = avail_ >= 2 && in_[0] == kGzipMagic0 && in_[1] == kGzipMagic1;
    if (gzip_) {
      std::memset(&zs_, 0, sizeof zs_);
      LS_CHECK(inflateInit2(&zs_, kGzipWindowBits) == Z_OK, "read_idx: ", path,
               ": zlib inflateInit2 failed");
      zs_ready_ = true;
    }
  }
  ~ByteSource() {
    if (zs_ready_) inflateEnd(&zs_);
  }
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;

  bool gzip() const { return gzip_; }
  int64_t file_bytes() const { return file_bytes_; }

  int64_t read(void* dst, int64_t n) {
    return gzip_ ? read_gzip(static_cast<unsigned char*>(dst), n)
                 : read_plain(static_cast<unsigned char*>(dst), n);
  }

  // Reads and counts everything left.
  int64_t skip_rest() {
    std::vector<unsigned char> scratch(kChunkBytes);
    int64_t total = 0;
    for (int64_t got; (got = read(scratch.data(), kChunkBytes)) > 0;) total += got;
    return total;
  }

 private:
  // Refills in_ from the file when it is empty; false at end of file.
  bool fill() {
    if (pos_ < avail_) return true;
    pos_ = 0;
    avail_ = std::fread(in_.data(), 1, in_.size(), file_.get());
    LS_CHECK(!std::ferror(file_.get()), "read_idx: error reading ", path_, ": ",
             errno_text(errno));
    return avail_ > 0;
  }

  int64_t read_plain(unsigned char* dst, int64_t n) {
    int64_t done = 0;
    while (done < n && fill()) {
      size_t take = std::min<size_t>(avail_ - pos_, static_cast<size_t>(n - done));
      std::memcpy(dst + done, in_.data() + pos_, take);
      pos_ += take;
      done += static_cast<int64_t>(take);
    }
    return done;
  }

  int64_t read_gzip(unsigned char* dst, int64_t n) {
    int64_t done = 0;
    while (done < n && !stream_done_) {
      if (pos_ == avail_ && !fill()) {
        LS_THROW("read_idx: ", path_, ": the gzip stream is truncated (the file ends after ",
                 file_bytes_, " bytes, before the end of the compressed data)");
      }
      zs_.next_in = in_.data() + pos_;
      zs_.avail_in = static_cast<uInt>(avail_ - pos_);
      zs_.next_out = dst + done;
      zs_.avail_out = static_cast<uInt>(std::min<int64_t>(n - done, 1 << 30));
      const uInt out_before = zs_.avail_out;
      int ret = inflate(&zs_, Z_NO_FLUSH);
      pos_ = avail_ - zs_.avail_in;
      done += out_before - zs_.avail_out;
      if (ret == Z_STREAM_END) {
        member_end();
      } else if (ret == Z_DATA_ERROR || ret == Z_NEED_DICT) {
        LS_THROW("read_idx: ", path_,
                 ": corrupt gzip stream (zlib: ", zs_.msg ? zs_.msg : "invalid data", ")");
      } else if (ret == Z_MEM_ERROR) {
        LS_THROW("read_idx: ", path_, ": zlib ran out of memory while inflating");
      } else {
        LS_CHECK(ret == Z_OK || ret == Z_BUF_ERROR, "read_idx: ", path_,
                 ": zlib inflate failed with code ", ret);
      }
    }
    return done;
  }

  // At the end of one gzip member: another member may follow (as `cat a.gz b.gz` makes);
  // anything else after it means the file is not what it claims to be.
  void member_end() {
    if (!fill()) {
      stream_done_ = true;
      return;
    }
    if (avail_ - pos_ < 2 && pos_ + 1 == avail_) {
      // One byte left in the buffer: move it to the front and top up.
      in_[0] = in_[pos_];
      size_t more = std::fread(in_.data() + 1, 1, in_.size() - 1, file_.get());
      pos_ = 0;
      avail_ = 1 + more;
    }
    if (avail_ - pos_ >= 2 && in_[pos_] == kGzipMagic0 && in_[pos_ + 1] == kGzipMagic1) {
      LS_CHECK(inflateReset(&zs_) == Z_OK, "read_idx: ", path_, ": zlib inflateReset failed");
      return;
    }
    int64_t consumed = std::ftell(file_.get()) - static_cast<int64_t>(avail_ - pos_);
    LS_THROW("read_idx: ", path_, ": ", file_bytes_ - consumed,
             " bytes of trailing garbage after the gzip stream (it ends at byte ", consumed, " of ",
             file_bytes_, ")");
  }

  std::string path_;
  std::unique_ptr<FILE, FileCloser> file_;
  int64_t file_bytes_ = 0;
  std::vector<unsigned char> in_;
  size_t pos_ = 0, avail_ = 0;
  bool gzip_ = false;
  z_stream zs_;
  bool zs_ready_ = false;
  bool stream_done_ = false;
};

uint32_t read_be32(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) << 24 | static_cast<uint32_t>(p[1]) << 16 |
         static_cast<uint32_t>(p[2]) << 8 | p[3];
}

// Big-endian file elements of `type` to the tensor's dtype.
void convert(const IdxType& type, const unsigned char* src, int64_t n, void* dst) {
  switch (type.code) {
    case 0x09: {
      auto* o = static_cast<int32_t*>(dst);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int8_t>(src[i]);
      break;
    }
    case 0x0B: {
      auto* o = static_cast<int32_t*>(dst);
      for (int64_t i = 0; i < n; ++i)
        o[i] = static_cast<int16_t>(static_cast<uint16_t>(src[2 * i] << 8 | src[2 * i + 1]));
      break;
    }
    case 0x0C:
    case 0x0D: {
      auto* o = static_cast<uint32_t*>(dst);
      for (int64_t i = 0; i < n; ++i) o[i] = read_be32(src + 4 * i);
      break;
    }
    case 0x0E: {
      auto* o = static_cast<uint64_t*>(dst);
      for (int64_t i = 0; i < n; ++i)
        o[i] = static_cast<uint64_t>(read_be32(src + 8 * i)) << 32 | read_be32(src + 8 * i + 4);
      break;
    }
    default:
      LS_THROW("read_idx: no conversion for IDX type ", hex(type.code, 2));
  }
}

std::string supported_types() {
  std::string s;
  for (const IdxType& t : kIdxTypes) {
    if (!s.empty()) s += ", ";
    s += hex(t.code, 2) + " (" + t.name + ")";
  }
  return s;
}

}  // namespace

Tensor read_idx(const std::string& path) {
  static_assert(std::endian::native == std::endian::little,
                "read_idx assumes a little-endian host");
  ByteSource src(path);
  const char* kind = src.gzip() ? "decompressed " : "";

  unsigned char magic[kIdxMagicBytes];
  int64_t got = src.read(magic, kIdxMagicBytes);
  LS_CHECK(got == kIdxMagicBytes, "read_idx: ", path, ": truncated header: expected ",
           kIdxMagicBytes, " magic bytes, found ", got, " ", kind, "bytes");
  const uint32_t magic_value = read_be32(magic);
  LS_CHECK(magic[0] == 0 && magic[1] == 0, "read_idx: ", path, ": bad magic number ",
           hex(magic_value, 8), ": an IDX file starts with 0x00 0x00 <type> <ndim>");
  const IdxType* type = find_type(magic[2]);
  LS_CHECK(type != nullptr, "read_idx: ", path, ": unsupported IDX type code ", hex(magic[2], 2),
           " (magic ", hex(magic_value, 8), "); supported: ", supported_types());
  const int64_t ndim = magic[3];
  LS_CHECK(ndim >= 1 && ndim <= Dims::kMaxDims, "read_idx: ", path, ": bad magic number ",
           hex(magic_value, 8), ": expected 1 to ", Dims::kMaxDims, " dimensions, found ", ndim);

  std::vector<unsigned char> dim_bytes(static_cast<size_t>(ndim * kIdxDimBytes));
  got = src.read(dim_bytes.data(), ndim * kIdxDimBytes);
  LS_CHECK(got == ndim * kIdxDimBytes, "read_idx: ", path, ": truncated header: expected ",
           ndim * kIdxDimBytes, " bytes for ", ndim, " dimension sizes, found ", got, " ", kind,
           "bytes");
  Dims shape;
  bool has_zero = false, too_big = false;
  int64_t numel = 1;
  for (int64_t d = 0; d < ndim; ++d) {
    const int64_t size = read_be32(dim_bytes.data() + d * kIdxDimBytes);
    shape.push_back(size);
    has_zero = has_zero || size == 0;
    // Sizes are below 2^32 each; stop the product before it could overflow.
    if (size != 0 && numel > kMaxElements / size) too_big = true;
    if (!too_big) numel *= size;
  }
  if (has_zero) numel = 0, too_big = false;
  const int64_t header_bytes = kIdxMagicBytes + ndim * kIdxDimBytes;
  const std::string described = shape.str() + " " + type->name;
  LS_CHECK(!too_big, "read_idx: ", path, ": the header's dims ", described,
           " are impossibly large; the file is corrupt");
  const int64_t data_bytes = numel * type->file_bytes;

  // Refuse sizes the file cannot hold before allocating them.
  if (!src.gzip()) {
    const int64_t have = src.file_bytes() - header_bytes;
    LS_CHECK(have >= data_bytes, "read_idx: ", path, ": truncated data: the header (", described,
             ") needs ", data_bytes, " data bytes after its ", header_bytes,
             " header bytes, found ", have, " (file size ", src.file_bytes(), ", expected ",
             header_bytes + data_bytes, ")");
  } else {
    LS_CHECK(data_bytes <= src.file_bytes() * kMaxDeflateRatio, "read_idx: ", path,
             ": the header (", described, ") needs ", data_bytes,
             " data bytes, more than a gzip file of ", src.file_bytes(), " bytes can hold");
  }

  Tensor out = empty(shape, type->dtype);
  std::vector<unsigned char> raw;
  unsigned char* dst = static_cast<unsigned char*>(out.data_ptr());
  if (type->code != 0x08) {
    raw.resize(static_cast<size_t>(data_bytes));
    dst = raw.data();
  }
  got = src.read(dst, data_bytes);
  LS_CHECK(got == data_bytes, "read_idx: ", path, ": truncated data: the header (", described,
           ") needs ", data_bytes, " data bytes, found ", got, " (", kind, "size ",
           header_bytes + got, ", expected ", header_bytes + data_bytes, ")");
  const int64_t extra = src.skip_rest();
  LS_CHECK(extra == 0, "read_idx: ", path, ": ", extra,
           " bytes of trailing garbage after the data: the header (", described, ") accounts for ",
           header_bytes + data_bytes, " bytes, the ", kind, "file has ",
           header_bytes + data_bytes + extra);
  if (type->code != 0x08) convert(*type, raw.data(), numel, out.data_ptr());
  return out;
}

}  // namespace lockstep::data
