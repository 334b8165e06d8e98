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

// A listening socket at `port` (0: any free port) on `address`, or on every interface (IPv6
// dual-stack, else IPv4) when `address` is empty. Throws "port N is already in use" when it is,
// and names the address when it is not one of this machine's.
struct Listener {
  Fd fd;
  uint16_t port = 0;
};
Listener listen_on(uint16_t port, int backlog, const std::string& address = "");

// "300 ms", "2.5 s", "300 s": a timeout as a person writes it.
std::string duration_text(std::chrono::milliseconds d);

// Note [Waiting for the store]
// A client that cannot reach the store retries (the server may be seconds away) until its
// deadline, and says why: each failure's cause is kept, and a warning
//   waiting for the store at host:port: name does not resolve (...) (attempt 7, 35 s of 300 s)
// is logged after kFirstWaitLog and then at most every kWaitLogInterval, so a typo in
// MASTER_ADDR or a rank 0 that never starts is visible long before the deadline. The error at the
// deadline names host:port, the timeout, the attempts and the last cause.
class ConnectAttempts {
 public:
  ConnectAttempts(std::string where, std::chrono::milliseconds timeout);
  Clock::time_point deadline() const { return deadline_; }
  bool expired() const { return Clock::now() >= deadline_; }
  // Records one failed attempt and logs its cause when a line is due.
  void failed(std::string cause);
  // Throws the error at the deadline.
  [[noreturn]] void give_up() const;

 private:
  std::string where_;
  std::chrono::milliseconds timeout_;
  Clock::time_point start_, deadline_, next_log_;
  int attempts_ = 0;
  std::string last_cause_ = "no attempt finished";
};

// Connects to host:port, retrying every failure (a name that does not resolve yet, a refused or
// unreachable address) with exponential backoff until `attempts`' deadline; the socket returned
// is non-blocking with TCP_NODELAY. Throws through attempts.give_up() at the deadline.
Fd connect_to(const std::string& host, uint16_t port, ConnectAttempts& attempts);

// Blocking I/O on a non-blocking socket, bounded by `deadline`. Both return false when the
// deadline passed first; they throw on a socket error or (read) when the peer closed.
bool send_all(int fd, const uint8_t* data, size_t n, Clock::time_point deadline);
bool recv_exact(int fd, uint8_t* data, size_t n, Clock::time_point deadline);

// Milliseconds until `deadline` for poll(): at least 0, rounded up, capped to fit an int.
int poll_timeout_ms(Clock::time_point deadline);

}  // namespace lockstep::dist::detail
