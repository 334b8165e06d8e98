// TCPStore alone: ports, connecting before the server exists, tokens, waiting for workers,
// shutdown, a fuzz of raw connections that must not disturb well-behaved clients, floods of
// strangers (Note [Store under attack]) and what a client that cannot connect says.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "lockstep/base/log.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using lockstep::testing::expect_error;
using namespace std::chrono_literals;

namespace {

constexpr auto kHangGuard = 60s;

std::unique_ptr<TCPStore> server(uint16_t port = 0, std::optional<std::string> token = "") {
  TCPStoreOptions o;
  o.port = port;
  o.is_server = true;
  o.token = std::move(token);
  return std::make_unique<TCPStore>(o);
}

std::unique_ptr<TCPStore> client(uint16_t port, std::optional<std::string> token = "",
                                 std::chrono::milliseconds timeout = 30s) {
  TCPStoreOptions o;
  o.port = port;
  o.token = std::move(token);
  o.timeout = timeout;
  return std::make_unique<TCPStore>(o);
}

// A port that was free a moment ago (a server picked it, then went away).
uint16_t free_port() { return server()->port(); }

// The wire format written out independently of src/distributed/store/protocol.h, from its
// Note [Store frames].
struct Frame {
  std::vector<uint8_t> bytes;
  explicit Frame(uint8_t op, uint8_t magic = 0x4C, uint8_t version = 1) {
    bytes = {magic, version, op, 0, 0, 0, 0, 0};
  }
  Frame& field(const std::string& s) {
    for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<uint8_t>(s.size() >> (8 * i)));
    bytes.insert(bytes.end(), s.begin(), s.end());
    return *this;
  }
  Frame& i64(int64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(static_cast<uint64_t>(v) >> (8 * i));
    return field(s);
  }
  std::vector<uint8_t> done() {
    const uint32_t n = static_cast<uint32_t>(bytes.size() - 8);
    for (int i = 0; i < 4; ++i) bytes[4 + i] = static_cast<uint8_t>(n >> (8 * i));
    return bytes;
  }
};
constexpr uint8_t kHello = 1, kSet = 2, kGet = 3;
constexpr uint8_t kOk = 0x80, kTimeout = 0x81;

