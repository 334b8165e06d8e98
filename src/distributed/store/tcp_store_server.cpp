// TCPStoreServer: one poll() thread, parked waiters, protocol violations close one connection.
#include "distributed/store/tcp_store_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "lockstep/base/log.h"

namespace lockstep::dist::detail {

namespace {
constexpr int kListenBacklog = 1024;
// Reads per connection per poll round, so one fast sender cannot starve the rest.
constexpr size_t kReadChunk = 64 << 10;
constexpr size_t kMaxReadPerRound = 1 << 20;
// Unread request bytes buffered per connection: one largest frame.
constexpr size_t kMaxBuffered = kHeaderBytes + kMaxPayloadBytes;
// A connection whose replies pile up unread gets no more requests served until it reads them.
constexpr size_t kOutHighWater = 4 << 20;
// After accept() fails for lack of descriptors, stop accepting for this long (else poll spins).
constexpr std::chrono::milliseconds kAcceptPause{100};
constexpr int kAcceptsPerRound = 64;
// Note [Store under attack]: how often connections closed for it are reported.
constexpr std::chrono::seconds kReportInterval{60};

// Token comparison whose time does not depend on where the first difference is.
bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::vector<uint8_t> status_frame(Status s) {
  return FrameWriter(static_cast<uint8_t>(s)).finish();
}
}  // namespace

TCPStoreServer::TCPStoreServer(uint16_t port, std::string token, TCPStoreServerOptions opts)
    : token_(std::move(token)), opts_(std::move(opts)) {
  LS_CHECK(opts_.hello_timeout.count() > 0 && opts_.stall_timeout.count() > 0,
           "store server: expected positive hello and stall timeouts, got ",
           opts_.hello_timeout.count(), " ms and ", opts_.stall_timeout.count(), " ms");
  LS_CHECK(opts_.max_unauthenticated >= 1,
           "store server: expected max_unauthenticated of at least 1, got ",
           opts_.max_unauthenticated);
  Listener l = listen_on(port, kListenBacklog, opts_.bind_address);
  listener_ = std::move(l.fd);
  port_ = l.port;
  int p[2];
  LS_SYSCHECK(::pipe2(p, O_NONBLOCK | O_CLOEXEC));
  wake_read_ = Fd(p[0]);
  wake_write_ = Fd(p[1]);
  spare_ = Fd(LS_SYSCHECK(::open("/dev/null", O_RDONLY | O_CLOEXEC)));
  thread_ = std::thread([this] { run(); });
}

TCPStoreServer::~TCPStoreServer() {
  stop_.store(true);
  const uint8_t b = 1;
  // Nothing to do if this fails: the pipe is non-blocking and a full pipe already wakes poll().
  [[maybe_unused]] ssize_t n = ::write(wake_write_.get(), &b, 1);
  if (thread_.joinable()) thread_.join();
}

int64_t TCPStoreServer::wait_for_workers(int64_t n, Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(workers_mu_);
  workers_cv_.wait_until(lock, deadline, [&] { return workers_ >= n; });
  return workers_;
}

void TCPStoreServer::run() noexcept {
  try {
    loop();
  } catch (...) {
    // Only failures of the server's own descriptors (poll, the listener) reach here: there is no
    // caller to report to, so the connections are closed and clients see the store go away.
  }
  conns_.clear();
  listener_.reset();
}

void TCPStoreServer::loop() {
  std::vector<pollfd> pfds;
  std::vector<uint64_t> ids;
  while (!stop_.load()) {
    const auto now = Clock::now();
    pfds.clear();
    ids.clear();
    pfds.push_back({wake_read_.get(), POLLIN, 0});
    pfds.push_back(
        {listener_.get(), static_cast<short>(now >= accept_paused_until_ ? POLLIN : 0), 0});
    for (auto& [id, c] : conns_) {
      short ev = 0;
      if (!c.closing && c.in.size() - c.in_off < max_buffered(c)) ev |= POLLIN;
      if (c.out_off < c.out.size()) ev |= POLLOUT;
      pfds.push_back({c.fd.get(), ev, 0});
      ids.push_back(id);
    }
    int timeout = -1;
    if (auto d = next_deadline()) timeout = poll_timeout_ms(*d);
    if (closed_hello_ + closed_cap_ + closed_stall_ + closed_no_fd_ > 0) {
      int t = poll_timeout_ms(next_report_);
      timeout = timeout < 0 ? t : std::min(timeout, t);
    }
    if (now < accept_paused_until_) {
      int t = poll_timeout_ms(accept_paused_until_);
      timeout = timeout < 0 ? t : std::min(timeout, t);
    }
    int n = LS_SYSCHECK(::poll(pfds.data(), pfds.size(), timeout), EINTR);
    if (n < 0) continue;
    if (pfds[0].revents != 0) {
      uint8_t buf[64];
      while (LS_SYSCHECK(::read(wake_read_.get(), buf, sizeof buf), EAGAIN, EINTR) > 0) {
      }
      if (stop_.load()) break;
    }
    if (pfds[1].revents & POLLIN) accept_all();
    for (size_t i = 0; i < ids.size(); ++i) {
      const short rev = pfds[i + 2].revents;
      if (rev == 0) continue;
      auto it = conns_.find(ids[i]);
      if (it == conns_.end() || it->second.dead) continue;
      Connection& c = it->second;
      try {
        if (rev & POLLNVAL) {
          c.dead = true;
          continue;
        }
        if (rev & (POLLIN | POLLHUP | POLLERR)) read_from(ids[i], c);
        if (!c.dead && (rev & POLLOUT)) {
          flush(c);
          // Frames held back while replies piled up (kOutHighWater) may be served now.
          if (!c.dead) process_frames(ids[i], c);
        }
      } catch (const Error&) {
        c.dead = true;  // a socket error on this connection only
      }
    }
    expire(Clock::now());
    // Parked requests answered this round: serve what those connections sent meanwhile.
    while (!resumed_.empty()) {
      std::vector<uint64_t> ready;
      ready.swap(resumed_);
      for (uint64_t id : ready) {
        auto it = conns_.find(id);
        if (it == conns_.end() || it->second.dead) continue;
        try {
          process_frames(id, it->second);
        } catch (const Error&) {
          it->second.dead = true;
        }
      }
    }
    reap();
    report_closed();
  }
}

void TCPStoreServer::accept_all() {
  for (int i = 0; i < kAcceptsPerRound; ++i) {
    int fd = LS_SYSCHECK(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC),
                         EAGAIN, EWOULDBLOCK, EINTR, ECONNABORTED, EPROTO, EPERM, EMFILE, ENFILE,
                         ENOBUFS, ENOMEM);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
      if (err == EMFILE || err == ENFILE) {
        // Out of descriptors: a stranger makes room; else the spare lets the connection in to be
        // closed at once (it would sit in the backlog, and poll() report it, forever).
        if (drop_oldest_stranger()) {
          note_closed(closed_no_fd_);
          continue;
        }
        if (spare_.valid()) {
          spare_.reset();
          const int f = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
          if (f >= 0) {
            ::close(f);
            note_closed(closed_no_fd_);
          }
          spare_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
          if (f >= 0) continue;
        }
      }
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM)
        accept_paused_until_ = Clock::now() + kAcceptPause;
      return;
    }
    Fd owned(fd);
    try {
      set_nodelay(fd);
    } catch (const Error&) {
      continue;  // the peer is already gone
    }
    if (strangers_.size() >= static_cast<size_t>(opts_.max_unauthenticated) &&
        drop_oldest_stranger())
      note_closed(closed_cap_);
    const uint64_t id = next_id_++;
    Connection& c = conns_[id];
    c.fd = std::move(owned);
    c.last_byte = Clock::now();
    c.hello_deadline = c.last_byte + opts_.hello_timeout;
    strangers_.insert(id);
    // A client sends its hello right after connecting: reading it now admits the client before
    // more strangers can push it out of the cap.
    try {
      read_from(id, c);
    } catch (const Error&) {
      c.dead = true;
    }
  }
}

