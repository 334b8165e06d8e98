// TCPStoreServer: the TCP store's server, one thread polling every connection (src-internal).
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "distributed/store/kv_table.h"
#include "distributed/store/protocol.h"
#include "distributed/store/socket.h"

namespace lockstep::dist::detail {

// Note [Store server]
// One thread serves every connection with poll() over non-blocking sockets, so a thousand ranks
// cost a thousand file descriptors, not a thousand threads. A blocking get()/wait() never blocks
// that thread: the request parks its connection as a waiter (registered under one missing key)
// with a deadline, and the set that makes the key exist answers it; the earliest deadline bounds
// poll(). While a connection has a parked request, its later frames stay buffered, so replies
// keep request order. A connection that breaks the protocol (Note [Store frames] in
// protocol.h) or, with a token, does not present it first, is closed; nothing it sent before
// is undone, and no other connection notices. The destructor wakes poll() through a pipe and
// joins the thread.
class TCPStoreServer {
 public:
  // Listens on `port` (0: a free one). An empty token admits everyone.
  TCPStoreServer(uint16_t port, std::string token);
  ~TCPStoreServer();
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;

  uint16_t port() const { return port_; }
  // Blocks until `n` stores have connected (each TCPStore counts once) or `deadline`; returns how
  // many have.
  int64_t wait_for_workers(int64_t n, Clock::time_point deadline);

 private:
  struct Pending {
    bool is_get = false;
    std::vector<std::string> keys;
    std::string registered_under;  // the key in waiters_ that lists this connection
    Clock::time_point deadline;
  };
  struct Connection {
    Fd fd;
    std::vector<uint8_t> in;
    size_t in_off = 0;
    std::vector<uint8_t> out;
    size_t out_off = 0;
    bool authed = false;
    bool counted = false;
    bool closing = false;  // close once `out` is flushed
    bool dead = false;     // close at the end of this poll round
    std::optional<Pending> pending;
  };

  void run() noexcept;
  void loop();
  void accept_all();
  void read_from(uint64_t id, Connection& c);
  void process_frames(uint64_t id, Connection& c);
  // False when the request breaks the protocol (the connection is then closed).
  bool handle(uint64_t id, Connection& c, uint8_t op, std::vector<std::string>& f);
  void reply(Connection& c, std::vector<uint8_t> frame);
  void flush(Connection& c);
  void park(uint64_t id, Connection& c, Pending p);
  void unpark(uint64_t id, Connection& c);
  void key_changed(const std::string& key);
  void expire(Clock::time_point now);
  std::optional<Clock::time_point> next_deadline() const;
  void reap();

  uint16_t port_ = 0;
  std::string token_;
  Fd listener_;
  Fd wake_read_, wake_write_;
  std::atomic<bool> stop_{false};

  // Owned by the server thread.
  KeyValueTable table_;
  std::unordered_map<uint64_t, Connection> conns_;
  std::unordered_map<std::string, std::vector<uint64_t>> waiters_;
  std::vector<uint64_t> resumed_;  // connections whose parked request was just answered
  uint64_t next_id_ = 1;
  Clock::time_point accept_paused_until_{};

  std::mutex workers_mu_;
  std::condition_variable workers_cv_;
  int64_t workers_ = 0;

  std::thread thread_;  // last: started once everything above exists
};

}  // namespace lockstep::dist::detail
