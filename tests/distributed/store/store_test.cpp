// Every Store operation on HashStore, PrefixStore and TCPStore through one typed suite: values,
// counters, compare_set, blocking get/wait, timeouts, and many threads at once.
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "lockstep/distributed/store/hash_store.h"
#include "lockstep/distributed/store/prefix_store.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using lockstep::testing::expect_error;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

namespace {

// Generous bound on anything that should finish promptly: only a hang trips it.
constexpr auto kHangGuard = 60s;

// Blocking calls use this timeout unless a test sets its own, so that a store which never wakes
// a waiter fails the test instead of hanging it for the default five minutes.
constexpr auto kTestTimeout = 30s;

// A rank as a thread. join() returns what it threw, so a failing rank fails its test instead of
// terminating the test binary.
class Rank {
 public:
  explicit Rank(std::function<void()> fn)
      : thread_([this, fn = std::move(fn)] {
          try {
            fn();
          } catch (const std::exception& e) {
            error_ = e.what();
          }
        }) {}
  std::string join() {
    thread_.join();
    return error_;
  }

 private:
  std::string error_;  // declared first: the thread may write it as soon as it starts
  std::thread thread_;
};

// Each backend hands out handles to one shared store: connect() is what another rank would do.
struct HashBackend {
  std::shared_ptr<HashStore> store = std::make_shared<HashStore>(kTestTimeout);
  std::shared_ptr<Store> connect() { return store; }
};

struct PrefixBackend {
  std::shared_ptr<HashStore> inner = std::make_shared<HashStore>(kTestTimeout);
  std::shared_ptr<Store> connect() { return std::make_shared<PrefixStore>("job", inner); }
};

struct TcpBackend {
  TcpBackend() {
    TCPStoreOptions o;
    o.port = 0;
    o.is_server = true;
    o.token = "";
    o.timeout = kTestTimeout;
    server = std::make_shared<TCPStore>(o);
  }
  std::shared_ptr<Store> connect() {
    TCPStoreOptions o;
    o.port = server->port();
    o.token = "";
    o.timeout = kTestTimeout;
    return std::make_shared<TCPStore>(o);
  }
  std::shared_ptr<TCPStore> server;
};

template <typename Backend>
class StoreTest : public ::testing::Test {
 protected:
  Backend backend_;
  std::shared_ptr<Store> store_ = backend_.connect();
};

using Backends = ::testing::Types<HashBackend, PrefixBackend, TcpBackend>;
class BackendNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    if (std::is_same_v<T, HashBackend>) return "HashStore";
    if (std::is_same_v<T, PrefixBackend>) return "PrefixStore";
    return "TCPStore";
  }
};
TYPED_TEST_SUITE(StoreTest, Backends, BackendNames);

TYPED_TEST(StoreTest, SetThenGetReturnsTheBytes) {
  Store& s = *this->store_;
  const Bytes binary = {0, 1, 2, 255, 0, 128};
  s.set("bin", binary);
  EXPECT_EQ(s.get("bin"), binary);
  s.set("empty", Bytes{});
  EXPECT_EQ(s.get("empty"), Bytes{});
  s.set("text", "hello");
  EXPECT_EQ(s.get_string("text"), "hello");
  s.set("text", std::string("again"));  // overwrite
  EXPECT_EQ(s.get_string("text"), "again");
  // Another handle (another rank) sees the same values.
  auto other = this->backend_.connect();
  EXPECT_EQ(other->get("bin"), binary);
  EXPECT_EQ(other->get_string("text"), "again");
}

TYPED_TEST(StoreTest, LargeValueRoundTrips) {
  Bytes big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7 + (i >> 11));
  this->store_->set("big", big);
  EXPECT_EQ(this->backend_.connect()->get("big"), big);
}

TYPED_TEST(StoreTest, AddKeepsADecimalCounter) {
  Store& s = *this->store_;
  EXPECT_EQ(s.add("c", 5), 5);  // a missing key counts as 0
  EXPECT_EQ(s.add("c", -7), -2);
  EXPECT_EQ(s.add("c", 0), -2);
  EXPECT_EQ(s.get_string("c"), "-2");
  s.set("c2", "40");
  EXPECT_EQ(s.add("c2", 2), 42);
  s.set("word", "forty");
  expect_error([&] { s.add("word", 1); }, {"word", "decimal integer", "forty"});
  EXPECT_EQ(s.get_string("word"), "forty");
  s.set("huge", std::to_string(INT64_MAX));
  expect_error([&] { s.add("huge", 1); }, {"overflow"});
}

