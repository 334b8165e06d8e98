// Sockets for the TCP store: listening, connecting with backoff, deadline-bounded send and recv.
#include "distributed/store/socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "lockstep/base/log.h"

namespace lockstep::dist::detail {

namespace {
// Retrying a refused connect: start short (the server is usually seconds away at most), double,
// and never sleep longer than this between attempts.
constexpr std::chrono::milliseconds kFirstBackoff{10};
constexpr std::chrono::milliseconds kMaxBackoff{1000};
// Note [Waiting for the store]: a server that comes up within a second goes unmentioned.
constexpr std::chrono::milliseconds kFirstWaitLog{1000};
constexpr std::chrono::milliseconds kWaitLogInterval{5000};
}  // namespace

void set_nonblocking(int fd) {
  int flags = LS_SYSCHECK(::fcntl(fd, F_GETFL));
  LS_SYSCHECK(::fcntl(fd, F_SETFL, flags | O_NONBLOCK));
}

void set_nodelay(int fd) {
  int one = 1;
  LS_SYSCHECK(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one));
}

int poll_timeout_ms(Clock::time_point deadline) {
  auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

namespace {
// Binds `fd` to `addr` and listens; `what` names the address for messages.
Listener bind_and_listen(Fd fd, const sockaddr* addr, socklen_t len, uint16_t port, int backlog,
                         const std::string& what) {
  int one = 1;
  // SO_REUSEADDR lets a restarted job rebind a port still in TIME_WAIT; it does not let two
  // listeners share a port.
  LS_SYSCHECK(::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
  int rc = LS_SYSCHECK(::bind(fd.get(), addr, len), EADDRINUSE, EADDRNOTAVAIL);
  LS_CHECK(rc == 0 || errno != EADDRNOTAVAIL, "store server: cannot listen on ", what,
           ": it is not an address of this machine (expected one of its interfaces' addresses, "
           "or an empty bind address for every interface)");
  LS_CHECK(rc == 0, "store server: port ", port,
           " is already in use (another job or store is listening there; pick another port or "
           "pass 0 for a free one)");
  rc = LS_SYSCHECK(::listen(fd.get(), backlog), EADDRINUSE);
  LS_CHECK(rc == 0, "store server: port ", port, " is already in use");
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof bound;
  LS_SYSCHECK(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &bound_len));
  Listener l;
  l.port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  set_nonblocking(fd.get());
  l.fd = std::move(fd);
  return l;
}
}  // namespace

Listener listen_on(uint16_t port, int backlog, const std::string& address) {
  if (!address.empty()) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const int gai = ::getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &res);
    LS_CHECK(gai == 0, "store server: cannot listen on ", address,
             ": the name does not resolve (getaddrinfo: ", ::gai_strerror(gai), ")");
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
    Fd fd(LS_SYSCHECK(::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0)));
    return bind_and_listen(std::move(fd), res->ai_addr, res->ai_addrlen, port, backlog, address);
  }
  // Prefer one IPv6 socket that also accepts IPv4; fall back to IPv4 where IPv6 is off.
  Fd fd(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.valid()) {
    int zero = 0;
    LS_SYSCHECK(::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero));
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    addr.sin6_port = htons(port);
    return bind_and_listen(std::move(fd), reinterpret_cast<sockaddr*>(&addr), sizeof addr, port,
                           backlog, "every interface");
  }
  fd = Fd(LS_SYSCHECK(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(port);
  return bind_and_listen(std::move(fd), reinterpret_cast<sockaddr*>(&addr), sizeof addr, port,
                         backlog, "every interface");
}

std::string duration_text(std::chrono::milliseconds d) {
  if (d < std::chrono::seconds(1)) return std::to_string(d.count()) + " ms";
  std::string s = std::to_string(d.count() / 1000);
  if (const int64_t ms = d.count() % 1000; ms != 0) {
    std::string frac = std::to_string(1000 + ms).substr(1);  // "050"
    while (frac.back() == '0') frac.pop_back();
    s += "." + frac;
  }
  return s + " s";
}

ConnectAttempts::ConnectAttempts(std::string where, std::chrono::milliseconds timeout)
    : where_(std::move(where)),
      timeout_(timeout),
      start_(Clock::now()),
      deadline_(start_ + timeout),
      next_log_(start_ + kFirstWaitLog) {}

void ConnectAttempts::failed(std::string cause) {
  ++attempts_;
  last_cause_ = std::move(cause);
  const auto now = Clock::now();
  if (now < next_log_ || now >= deadline_) return;  // at the deadline the error says it
  next_log_ = now + kWaitLogInterval;
  // Whole seconds, or tenths for a short timeout: "35 s of 300 s", "1.3 s of 2.5 s".
  const double elapsed_s = std::chrono::duration<double>(now - start_).count();
  char elapsed[32];
  std::snprintf(elapsed, sizeof elapsed, "%.*f s", timeout_ < std::chrono::minutes(1) ? 1 : 0,
                elapsed_s);
  log_warning("waiting for the store at ", where_, ": ", last_cause_, " (attempt ", attempts_, ", ",
              elapsed, " of ", duration_text(timeout_), ")");
}

void ConnectAttempts::give_up() const {
  LS_THROW("could not connect to the store at ", where_, " within ", duration_text(timeout_), " (",
           attempts_, attempts_ == 1 ? " attempt" : " attempts", "; last cause: ", last_cause_,
           "); is the server running and reachable there?");
}

namespace {
// One non-blocking connect attempt to one address, bounded by `deadline`. Returns the connected
// socket, or an invalid Fd with `err` set for failures worth retrying.
Fd try_connect(const addrinfo* ai, Clock::time_point deadline, int& err) {
  Fd fd(LS_SYSCHECK(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol)));
  set_nonblocking(fd.get());
  int rc = LS_SYSCHECK(::connect(fd.get(), ai->ai_addr, ai->ai_addrlen), EINPROGRESS, EINTR,
                       ECONNREFUSED, ENETUNREACH, EHOSTUNREACH, ETIMEDOUT, EADDRNOTAVAIL,
                       ECONNRESET, EAGAIN);
  if (rc == -1 && errno != EINPROGRESS && errno != EINTR) {
    err = errno;
    return Fd();
  }
  if (rc == -1) {
    pollfd p{fd.get(), POLLOUT, 0};
    int n = LS_SYSCHECK(::poll(&p, 1, poll_timeout_ms(deadline)), EINTR);
    if (n <= 0) {
      err = ETIMEDOUT;
      return Fd();
    }
    int so_error = 0;
    socklen_t len = sizeof so_error;
    LS_SYSCHECK(::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len));
    if (so_error != 0) {
      err = so_error;
      return Fd();
    }
  }
  set_nodelay(fd.get());
  return fd;
}
}  // namespace