bool TCPStoreServer::drop_oldest_stranger() {
  if (strangers_.empty()) return false;
  const uint64_t id = *strangers_.begin();
  strangers_.erase(strangers_.begin());
  conns_.erase(id);  // strangers never park a request, so nothing else refers to it
  return true;
}

void TCPStoreServer::admit(uint64_t id, Connection& c) {
  c.authed = true;
  strangers_.erase(id);
}

size_t TCPStoreServer::max_buffered(const Connection& c) const {
  return c.authed ? kMaxBuffered : kHeaderBytes + kMaxHelloBytes;
}

void TCPStoreServer::note_closed(int& counter) {
  if (closed_hello_ + closed_cap_ + closed_stall_ + closed_no_fd_ == 0 &&
      next_report_ < Clock::now())
    next_report_ = Clock::now();  // the first closing after a quiet minute is reported at once
  ++counter;
}

void TCPStoreServer::report_closed() {
  if (closed_hello_ + closed_cap_ + closed_stall_ + closed_no_fd_ == 0) return;
  const auto now = Clock::now();
  if (now < next_report_) return;
  std::string what;
  auto part = [&](int n, const std::string& why) {
    if (n > 0) what += (what.empty() ? "" : ", ") + std::to_string(n) + " " + why;
  };
  part(closed_hello_, "without a hello within " + duration_text(opts_.hello_timeout));
  part(closed_cap_, "pushed out by newer ones over the cap of " +
                        std::to_string(opts_.max_unauthenticated) + " awaiting their hello");
  part(closed_stall_, "stalled mid-frame for " + duration_text(opts_.stall_timeout));
  part(closed_no_fd_, "closed for lack of file descriptors");
  log_warning("store server on port ", port_, ": closed connections (", what,
              "); a client without the right token, a port scan or a flood: they cannot starve "
              "admitted clients, see docs/DISTRIBUTED.md, \"The store under attack\"");
  closed_hello_ = closed_cap_ = closed_stall_ = closed_no_fd_ = 0;
  next_report_ = now + kReportInterval;
}