TYPED_TEST(StoreTest, CompareSetFollowsPyTorch) {
  Store& s = *this->store_;
  // Missing key, non-empty expected: nothing is set, the expected value comes back.
  EXPECT_EQ(s.compare_set("k", "x", "y"), "x");
  EXPECT_FALSE(s.check({"k"}));
  // Missing key, empty expected: set.
  EXPECT_EQ(s.compare_set("k", "", "first"), "first");
  EXPECT_EQ(s.get_string("k"), "first");
  // Mismatch: unchanged, the current value comes back.
  EXPECT_EQ(s.compare_set("k", "nope", "second"), "first");
  EXPECT_EQ(s.get_string("k"), "first");
  // Match: swapped.
  EXPECT_EQ(s.compare_set("k", "first", "second"), "second");
  EXPECT_EQ(s.get_string("k"), "second");
  const Bytes b1 = {1, 0, 1}, b2 = {2, 0, 2};
  s.set("b", b1);
  EXPECT_EQ(s.compare_set("b", b1, b2), b2);
}

TYPED_TEST(StoreTest, CheckDeleteAndNumKeys) {
  Store& s = *this->store_;
  const int64_t base = s.num_keys();
  EXPECT_TRUE(s.check({}));
  EXPECT_FALSE(s.check({"a"}));
  s.set("a", "1");
  s.set("b", "2");
  EXPECT_TRUE(s.check({"a", "b"}));
  EXPECT_FALSE(s.check({"a", "b", "c"}));
  EXPECT_EQ(s.num_keys(), base + 2);
  EXPECT_TRUE(s.delete_key("a"));
  EXPECT_FALSE(s.delete_key("a"));
  EXPECT_FALSE(s.check({"a"}));
  EXPECT_EQ(s.num_keys(), base + 1);
  s.set_timeout(50ms);
  expect_error([&] { s.get("a"); }, {"\"", "a\"", "50 ms"});
}

