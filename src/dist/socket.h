// Sockets for the TCP store: the LS_SYSCHECK macro, an owning file descriptor, listen/connect.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "lockstep/error.h"

namespace lockstep::dist::detail {

// "Connection refused (errno 111)".
std::string errno_text(int err);

inline bool errno_in(int err, std::initializer_list<int> allowed) {
  for (int a : allowed)
    if (err == a) return true;
  return false;
}

}  // namespace lockstep::dist::detail

// LS_SYSCHECK(call, ALLOWED_ERRNO...): evaluates a system call that reports failure as -1 plus
// errno, throws lockstep::Error naming the call and errno's text, and returns its result. A
// failure with one of the allowed errno values (EAGAIN, EINTR, ...) is returned as -1 with errno
// intact, for the caller to handle.
#define LS_SYSCHECK(call, ...)                                                                 \
  [&]() {                                                                                      \
    auto ls_result_ = (call);                                                                  \
    const int ls_errno_ = errno;                                                               \
    LS_CHECK(ls_result_ != -1 || ::lockstep::dist::detail::errno_in(ls_errno_, {__VA_ARGS__}), \
             #call " failed: ", ::lockstep::dist::detail::errno_text(ls_errno_));              \
    errno = ls_errno_;                                                                         \
    return ls_result_;                                                                         \
  }()

namespace lockstep::dist::detail {

using Clock = std::chrono::steady_clock;

// Owns one file descriptor; closes it on destruction (errors from close are ignored there: a
// destructor never throws).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset();

 private:
  int fd_ = -1;
};

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