// A plain blocking socket to the server, for speaking (or breaking) the protocol by hand.
class RawConn {
 public:
  explicit RawConn(uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    EXPECT_GE(fd_, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    timeval tv{10, 0};  // hang guard for every read
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawConn() { ::close(fd_); }
  int fd() const { return fd_; }
  void send(const std::vector<uint8_t>& b) {
    // Errors are fine: the server may already have closed us.
    [[maybe_unused]] auto n = ::send(fd_, b.data(), b.size(), MSG_NOSIGNAL);
  }
  // True when the server closed the connection (EOF or reset) before the read timeout.
  bool closed_by_server() {
    uint8_t buf[256];
    for (;;) {
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }
  // Reads one reply frame: its status byte and payload.
  std::pair<uint8_t, std::vector<uint8_t>> reply() {
    std::vector<uint8_t> h = read(8);
    if (h.size() != 8) return {0, {}};
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(h[4 + i]) << (8 * i);
    return {h[2], read(n)};
  }

 private:
  std::vector<uint8_t> read(size_t n) {
    std::vector<uint8_t> out(n);
    size_t got = 0;
    while (got < n) {
      ssize_t k = ::recv(fd_, out.data() + got, n - got, 0);
      if (k <= 0) break;
      got += static_cast<size_t>(k);
    }
    out.resize(got);
    return out;
  }
  int fd_;
};

TEST(TCPStore, PortZeroPicksARealPort) {
  auto s = server(0);
  EXPECT_GT(s->port(), 0);
  EXPECT_TRUE(s->is_server());
  s->set("k", "v");
  auto c = client(s->port());
  EXPECT_EQ(c->get_string("k"), "v");
  EXPECT_EQ(c->port(), s->port());
}

TEST(TCPStore, PortInUseIsAClearError) {
  auto s = server(0);
  const uint16_t p = s->port();
  expect_error([&] { server(p); }, {"port " + std::to_string(p) + " is already in use"});
  // The first server is unaffected.
  s->set("still", "here");
  EXPECT_EQ(client(p)->get_string("still"), "here");
}

TEST(TCPStore, ClientConnectingBeforeTheServerStartsSucceeds) {
  const uint16_t p = free_port();
  auto fut = std::async(std::launch::async, [p] {
    auto c = client(p, "", 30s);
    c->set("early", "bird");
    return c->get_string("late");
  });
  std::this_thread::sleep_for(200ms);
  auto s = server(p);
  s->set("late", "server");
  ASSERT_EQ(fut.wait_for(kHangGuard), std::future_status::ready);
  EXPECT_EQ(fut.get(), "server");
  EXPECT_EQ(s->get_string("early"), "bird");
}

TEST(TCPStore, ClientWithoutServerFailsNamingHostPortAndTimeout) {
  const uint16_t p = free_port();
  const auto start = std::chrono::steady_clock::now();
  expect_error([&] { client(p, "", 300ms); },
               {"127.0.0.1:" + std::to_string(p), "300 ms", "could not connect"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, kHangGuard);
  expect_error(
      [] {
        TCPStoreOptions o;
        o.port = 0;
        TCPStore c(o);
      },
      {"expected the server's port, got 0"});
}

TEST(TCPStore, TokenIsRequiredWhenTheServerHasOne) {
  auto s = server(0, "s3cret");
  const uint16_t p = s->port();
  s->set("guarded", "v");
  EXPECT_EQ(client(p, "s3cret")->get_string("guarded"), "v");
  expect_error([&] { client(p, "wrong"); },
               {"store rejected the connection: bad or missing token"});
  expect_error([&] { client(p, ""); }, {"store rejected the connection: bad or missing token"});
  // Its own type: a definite answer that a caller retrying its connection stops at.
  EXPECT_THROW(client(p, "wrong"), StoreTokenRejected);
  // From the environment when the option is unset.
  ::setenv(kStoreTokenEnv, "s3cret", 1);
  EXPECT_EQ(client(p, std::nullopt)->get_string("guarded"), "v");
  ::setenv(kStoreTokenEnv, "nope", 1);
  expect_error([&] { client(p, std::nullopt); }, {"bad or missing token"});
  ::unsetenv(kStoreTokenEnv);
  // A raw connection that skips the hello is closed, and what it sent is not applied.
  RawConn raw(p);
  raw.send(Frame(kSet).field("guarded").field("overwritten").done());
  EXPECT_TRUE(raw.closed_by_server());
  RawConn raw2(p);
  raw2.send(Frame(kHello).field("bad").i64(1).done());
  EXPECT_EQ(raw2.reply().first, 0x83);  // rejected, then closed
  EXPECT_TRUE(raw2.closed_by_server());
  EXPECT_EQ(s->get_string("guarded"), "v");
}

TEST(TCPStore, ServerWaitsForWorkers) {
  const uint16_t p = free_port();
  auto fut = std::async(std::launch::async, [p] {
    TCPStoreOptions o;
    o.port = p;
    o.is_server = true;
    o.token = "";
    o.num_workers = 3;
    o.timeout = 30s;
    return std::make_unique<TCPStore>(o);
  });
  auto c1 = client(p), c2 = client(p);
  ASSERT_EQ(fut.wait_for(kHangGuard), std::future_status::ready);
  auto s = fut.get();
  s->set("ready", "1");
  EXPECT_EQ(c2->get_string("ready"), "1");

  TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.token = "";
  o.num_workers = 2;
  o.timeout = 500ms;
  expect_error([&] { TCPStore lonely(o); }, {"waiting for workers", "1 of 2"});
}

TEST(TCPStore, ServerShutdownFailsABlockedClient) {
  auto s = server(0);
  auto c = client(s->port());
  auto fut = std::async(std::launch::async, [&] {
    try {
      c->get("never");
      return std::string("returned");
    } catch (const Error& e) {
      return std::string(e.what());
    }
  });
  std::this_thread::sleep_for(100ms);
  s.reset();
  ASSERT_EQ(fut.wait_for(kHangGuard), std::future_status::ready);
  EXPECT_THAT(fut.get(), ::testing::HasSubstr("lost the connection to the store"));
}

TEST(TCPStore, RequestsFromOneConnectionAreAnsweredInOrder) {
  auto s = server(0);
  RawConn raw(s->port());
  raw.send(Frame(kHello).field("").i64(0).done());
  EXPECT_EQ(raw.reply().first, kOk);
  // A parked get, then a set pipelined behind it: the get's timeout reply must come first.
  auto get = Frame(kGet).field("absent").i64(100).done();
  auto set = Frame(kSet).field("after").field("1").done();
  get.insert(get.end(), set.begin(), set.end());
  raw.send(get);
  EXPECT_EQ(raw.reply().first, kTimeout);
  EXPECT_EQ(raw.reply().first, kOk);
  EXPECT_EQ(s->get_string("after"), "1");
  // A parked get answered by another client's set.
  raw.send(Frame(kGet).field("soon").i64(30000).done());
  s->set("soon", "value");
  auto r = raw.reply();
  EXPECT_EQ(r.first, kOk);
  EXPECT_EQ(r.second, (std::vector<uint8_t>{5, 0, 0, 0, 'v', 'a', 'l', 'u', 'e'}));
}

TEST(TCPStore, PipelinedRequestsWhoseRepliesPileUpAreAllServed) {
  // 48 MiB of replies requested before reading any: the server holds frames back while replies
  // pile up and must resume them as the client reads.
  auto s = server(0);
  const std::string value(1 << 20, 'v');
  s->set("big", value);
  RawConn raw(s->port());
  raw.send(Frame(kHello).field("").i64(0).done());
  EXPECT_EQ(raw.reply().first, kOk);
  constexpr int kRequests = 48;
  std::vector<uint8_t> burst;
  for (int i = 0; i < kRequests; ++i) {
    auto f = Frame(kGet).field("big").i64(1000).done();
    burst.insert(burst.end(), f.begin(), f.end());
  }
  raw.send(burst);
  std::this_thread::sleep_for(100ms);
  for (int i = 0; i < kRequests; ++i) {
    auto r = raw.reply();
    ASSERT_EQ(r.first, kOk) << "reply " << i;
    ASSERT_EQ(r.second.size(), 4 + value.size()) << "reply " << i;
  }
}

// Frames that break the protocol in each way the server must refuse.
std::vector<std::vector<uint8_t>> malformed_frames(std::mt19937& rng) {
  std::vector<std::vector<uint8_t>> out;
  auto random_bytes = [&](size_t n) {
    std::vector<uint8_t> b(n);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    return b;
  };
  out.push_back(random_bytes(1 + rng() % 4096));                            // noise
  out.push_back({0x4C, 1, kSet, 0, 0xFF, 0xFF, 0xFF, 0x7F});                // ~2 GiB length
  out.push_back({0x4C, 1, kSet, 0, 0x01, 0x00, 0x00, 0x04});                // 64 MiB + 1
  out.push_back(Frame(0).field("k").done());                                // opcode 0
  out.push_back(Frame(77).field("k").done());                               // unknown opcode
  out.push_back(Frame(0x80).done());                                        // a reply opcode
  out.push_back(Frame(kSet, 0x4C, 2).field("keep/0").field("bad").done());  // wrong version
  out.push_back(Frame(kSet, 0x00, 1).field("keep/0").field("bad").done());  // wrong magic
  out.push_back(Frame(kSet).field("keep/0").done());                        // too few fields
  out.push_back(Frame(kGet).field("keep/0").field("notanumber").done());    // bad timeout field
  out.push_back(Frame(kGet).field("keep/0").i64(-5).done());                // negative timeout
  auto lying = Frame(kSet).field("keep/0").field("bad").done();
  lying[8] = 0xF0;  // a field length past the end of the payload
  out.push_back(lying);
  auto reserved = Frame(kSet).field("keep/0").field("bad").done();
  reserved[3] = 1;
  out.push_back(reserved);
  return out;
}

TEST(TCPStore, FuzzedConnectionsAreClosedAndOthersKeepBeingServed) {
  auto s = server(0);
  const uint16_t p = s->port();
  auto good = client(p);
  for (int i = 0; i < 8; ++i) good->set("keep/" + std::to_string(i), "value" + std::to_string(i));
  const int64_t keys_before = good->num_keys();

  std::mt19937 rng(1234);
  // Each malformed frame, after a valid hello and without one: the server closes the connection.
  for (bool hello : {false, true}) {
    for (auto& frame : malformed_frames(rng)) {
      RawConn raw(p);
      if (hello) {
        raw.send(Frame(kHello).field("").i64(0).done());
        EXPECT_EQ(raw.reply().first, kOk);
      }
      raw.send(frame);
      EXPECT_TRUE(raw.closed_by_server()) << "frame of " << frame.size() << " bytes, opcode "
                                          << int(frame.size() > 2 ? frame[2] : 0);
    }
  }
  // Connections left half-way (a truncated frame, a parked get) must not stall the server.
  std::vector<std::unique_ptr<RawConn>> stuck;
  for (int i = 0; i < 20; ++i) {
    auto raw = std::make_unique<RawConn>(p);
    raw->send(Frame(kHello).field("").i64(0).done());
    auto frame = Frame(kSet).field("keep/1").field(std::string(1000, 'x')).done();
    frame.resize(8 + rng() % (frame.size() - 8));  // truncated
    raw->send(frame);
    stuck.push_back(std::move(raw));
  }
  for (int i = 0; i < 10; ++i) {
    auto raw = std::make_unique<RawConn>(p);
    raw->send(Frame(kHello).field("").i64(0).done());
    raw->send(Frame(kGet).field("parked/" + std::to_string(i)).i64(60000).done());
    stuck.push_back(std::move(raw));
  }
  // Random garbage from many connections at once, some hanging up mid-frame.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([p, t] {
      std::mt19937 r(100 + t);
      for (int i = 0; i < 50; ++i) {
        RawConn raw(p);
        auto frames = malformed_frames(r);
        raw.send(frames[r() % frames.size()]);
        if (r() % 2) raw.closed_by_server();
      }
    });
  }
  // The well-behaved client is served throughout.
  for (int i = 0; i < 200; ++i) EXPECT_EQ(good->add("progress", 1), i + 1);
  for (auto& t : threads) t.join();
  // Parked waiters whose connections go away are forgotten without harm.
  stuck.resize(20);
  for (int i = 0; i < 10; ++i) s->set("parked/" + std::to_string(i), "x");

  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(good->get_string("keep/" + std::to_string(i)), "value" + std::to_string(i));
  EXPECT_EQ(good->num_keys(), keys_before + 1 + 10);  // "progress" and the parked keys only
  auto fresh = client(p);
  fresh->set("fresh", "ok");
  EXPECT_EQ(good->get_string("fresh"), "ok");
  stuck.clear();
}

TEST(TCPStore, ClientReconnectsAfterItsConnectionBroke) {
  auto s = server(0);
  const uint16_t p = s->port();
  auto c = client(p, "", 5s);
  c->set("a", "1");
  // Restart the server on the same port: the old connection is gone, the next-but-one request
  // (the first one finds the broken connection) reconnects.
  s.reset();
  s = server(p);
  try {
    c->set("b", "2");
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), ::testing::HasSubstr("lost the connection"));
  }
  c->set("b", "2");
  EXPECT_EQ(s->get_string("b"), "2");
}