void TCPStoreServer::read_from(uint64_t id, Connection& c) {
  size_t got = 0;
  uint8_t buf[kReadChunk];
  while (got < kMaxReadPerRound && c.in.size() - c.in_off < max_buffered(c)) {
    const size_t want = std::min(sizeof buf, max_buffered(c) - (c.in.size() - c.in_off));
    ssize_t k = LS_SYSCHECK(::recv(c.fd.get(), buf, want, 0), EAGAIN, EWOULDBLOCK, EINTR,
                            ECONNRESET, ETIMEDOUT, EPIPE);
    if (k == 0) {
      c.dead = true;  // the client hung up; a parked request goes with it
      return;
    }
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      c.dead = true;
      return;
    }
    c.in.insert(c.in.end(), buf, buf + k);
    got += static_cast<size_t>(k);
    c.last_byte = Clock::now();
  }
  process_frames(id, c);
}

void TCPStoreServer::process_frames(uint64_t id, Connection& c) {
  // Set again below only when the buffer ends in an incomplete frame; while a request is parked
  // the buffer is not looked at, and the parked request's own deadline bounds the wait.
  c.mid_frame = false;
  while (!c.pending && !c.closing && !c.dead) {
    if (c.out.size() - c.out_off >= kOutHighWater) {
      // Replies piled up: send what the socket takes, and hold further frames back (POLLOUT
      // resumes them) only if it did not take enough.
      flush(c);
      if (c.dead || c.out.size() - c.out_off >= kOutHighWater) break;
    }
    const size_t avail = c.in.size() - c.in_off;
    if (avail < kHeaderBytes) {
      c.mid_frame = avail > 0;
      break;
    }
    const uint8_t* p = c.in.data() + c.in_off;
    auto h = parse_header(p);
    // Checked before the payload arrives, so a huge or bogus length costs nothing.
    if (!h || h->opcode < 1 || h->opcode > kMaxOp || (!c.authed && h->length > kMaxHelloBytes)) {
      c.dead = true;
      return;
    }
    if (avail < kHeaderBytes + h->length) {
      c.mid_frame = true;
      break;
    }
    auto fields = parse_fields(p + kHeaderBytes, h->length);
    c.in_off += kHeaderBytes + h->length;
    if (!fields || !handle(id, c, h->opcode, *fields)) {
      c.dead = true;
      return;
    }
  }
  if (c.in_off == c.in.size()) {
    c.in.clear();
    c.in_off = 0;
  } else if (c.in_off > (1 << 20)) {
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<ptrdiff_t>(c.in_off));
    c.in_off = 0;
  }
  flush(c);
}

