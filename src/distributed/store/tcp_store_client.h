// TCPStoreClient: one connection to the store server, request/reply with deadlines (src-internal).
#pragma once

#include <string>
#include <vector>

#include "distributed/store/protocol.h"
#include "distributed/store/socket.h"

namespace lockstep::dist::detail {

// Not thread-safe (TCPStore serializes requests). Connects in the constructor; a connection
// found broken is dropped and the next request opens a new one.
class TCPStoreClient {
 public:
  TCPStoreClient(std::string host, uint16_t port, std::string token,
                 std::chrono::milliseconds timeout);

  struct Reply {
    Status status;
    std::vector<std::string> fields;
  };
  // Sends one request frame and reads its reply within `reply_within` (plus a grace period for
  // the server to answer a timed-out wait itself); reconnects first, within `connect_within`,
  // when the last connection broke.
  Reply request(const std::vector<uint8_t>& frame, std::chrono::milliseconds reply_within,
                std::chrono::milliseconds connect_within);

  // "host:port", for messages.
  std::string where() const { return host_ + ":" + std::to_string(port_); }

 private:
  void connect(std::chrono::milliseconds timeout);
  // Reads one reply frame; throws on a malformed one, returns nullopt when `deadline` passed.
  std::optional<Reply> read_reply(Clock::time_point deadline);

  std::string host_;
  uint16_t port_;
  std::string token_;
  bool counted_ = false;  // this client has been counted as a worker by the server
  Fd fd_;
};

}  // namespace lockstep::dist::detail
