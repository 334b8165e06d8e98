// Sockets for the TCP store: listen, connect, and deadline-bounded I/O.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "lockstep/base/syscall.h"

namespace lockstep::dist::detail {

using Clock = std::chrono::steady_clock;

void set_nonblocking(int fd);
void set_nodelay(int fd);

// A listening socket on every interface (IPv6 dual-stack, else IPv4) at `port` (0: any free
// port). Throws "port N is already in use" when it is.
struct Listener {
  Fd fd;
  uint16_t port = 0;
};
Listener listen_on(uint16_t port, int backlog);

// Connects to host:port, retrying refused and unreachable attempts with exponential backoff until
// `deadline`; the socket returned is non-blocking with TCP_NODELAY. Throws naming host:port and
// `timeout` when the deadline passes.
Fd connect_to(const std::string& host, uint16_t port, Clock::time_point deadline,
              std::chrono::milliseconds timeout);

// Blocking I/O on a non-blocking socket, bounded by `deadline`. Both return false when the
// deadline passed first; they throw on a socket error or (read) when the peer closed.
bool send_all(int fd, const uint8_t* data, size_t n, Clock::time_point deadline);
bool recv_exact(int fd, uint8_t* data, size_t n, Clock::time_point deadline);

// Milliseconds until `deadline` for poll(): at least 0, rounded up, capped to fit an int.
int poll_timeout_ms(Clock::time_point deadline);

}  // namespace lockstep::dist::detail