bool TCPStoreServer::handle(uint64_t id, Connection& c, uint8_t opcode,
                            std::vector<std::string>& f) {
  const Op op = static_cast<Op>(opcode);
  if (!c.authed && op != Op::kHello) {
    if (!token_.empty()) return false;
    admit(id, c);  // without a token, a valid first request is as good as a hello
  }
  auto ok = [] { return FrameWriter(static_cast<uint8_t>(Status::kOk)); };
  auto timeout_of = [](const std::string& field) -> std::optional<Clock::time_point> {
    auto ms = as_i64(field);
    if (!ms || *ms < 0) return std::nullopt;
    return Clock::now() + std::chrono::milliseconds(std::min(*ms, kMaxStoreTimeout.count()));
  };
  switch (op) {
    case Op::kHello: {
      if (f.size() != 2 || !as_i64(f[1])) return false;
      if (!token_.empty() && !constant_time_equal(f[0], token_)) {
        reply(c, FrameWriter(static_cast<uint8_t>(Status::kRejected))
                     .field(std::string("bad or missing token"))
                     .finish());
        c.closing = true;
        return true;
      }
      admit(id, c);
      if (*as_i64(f[1]) != 0 && !c.counted) {
        c.counted = true;
        {
          std::lock_guard<std::mutex> lock(workers_mu_);
          ++workers_;
        }
        workers_cv_.notify_all();
      }
      reply(c, ok().finish());
      return true;
    }
    case Op::kSet: {
      if (f.size() != 2) return false;
      table_.set(f[0], Bytes(f[1].begin(), f[1].end()));
      reply(c, ok().finish());
      key_changed(f[0]);
      return true;
    }
    case Op::kGet: {
      if (f.size() != 2) return false;
      auto deadline = timeout_of(f[1]);
      if (!deadline) return false;
      if (const Bytes* v = table_.find(f[0])) {
        reply(c, ok().field(*v).finish());
      } else if (*deadline <= Clock::now()) {
        reply(c, status_frame(Status::kTimeout));
      } else {
        park(id, c, Pending{true, {f[0]}, f[0], *deadline});
      }
      return true;
    }
    case Op::kAdd: {
      auto delta = f.size() == 2 ? as_i64(f[1]) : std::nullopt;
      if (!delta) return false;
      try {
        int64_t v = table_.add(f[0], *delta);
        reply(c, ok().field(v).finish());
      } catch (const Error& e) {
        reply(c, FrameWriter(static_cast<uint8_t>(Status::kError)).field(e.message()).finish());
        return true;
      }
      key_changed(f[0]);
      return true;
    }
    case Op::kCompareSet: {
      if (f.size() != 3) return false;
      Bytes v = table_.compare_set(f[0], Bytes(f[1].begin(), f[1].end()),
                                   Bytes(f[2].begin(), f[2].end()));
      reply(c, ok().field(v).finish());
      key_changed(f[0]);
      return true;
    }
    case Op::kCheck: {
      reply(c, ok().field(int64_t{table_.missing(f).empty() ? 1 : 0}).finish());
      return true;
    }
    case Op::kWait: {
      if (f.empty()) return false;
      auto deadline = timeout_of(f[0]);
      if (!deadline) return false;
      std::vector<std::string> keys(f.begin() + 1, f.end());
      auto missing = table_.missing(keys);
      if (missing.empty()) {
        reply(c, ok().finish());
      } else if (*deadline <= Clock::now()) {
        FrameWriter w(static_cast<uint8_t>(Status::kTimeout));
        for (const auto& k : missing) w.field(k);
        reply(c, std::move(w).finish());
      } else {
        park(id, c, Pending{false, std::move(keys), missing[0], *deadline});
      }
      return true;
    }
    case Op::kDelete: {
      if (f.size() != 1) return false;
      reply(c, ok().field(int64_t{table_.erase(f[0]) ? 1 : 0}).finish());
      return true;
    }
    case Op::kNumKeys: {
      if (!f.empty()) return false;
      reply(c, ok().field(table_.size()).finish());
      return true;
    }
  }
  return false;
}