// Note [Store under attack]: strangers (connections without a valid hello) are bounded in time,
// number and size; admitted clients are served throughout.
constexpr const char* kToken = "t0ken";

std::unique_ptr<TCPStore> guarded_server(TCPStoreServerOptions limits) {
  TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.token = kToken;
  o.server = std::move(limits);
  return std::make_unique<TCPStore>(o);
}

std::vector<uint8_t> hello_frame() { return Frame(kHello).field(kToken).i64(0).done(); }

// How many of `conns` the server closes before `deadline` (polling them all at once); it may
// stop counting once `enough` are.
size_t count_closed(const std::vector<std::unique_ptr<RawConn>>& conns,
                    std::chrono::steady_clock::time_point deadline, size_t enough = SIZE_MAX) {
  std::set<size_t> closed;
  while (closed.size() < std::min(enough, conns.size()) &&
         std::chrono::steady_clock::now() < deadline) {
    std::vector<pollfd> pfds;
    std::vector<size_t> which;
    for (size_t i = 0; i < conns.size(); ++i) {
      if (closed.count(i)) continue;
      pfds.push_back({conns[i]->fd(), POLLIN, 0});
      which.push_back(i);
    }
    if (::poll(pfds.data(), pfds.size(), 100) <= 0) continue;
    for (size_t k = 0; k < pfds.size(); ++k) {
      if (pfds[k].revents == 0) continue;
      uint8_t buf[256];
      ssize_t n = ::recv(pfds[k].fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) closed.insert(which[k]);
    }
  }
  return closed.size();
}

