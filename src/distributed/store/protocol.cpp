// The TCP store's wire format: building and parsing frames (Note [Store frames] in protocol.h).
#include "distributed/store/protocol.h"

#include <cstring>

#include "lockstep/base/error.h"

namespace lockstep::dist::detail {

namespace {
void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
}  // namespace

FrameWriter::FrameWriter(uint8_t opcode) : buf_(kHeaderBytes, 0) {
  buf_[0] = kMagic;
  buf_[1] = kProtocolVersion;
  buf_[2] = opcode;
}

FrameWriter& FrameWriter::field(const uint8_t* data, size_t n) {
  LS_CHECK(n <= kMaxPayloadBytes && payload_size() + 4 + n <= kMaxPayloadBytes,
           "store: a request or reply of more than ", kMaxPayloadBytes,
           " bytes cannot be sent (a field of ", n, " bytes was given)");
  uint8_t len[4];
  put_u32(len, static_cast<uint32_t>(n));
  buf_.insert(buf_.end(), len, len + 4);
  buf_.insert(buf_.end(), data, data + n);
  return *this;
}

FrameWriter& FrameWriter::field(int64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
  return field(b, 8);
}

std::vector<uint8_t> FrameWriter::finish() {
  put_u32(buf_.data() + 4, static_cast<uint32_t>(payload_size()));
  return std::move(buf_);
}

std::optional<Header> parse_header(const uint8_t* p) {
  if (p[0] != kMagic || p[1] != kProtocolVersion || p[3] != 0) return std::nullopt;
  Header h{p[2], get_u32(p + 4)};
  if (h.length > kMaxPayloadBytes) return std::nullopt;
  return h;
}

std::optional<std::vector<std::string>> parse_fields(const uint8_t* p, size_t n) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < n) {
    if (n - at < 4) return std::nullopt;
    const uint32_t len = get_u32(p + at);
    at += 4;
    if (len > n - at) return std::nullopt;
    out.emplace_back(reinterpret_cast<const char*>(p + at), len);
    at += len;
  }
  return out;
}

std::optional<int64_t> as_i64(const std::string& field) {
  if (field.size() != 8) return std::nullopt;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(field[i])) << (8 * i);
  return static_cast<int64_t>(v);
}

}  // namespace lockstep::dist::detail