namespace {
// Why getaddrinfo failed, in words that say whether the name itself is wrong.
std::string resolve_failure(int gai) {
  const std::string text = std::string("(getaddrinfo: ") + ::gai_strerror(gai) + ")";
  switch (gai) {
    case EAI_NONAME:
#ifdef EAI_NODATA
    case EAI_NODATA:
#endif
    case EAI_FAIL:
      return "name does not resolve " + text;
    case EAI_AGAIN:
      return "name lookup failed for now (is DNS reachable?) " + text;
    default:
      return "name lookup failed " + text;
  }
}

std::string connect_failure(int err) {
  switch (err) {
    case ECONNREFUSED:
      return "connection refused (nothing listens there yet)";
    case ETIMEDOUT:
      return "the connection attempt timed out";
    default:
      return errno_text(err);
  }
}
}  // namespace

Fd connect_to(const std::string& host, uint16_t port, ConnectAttempts& attempts) {
  auto backoff = kFirstBackoff;
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    // Blocking: a resolver that does not answer can hold this past the deadline by its own
    // timeout (resolv.conf's, seconds); a name that does not resolve yet (DNS of a node still
    // coming up) is retried like a refused connection.
    int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai != 0) {
      attempts.failed(resolve_failure(gai));
    } else {
      std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
      std::string cause;
      for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
        int err = 0;
        Fd fd = try_connect(ai, attempts.deadline(), err);
        if (fd.valid()) return fd;
        cause = connect_failure(err);
      }
      attempts.failed(cause);
    }
    auto now = Clock::now();
    if (now >= attempts.deadline()) attempts.give_up();
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, attempts.deadline() - now));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

bool send_all(int fd, const uint8_t* data, size_t n, Clock::time_point deadline) {
  size_t done = 0;
  while (done < n) {
    // MSG_NOSIGNAL: a peer that went away is an error here, not a SIGPIPE that kills the process.
    ssize_t k =
        LS_SYSCHECK(::send(fd, data + done, n - done, MSG_NOSIGNAL), EAGAIN, EWOULDBLOCK, EINTR);
    if (k > 0) {
      done += static_cast<size_t>(k);
      continue;
    }
    if (errno == EINTR) continue;
    pollfd p{fd, POLLOUT, 0};
    int r = LS_SYSCHECK(::poll(&p, 1, poll_timeout_ms(deadline)), EINTR);
    if (r == 0 && Clock::now() >= deadline) return false;
  }
  return true;
}

bool recv_exact(int fd, uint8_t* data, size_t n, Clock::time_point deadline) {
  size_t done = 0;
  while (done < n) {
    ssize_t k = LS_SYSCHECK(::recv(fd, data + done, n - done, 0), EAGAIN, EWOULDBLOCK, EINTR);
    if (k > 0) {
      done += static_cast<size_t>(k);
      continue;
    }
    LS_CHECK(k != 0, "the store server closed the connection");
    if (errno == EINTR) continue;
    pollfd p{fd, POLLIN, 0};
    int r = LS_SYSCHECK(::poll(&p, 1, poll_timeout_ms(deadline)), EINTR);
    if (r == 0 && Clock::now() >= deadline) return false;
  }
  return true;
}

}  // namespace lockstep::dist::detail