TEST(TCPStoreUnderAttack, StrangersAreClosedAtTheHelloDeadlineAdmittedIdleClientsAreNot) {
  TCPStoreServerOptions limits;
  limits.hello_timeout = 300ms;
  auto s = guarded_server(limits);
  const uint16_t p = s->port();
  RawConn admitted(p);
  admitted.send(hello_frame());
  ASSERT_EQ(admitted.reply().first, kOk);
  auto c = client(p, kToken);

  const auto hello = hello_frame();
  RawConn idle(p);
  RawConn half(p);
  half.send({hello.begin(), hello.begin() + 5});
  // A byte every 50 ms never stalls, and never finishes its hello in time either.
  RawConn trickle(p);
  auto trickler = std::async(std::launch::async, [&] {
    for (size_t i = 0; i + 1 < hello.size(); ++i) {
      trickle.send({hello[i]});
      std::this_thread::sleep_for(50ms);
    }
  });
  EXPECT_TRUE(idle.closed_by_server());
  EXPECT_TRUE(half.closed_by_server());
  EXPECT_TRUE(trickle.closed_by_server());
  trickler.wait();
  // Idle far past the hello deadline, the admitted connections are still served.
  std::this_thread::sleep_for(500ms);
  admitted.send(Frame(kSet).field("k").field("v").done());
  EXPECT_EQ(admitted.reply().first, kOk);
  EXPECT_EQ(c->get_string("k"), "v");
}

