// The TCP store's wire format: frames with a magic byte, a version, an opcode and fields.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/distributed/store/store.h"
#include "lockstep/distributed/store/tcp_store.h"

namespace lockstep::dist::detail {

// Note [Store frames]
// Every request and every reply is one frame:
//   byte 0     kMagic ('L'), so a stray client of another protocol is spotted at once
//   byte 1     kProtocolVersion
//   byte 2     opcode (a request Op or a reply Status)
//   byte 3     reserved, 0
//   bytes 4-7  payload length, u32 little-endian, at most kMaxPayloadBytes
//   payload    fields, each a u32 little-endian length and that many bytes; numbers are i64
//              little-endian fields of 8 bytes
// The server closes a connection whose frame has a wrong magic, version or reserved byte, an
// unknown opcode, an oversized length, or fields that do not parse into exactly what the opcode
// takes; every other connection is unaffected. Replies come in request order. A connection's
// first frame is a hello (with a token, it must be; without one, any request is taken as the
// hello) of at most kMaxHelloBytes of payload.
inline constexpr uint8_t kMagic = 0x4C;
inline constexpr uint8_t kProtocolVersion = 1;
inline constexpr size_t kHeaderBytes = 8;
// Larger frames are refused (the server closes the connection; the client refuses to send).
inline constexpr size_t kMaxPayloadBytes = size_t{64} << 20;
// Before a connection is admitted its frames are this small, so that strangers cost the server
// little memory (Note [Store under attack] in tcp_store_server.h).
inline constexpr size_t kMaxHelloBytes = 8 << 10;
inline constexpr size_t kMaxTokenBytes = kMaxStoreTokenBytes;  // tcp_store.h: the public limit
static_assert(kMaxTokenBytes + 64 < kMaxHelloBytes, "a hello holds the token and a count");

enum class Op : uint8_t {
  kHello = 1,       // [token, count-as-worker i64]            -> Ok [] | Rejected [why]
  kSet = 2,         // [key, value]                            -> Ok []
  kGet = 3,         // [key, timeout_ms]                       -> Ok [value] | Timeout []
  kAdd = 4,         // [key, delta]                            -> Ok [new value] | Error [why]
  kCompareSet = 5,  // [key, expected, desired]                -> Ok [value]
  kCheck = 6,       // [key...]                                -> Ok [all exist i64]
  kWait = 7,        // [timeout_ms, key...]                    -> Ok [] | Timeout [missing...]
  kDelete = 8,      // [key]                                   -> Ok [existed i64]
  kNumKeys = 9,     // []                                      -> Ok [count]
};
inline constexpr uint8_t kMaxOp = 9;

enum class Status : uint8_t {
  kOk = 0x80,
  kTimeout = 0x81,
  kError = 0x82,
  kRejected = 0x83,
};

// Builds one frame.
class FrameWriter {
 public:
  explicit FrameWriter(uint8_t opcode);
  FrameWriter& field(const uint8_t* data, size_t n);
  FrameWriter& field(const Bytes& b) { return field(b.data(), b.size()); }
  FrameWriter& field(const std::string& s) {
    return field(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  FrameWriter& field(int64_t v);
  // The finished frame (header length filled in).
  std::vector<uint8_t> finish();
  size_t payload_size() const { return buf_.size() - kHeaderBytes; }

 private:
  std::vector<uint8_t> buf_;
};

struct Header {
  uint8_t opcode = 0;
  uint32_t length = 0;
};

// Parses a header; nullopt when magic, version or reserved byte are wrong or the length is over
// kMaxPayloadBytes.
std::optional<Header> parse_header(const uint8_t* p);

// Splits a payload into fields; nullopt when the lengths do not add up exactly.
std::optional<std::vector<std::string>> parse_fields(const uint8_t* p, size_t n);

// An 8-byte field as i64; nullopt when it is not 8 bytes.
std::optional<int64_t> as_i64(const std::string& field);

}  // namespace lockstep::dist::detail