TYPED_TEST(StoreTest, GetBlocksUntilAnotherThreadSetsTheKey) {
  auto waiter = this->backend_.connect();
  std::atomic<bool> returned{false};
  std::string got;
  Rank t([&] {
    got = waiter->get_string("late");
    returned = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(returned.load()) << "get() returned before the key was set";
  this->store_->set("late", "here");
  EXPECT_EQ(t.join(), "");
  EXPECT_TRUE(returned.load());
  EXPECT_EQ(got, "here");
}

TYPED_TEST(StoreTest, GetTimesOutNamingTheKeyAndTimeout) {
  Store& s = *this->store_;
  s.set_timeout(150ms);
  EXPECT_EQ(s.timeout(), 150ms);
  const auto start = std::chrono::steady_clock::now();
  expect_error([&] { s.get("never"); }, {"never\"", "timed out", "150 ms"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, kHangGuard);
  // The store still works after a timeout (the connection stays in step).
  s.set("after", "ok");
  EXPECT_EQ(s.get_string("after"), "ok");
}

TYPED_TEST(StoreTest, WaitTimesOutNamingOnlyTheMissingKeys) {
  Store& s = *this->store_;
  s.set("alpha", "1");
  const auto start = std::chrono::steady_clock::now();
  try {
    s.wait({"alpha", "beta", "gamma"}, 120ms);
    ADD_FAILURE() << "expected a timeout";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("120 ms"));
    EXPECT_THAT(msg, HasSubstr("beta\""));
    EXPECT_THAT(msg, HasSubstr("gamma\""));
    EXPECT_THAT(msg, Not(HasSubstr("alpha\"")));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, kHangGuard);
  s.wait({"alpha"}, 0ms);  // present keys: no wait even with a zero timeout
  s.set_timeout(100ms);
  expect_error([&] { s.wait({"beta"}); }, {"beta\"", "100 ms"});
}

TYPED_TEST(StoreTest, HugeTimeoutsAreClampedAndNegativeOnesRefused) {
  Store& s = *this->store_;
  s.set_timeout(std::chrono::hours(24 * 365 * 1000));
  EXPECT_EQ(s.timeout(), kMaxStoreTimeout);
  s.set("k", "v");
  EXPECT_EQ(s.get_string("k"), "v");  // deadlines from the clamped timeout do not overflow
  s.wait({"k"}, std::chrono::milliseconds::max());
  expect_error([&] { s.wait({"k"}, -1ms); }, {"expected a timeout >= 0 ms", "-1"});
}

TYPED_TEST(StoreTest, WaitReturnsOnceEveryKeyIsSet) {
  auto waiter = this->backend_.connect();
  std::atomic<bool> returned{false};
  Rank t([&] {
    waiter->wait({"x", "y", "z"}, 30s);
    returned = true;
  });
  this->store_->set("x", "1");
  this->store_->add("y", 1);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(returned.load()) << "wait() returned with z missing";
  EXPECT_EQ(this->store_->compare_set("z", "", "3"), "3");
  EXPECT_EQ(t.join(), "");
  EXPECT_TRUE(returned.load());
}

TYPED_TEST(StoreTest, ConcurrentAddsFromManyClientsAreExact) {
  constexpr int kThreads = 8, kAdds = 1000;
  std::vector<std::unique_ptr<Rank>> threads;
  std::vector<int64_t> last(kThreads);
  for (int r = 0; r < kThreads; ++r) {
    threads.push_back(std::make_unique<Rank>([&, r] {
      auto s = this->backend_.connect();
      for (int i = 0; i < kAdds; ++i) last[r] = s->add("counter", 1);
    }));
  }
  for (auto& t : threads) EXPECT_EQ(t->join(), "");
  EXPECT_EQ(this->store_->add("counter", 0), kThreads * kAdds);
  EXPECT_EQ(this->store_->get_string("counter"), std::to_string(kThreads * kAdds));
  // Each thread's last add saw a distinct value, and the largest is the total.
  std::sort(last.begin(), last.end());
  EXPECT_EQ(std::adjacent_find(last.begin(), last.end()), last.end());
  EXPECT_EQ(last.back(), kThreads * kAdds);
}

TYPED_TEST(StoreTest, RanksAsThreadsRendezvous) {
  // Each rank publishes its address and waits for everyone else's: the bootstrap pattern.
  constexpr int kWorld = 8;
  std::vector<std::unique_ptr<Rank>> threads;
  std::vector<std::string> seen(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    threads.push_back(std::make_unique<Rank>([&, r] {
      auto s = this->backend_.connect();
      s->set("addr/" + std::to_string(r), "host" + std::to_string(r));
      std::vector<std::string> keys;
      for (int q = 0; q < kWorld; ++q) keys.push_back("addr/" + std::to_string(q));
      s->wait(keys, 30s);
      for (int q = 0; q < kWorld; ++q) seen[r] += s->get_string(keys[q]) + ",";
    }));
  }
  for (auto& t : threads) EXPECT_EQ(t->join(), "");
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(seen[r], seen[0]);
  EXPECT_EQ(seen[0], "host0,host1,host2,host3,host4,host5,host6,host7,");
}

TEST(PrefixStore, NamespacesKeysInTheUnderlyingStore) {
  auto inner = std::make_shared<HashStore>();
  PrefixStore a("a", inner), b("b", inner);
  a.set("k", "from a");
  b.set("k", "from b");
  EXPECT_EQ(a.get_string("k"), "from a");
  EXPECT_EQ(b.get_string("k"), "from b");
  EXPECT_EQ(inner->get_string("a/k"), "from a");
  EXPECT_EQ(inner->get_string("b/k"), "from b");
  EXPECT_EQ(a.add("n", 3), 3);
  EXPECT_EQ(inner->get_string("a/n"), "3");
  EXPECT_TRUE(a.check({"k", "n"}));
  EXPECT_FALSE(b.check({"n"}));
  EXPECT_TRUE(b.delete_key("k"));
  EXPECT_TRUE(inner->check({"a/k"}));
  EXPECT_FALSE(inner->check({"b/k"}));
  // Nested prefixes compose, and the timeout is the underlying store's.
  PrefixStore nested("inner", std::make_shared<PrefixStore>("outer", inner));
  nested.set("x", "1");
  EXPECT_TRUE(inner->check({"outer/inner/x"}));
  nested.set_timeout(40ms);
  EXPECT_EQ(inner->timeout(), 40ms);
  expect_error([&] { nested.get("missing"); }, {"outer/inner/missing", "40 ms"});
  expect_error([] { PrefixStore p("p", nullptr); }, {"expected a store"});
}

TEST(HashStore, NegativeTimeoutIsRefused) {
  HashStore s;
  expect_error([&] { s.set_timeout(-1ms); }, {"expected >= 0 ms", "-1"});
  EXPECT_EQ(s.timeout(), kDefaultStoreTimeout);
}

}  // namespace