TEST(TCPStoreUnderAttack, AConnectionStalledMidFrameIsClosedASlowOneIsNot) {
  TCPStoreServerOptions limits;
  limits.stall_timeout = 1s;
  auto s = guarded_server(limits);
  const uint16_t p = s->port();
  RawConn idle(p), stalled(p), slow(p);
  for (RawConn* r : {&idle, &stalled, &slow}) {
    r->send(hello_frame());
    ASSERT_EQ(r->reply().first, kOk);
  }
  const auto set = Frame(kSet).field("slow").field(std::string(100, 'x')).done();
  stalled.send({set.begin(), set.begin() + 20});
  // 10 bytes every 100 ms: over a second for the frame, but never a second without progress.
  for (size_t at = 0; at < set.size(); at += 10) {
    slow.send({set.begin() + at, set.begin() + std::min(at + 10, set.size())});
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(slow.reply().first, kOk);
  EXPECT_EQ(s->get_string("slow"), std::string(100, 'x'));
  EXPECT_TRUE(stalled.closed_by_server());
  idle.send(Frame(kSet).field("idle").field("ok").done());
  EXPECT_EQ(idle.reply().first, kOk);
}

TEST(TCPStoreUnderAttack, TheCapOnStrangersClosesTheOldestFirst) {
  TCPStoreServerOptions limits;
  limits.max_unauthenticated = 4;
  limits.hello_timeout = 60s;  // only the cap closes anything here
  auto s = guarded_server(limits);
  const uint16_t p = s->port();
  std::vector<std::unique_ptr<RawConn>> conns;
  for (int i = 0; i < 6; ++i) conns.push_back(std::make_unique<RawConn>(p));
  EXPECT_TRUE(conns[0]->closed_by_server());
  EXPECT_TRUE(conns[1]->closed_by_server());
  for (int i = 2; i < 6; ++i) {
    conns[i]->send(hello_frame());
    EXPECT_EQ(conns[i]->reply().first, kOk) << "connection " << i;
  }
  // A stranger's frame is small: a hello-sized header over the limit closes it at once.
  RawConn big(p);
  big.send({0x4C, 1, kHello, 0, 0x01, 0x20, 0x00, 0x00});  // 8 KiB + 1
  EXPECT_TRUE(big.closed_by_server());
}

TEST(TCPStoreUnderAttack, AFloodOfIdleAndSlowConnectionsDoesNotStarveAdmittedClients) {
  TCPStoreServerOptions limits;
  limits.hello_timeout = 1s;
  limits.stall_timeout = 1s;
  auto s = guarded_server(limits);
  const uint16_t p = s->port();
  auto c = client(p, kToken);
  constexpr int kFlood = 1000, kSlow = 8;
  std::vector<std::unique_ptr<RawConn>> flood;
  auto flooder = std::async(std::launch::async, [&] {
    const auto hello = hello_frame();
    for (int i = 0; i < kFlood; ++i) {
      flood.push_back(std::make_unique<RawConn>(p));
      if (i % 10 == 0) flood.back()->send({hello.begin(), hello.begin() + 9});  // half a hello
    }
  });
  std::atomic<bool> stop{false};
  std::vector<std::thread> slow;
  for (int t = 0; t < kSlow; ++t) {
    slow.emplace_back([&] {
      const auto hello = hello_frame();
      while (!stop.load()) {
        RawConn r(p);
        for (size_t i = 0; i + 1 < hello.size() && !stop.load(); ++i) {
          r.send({hello[i]});
          std::this_thread::sleep_for(100ms);
        }
      }
    });
  }
  // The admitted client keeps working, and a new one gets in during the flood.
  for (int i = 0; i < 300; ++i) {
    const std::string k = "flood/" + std::to_string(i);
    c->set(k, std::to_string(i));
    c->wait({k}, 10s);
    EXPECT_EQ(c->get_string(k), std::to_string(i));
    EXPECT_EQ(c->add("count", 1), i + 1);
    if (i == 150) EXPECT_EQ(client(p, kToken, 30s)->get_string("flood/0"), "0");
  }
  ASSERT_EQ(flooder.wait_for(kHangGuard), std::future_status::ready);
  flooder.get();
  // Every flood connection is closed: by the cap, or at the hello deadline.
  EXPECT_EQ(count_closed(flood, std::chrono::steady_clock::now() + 30s), flood.size());
  stop.store(true);
  for (auto& t : slow) t.join();
  EXPECT_EQ(client(p, kToken)->add("count", 0), 300);
}

// A client that cannot connect logs why while it retries, and fails naming the cause.
struct CapturedLog {
  std::mutex mu;
  std::string text;
  CapturedLog() {
    set_log_sink([this](LogLevel, std::string_view t) {
      std::lock_guard<std::mutex> lock(mu);
      text += t;
    });
  }
  ~CapturedLog() { set_log_sink(nullptr); }
  std::string get() {
    std::lock_guard<std::mutex> lock(mu);
    return text;
  }
};

// What the server closed for Note [Store under attack] is said in one warning (at once for the
// first closing after a quiet minute), naming why.
TEST(TCPStoreUnderAttack, ClosedStrangersAreReportedByAWarning) {
  CapturedLog log;  // outlives the server, whose thread logs
  TCPStoreServerOptions limits;
  limits.hello_timeout = 200ms;
  auto s = guarded_server(limits);
  RawConn idle(s->port());
  EXPECT_TRUE(idle.closed_by_server());
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (log.get().find("closed connections") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(20ms);
  EXPECT_THAT(log.get(), ::testing::HasSubstr("closed connections (1 without a hello within "
                                              "200 ms)"));
  EXPECT_THAT(log.get(), ::testing::HasSubstr("\"The store under attack\""));
}

TEST(TCPStoreConnect, AClientWithNoServerLogsTheCauseWhileWaitingAndFailsNamingIt) {
  CapturedLog log;
  const uint16_t p = free_port();
  const std::string where = "127.0.0.1:" + std::to_string(p);
  expect_error([&] { client(p, "", 2500ms); }, {"could not connect to the store at " + where,
                                                "within 2.5 s", "last cause: connection refused"});
  EXPECT_THAT(log.get(), ::testing::HasSubstr("waiting for the store at " + where +
                                              ": connection refused (nothing listens there yet) "
                                              "(attempt "));
  EXPECT_THAT(log.get(), ::testing::HasSubstr(" of 2.5 s)"));
}

TEST(TCPStoreConnect, ANameThatDoesNotResolveIsReportedAsSuch) {
  CapturedLog log;
  TCPStoreOptions o;
  o.host = "garbage..host";
  o.port = 29500;
  o.token = "";
  o.timeout = 1500ms;
  expect_error([&] { TCPStore c(o); },
               {"could not connect to the store at garbage..host:29500 within 1.5 s",
                "last cause: name", "(getaddrinfo: "});
  EXPECT_THAT(log.get(),
              ::testing::HasSubstr("waiting for the store at garbage..host:29500: name"));
}

TEST(TCPStoreConnect, AServerBoundToOneAddressIsReachedThere) {
  TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.token = "";
  o.server.bind_address = "127.0.0.1";
  TCPStore s(o);
  s.set("bound", "yes");
  EXPECT_EQ(client(s.port())->get_string("bound"), "yes");
  o.server.bind_address = "192.0.2.1";  // TEST-NET-1: never an address of this machine
  expect_error([&] { TCPStore t(o); }, {"cannot listen on 192.0.2.1", "not an address"});
}

// Real processes over TCP: the test binary re-runs itself as worker processes, each connecting
// to the parent's server through the environment. A worker runs from a static initializer and
// exits before GoogleTest starts, so it is not a test of its own.
constexpr const char* kWorkerPortEnv = "LOCKSTEP_TEST_STORE_PORT";
constexpr const char* kWorkerRankEnv = "LOCKSTEP_TEST_STORE_RANK";
constexpr int kProcesses = 4, kProcessAdds = 200;

// Adds to a shared counter, then waits for every worker (a barrier across processes) and checks
// the total. Exit code 0 on success, 1 with a message on stderr otherwise.
int run_worker(const char* port, const char* rank) {
  try {
    auto c = client(static_cast<uint16_t>(std::atoi(port)), std::nullopt, 30s);
    for (int i = 0; i < kProcessAdds; ++i) c->add("total", 1);
    c->set(std::string("done/") + rank, rank);
    std::vector<std::string> keys;
    for (int r = 0; r < kProcesses; ++r) keys.push_back("done/" + std::to_string(r));
    c->wait(keys, 30s);
    const std::string total = c->get_string("total");
    if (total != std::to_string(kProcesses * kProcessAdds)) {
      std::fprintf(stderr, "worker %s: total %s, expected %d\n", rank, total.c_str(),
                   kProcesses * kProcessAdds);
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker %s: %s\n", rank, e.what());
    return 1;
  }
}

[[maybe_unused]] const bool kRanAsWorker = [] {
  const char* port = std::getenv(kWorkerPortEnv);
  const char* rank = std::getenv(kWorkerRankEnv);
  if (port == nullptr || rank == nullptr) return false;
  std::exit(run_worker(port, rank));
}();

TEST(TCPStoreProcess, ProcessesShareOneServer) {
  auto s = server(0, "proc-token");
  std::string exe(4096, '\0');
  ssize_t n = ::readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  ASSERT_GT(n, 0);
  exe.resize(static_cast<size_t>(n));
  std::vector<pid_t> pids;
  for (int r = 0; r < kProcesses; ++r) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    env_strings.push_back(std::string(kWorkerPortEnv) + "=" + std::to_string(s->port()));
    env_strings.push_back(std::string(kWorkerRankEnv) + "=" + std::to_string(r));
    env_strings.push_back(std::string(kStoreTokenEnv) + "=proc-token");
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<char*> argv = {exe.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data()), 0);
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "worker " << pid << " failed";
  }
  EXPECT_EQ(s->get_string("total"), std::to_string(kProcesses * kProcessAdds));
}

// A server in a process with few descriptors (RLIMIT_NOFILE), flooded by strangers: accept()
// fails with EMFILE, and the server must close strangers to let a client with the token in.
// The server runs in a forked child (this test's process has no other threads then), which
// writes its port to `port_out` and serves until `stop_in` reaches end of file.
[[noreturn]] void serve_with_few_descriptors(int nofile, int port_out, int stop_in) {
  int code = 0;
  // Nothing is formatted while the descriptor table is full: the sanitizer build's vptr check
  // (UBSan) reads memory through a new pipe on a cache miss, and with no descriptor left it takes
  // a good object for a bad one and stops the process. The server's warning about what it closed
  // is tested where descriptors are to spare (ClosedStrangersAreReportedByAWarning).
  set_log_level(LogLevel::kError);
  try {
    rlimit r{};
    ::getrlimit(RLIMIT_NOFILE, &r);
    r.rlim_cur = static_cast<rlim_t>(nofile);
    LS_CHECK(::setrlimit(RLIMIT_NOFILE, &r) == 0, "setrlimit");
    TCPStoreOptions o;
    o.port = 0;
    o.is_server = true;
    o.token = kToken;
    o.server.hello_timeout = 60s;         // neither the deadline
    o.server.max_unauthenticated = 1000;  // nor the cap closes anything here
    {
      TCPStore s(o);
      const std::string line = std::to_string(s.port()) + "\n";
      LS_CHECK(::write(port_out, line.data(), line.size()) == static_cast<ssize_t>(line.size()),
               "writing the port");
      ::close(port_out);
      char b = 0;
      while (::read(stop_in, &b, 1) > 0) {
      }  // until the parent closes its end
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store server: %s\n", e.what());
    code = 1;
  }
  std::fflush(stderr);
  ::_exit(code);
}

TEST(TCPStoreProcess, AServerOutOfDescriptorsClosesStrangersToAdmitAClient) {
  int out[2], in[2];
  ASSERT_EQ(::pipe2(out, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(in, O_CLOEXEC), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(out[0]);
    ::close(in[1]);
    serve_with_few_descriptors(48, out[1], in[0]);
  }
  ::close(in[0]);
  ::close(out[1]);
  std::string line;
  pollfd pf{out[0], POLLIN, 0};
  char ch = 0;
  while (::poll(&pf, 1, 30000) > 0 && ::read(out[0], &ch, 1) == 1 && ch != '\n') line += ch;
  ::close(out[0]);
  const int port = std::atoi(line.c_str());
  ASSERT_GT(port, 0) << "the server process printed '" << line << "'";
  {
    // Four times what the server can hold: without closing strangers it could accept no more.
    std::vector<std::unique_ptr<RawConn>> flood;
    for (int i = 0; i < 200; ++i) flood.push_back(std::make_unique<RawConn>(port));
    auto c = client(static_cast<uint16_t>(port), kToken, 20s);
    c->set("got", "in");
    EXPECT_EQ(c->get_string("got"), "in");
    EXPECT_GE(count_closed(flood, std::chrono::steady_clock::now() + 10s, 100), size_t{100});
  }
  ::close(in[1]);  // the server process exits
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

}  // namespace