void TCPStoreServer::reply(Connection& c, std::vector<uint8_t> frame) {
  if (c.out_off == c.out.size()) {
    c.out = std::move(frame);
    c.out_off = 0;
  } else {
    c.out.insert(c.out.end(), frame.begin(), frame.end());
  }
}

void TCPStoreServer::flush(Connection& c) {
  while (c.out_off < c.out.size()) {
    ssize_t k = LS_SYSCHECK(
        ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL),
        EAGAIN, EWOULDBLOCK, EINTR, EPIPE, ECONNRESET, ETIMEDOUT);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;  // POLLOUT resumes it
      c.dead = true;
      return;
    }
    c.out_off += static_cast<size_t>(k);
  }
  c.out.clear();
  c.out_off = 0;
  if (c.closing) c.dead = true;
}

void TCPStoreServer::park(uint64_t id, Connection& c, Pending p) {
  waiters_[p.registered_under].push_back(id);
  c.pending = std::move(p);
}

void TCPStoreServer::unpark(uint64_t id, Connection& c) {
  if (!c.pending) return;
  auto it = waiters_.find(c.pending->registered_under);
  if (it != waiters_.end()) {
    std::erase(it->second, id);
    if (it->second.empty()) waiters_.erase(it);
  }
  c.pending.reset();
}

void TCPStoreServer::key_changed(const std::string& key) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  std::vector<uint64_t> ids = std::move(it->second);
  waiters_.erase(it);
  for (uint64_t id : ids) {
    auto cit = conns_.find(id);
    if (cit == conns_.end() || !cit->second.pending) continue;
    Connection& c = cit->second;
    Pending& p = *c.pending;
    if (p.registered_under != key) continue;
    auto missing = table_.missing(p.keys);
    if (!missing.empty()) {
      p.registered_under = missing[0];
      waiters_[missing[0]].push_back(id);
      continue;
    }
    if (p.is_get)
      reply(c,
            FrameWriter(static_cast<uint8_t>(Status::kOk)).field(*table_.find(p.keys[0])).finish());
    else
      reply(c, status_frame(Status::kOk));
    c.pending.reset();
    flush(c);
    resumed_.push_back(id);
  }
}

void TCPStoreServer::expire(Clock::time_point now) {
  for (auto& [id, c] : conns_) {
    if (c.dead) continue;
    if (!c.authed && now >= c.hello_deadline) {
      c.dead = true;
      if (!c.closing) note_closed(closed_hello_);
      continue;
    }
    if (c.mid_frame && now >= c.last_byte + opts_.stall_timeout) {
      c.dead = true;
      note_closed(closed_stall_);
      continue;
    }
    if (!c.pending || c.pending->deadline > now || c.dead) continue;
    FrameWriter w(static_cast<uint8_t>(Status::kTimeout));
    if (!c.pending->is_get)
      for (const auto& k : table_.missing(c.pending->keys)) w.field(k);
    reply(c, std::move(w).finish());
    unpark(id, c);
    flush(c);
    resumed_.push_back(id);
  }
}

std::optional<Clock::time_point> TCPStoreServer::next_deadline() const {
  std::optional<Clock::time_point> d;
  auto consider = [&](Clock::time_point t) {
    if (!d || t < *d) d = t;
  };
  for (const auto& [id, c] : conns_) {
    if (c.pending) consider(c.pending->deadline);
    if (!c.authed) consider(c.hello_deadline);
    if (c.mid_frame) consider(c.last_byte + opts_.stall_timeout);
  }
  return d;
}

void TCPStoreServer::reap() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (it->second.dead) {
      unpark(it->first, it->second);
      strangers_.erase(it->first);
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace lockstep::dist::detail
