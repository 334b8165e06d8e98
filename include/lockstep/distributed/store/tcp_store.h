// TCPStore: a Store served over TCP by one process (the launcher or rank 0) to every other.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "lockstep/base/error.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/distributed/store/store.h"

namespace lockstep::dist {

namespace detail {
class TCPStoreServer;
class TCPStoreClient;
}  // namespace detail

inline constexpr uint16_t kDefaultStorePort = 29500;
// The environment variable a shared token is read from when TCPStoreOptions::token is unset.
inline constexpr const char* kStoreTokenEnv = env::kStoreToken;
// The longest token the store takes (a token is a short secret; its hello frame must stay small:
// Note [Store frames] in src/distributed/store/protocol.h).
inline constexpr size_t kMaxStoreTokenBytes = 4 << 10;

// The store refused this client's token. A lockstep::Error like every other, but a definite
// answer: unlike a store that is not up yet, trying again cannot help, so a caller that retries
// its connection (the launcher waiting for node 0) stops at this one.
class StoreTokenRejected : public Error {
 public:
  using Error::Error;
};

// What the server does to connections that have not presented their hello (with the token when
// there is one): Note [Store under attack] in src/distributed/store/tcp_store_server.h, and
// docs/DISTRIBUTED.md, "The store under attack".
inline constexpr std::chrono::milliseconds kDefaultStoreHelloTimeout{5000};
inline constexpr std::chrono::milliseconds kDefaultStoreStallTimeout{5000};
inline constexpr int kDefaultStoreMaxUnauthenticated = 128;
// Descriptors a server holds besides its connections: the listener, a wake-up pipe and a spare.
inline constexpr int kStoreServerOwnDescriptors = 4;

// The server's limits. It holds at most max_unauthenticated + (its admitted clients) +
// kStoreServerOwnDescriptors descriptors, whoever can reach its port.
struct TCPStoreServerOptions {
  // A local address to listen on ("127.0.0.1", "10.1.2.3", "::1"); empty: every interface.
  std::string bind_address;
  // A connection is closed when it has not been admitted (a valid hello) this long after it was
  // accepted, whatever it sends meanwhile.
  std::chrono::milliseconds hello_timeout = kDefaultStoreHelloTimeout;
  // A connection that stops sending in the middle of a frame for this long is closed. One that
  // is idle between requests is not, however long.
  std::chrono::milliseconds stall_timeout = kDefaultStoreStallTimeout;
  // At most this many connections wait for admission; each new one beyond closes the oldest.
  int max_unauthenticated = kDefaultStoreMaxUnauthenticated;
};

struct TCPStoreOptions {
  // Where clients connect. The server listens on server.bind_address (every interface when
  // empty), and its own client connects there (127.0.0.1 when empty).
  std::string host = "127.0.0.1";
  // 0 on the server: pick a free port, reported by TCPStore::port().
  uint16_t port = kDefaultStorePort;
  bool is_server = false;
  // With num_workers set and wait_for_workers on, the server's constructor returns only once
  // num_workers stores (itself included) have connected, or fails after `timeout`.
  std::optional<int> num_workers;
  bool wait_for_workers = true;
  // Bounds connecting (clients retry with exponential backoff until then), get() and wait().
  std::chrono::milliseconds timeout = kDefaultStoreTimeout;
  // A shared secret: a server with one closes every connection that does not present it first.
  // Unset: LOCKSTEP_STORE_TOKEN if the environment has it, else no token.
  std::optional<std::string> token;
  // Server only: where it listens, and its deadlines and caps.
  TCPStoreServerOptions server;
};

// The token in a file: a regular file owned by this user, readable by no one else, holding the
// secret (whitespace around it ignored; at most 4 KiB, no NUL). `what` names the file in errors
// ("--token-file T"). A FIFO or device is refused without blocking.
std::string read_store_token_file(const std::string& path, const std::string& what);

// The token the environment gives: LOCKSTEP_STORE_TOKEN, or the content of the file
// LOCKSTEP_STORE_TOKEN_FILE names; "" when neither is set. Both set is an Error.
std::string store_token_from_env(
    const std::function<std::optional<std::string>(const std::string&)>& lookup);

// With is_server, starts the server (one thread polling every connection) and connects to it as
// a client like every other process. Requests from one TCPStore object are serialized (one
// connection, one request at a time): threads that block in get()/wait() concurrently should
// each hold their own TCPStore. A lost connection is reopened by the next request.
class TCPStore : public Store {
 public:
  explicit TCPStore(TCPStoreOptions opts);
  ~TCPStore() override;

  // The port the server listens on (the real one when 0 was asked for).
  uint16_t port() const { return port_; }
  const std::string& host() const { return opts_.host; }
  bool is_server() const { return opts_.is_server; }

 protected:
  void do_set(const std::string& key, const Bytes& value) override;
  Bytes do_get(const std::string& key) override;
  int64_t do_add(const std::string& key, int64_t delta) override;
  Bytes do_compare_set(const std::string& key, const Bytes& expected,
                       const Bytes& desired) override;
  bool do_check(const std::vector<std::string>& keys) override;
  void do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool do_delete_key(const std::string& key) override;
  int64_t do_num_keys() override;

 private:
  TCPStoreOptions opts_;
  uint16_t port_ = 0;
  std::unique_ptr<detail::TCPStoreServer> server_;
  std::mutex mu_;  // serializes requests on client_
  std::unique_ptr<detail::TCPStoreClient> client_;
};

}  // namespace lockstep::dist
