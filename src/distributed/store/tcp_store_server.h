// TCPStoreServer: the TCP store's server, one thread polling every connection (src-internal).
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "distributed/store/kv_table.h"
#include "distributed/store/protocol.h"
#include "distributed/store/socket.h"
#include "lockstep/distributed/store/tcp_store.h"

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

// Note [Store under attack]
// Anyone who can reach the port can open connections; only a client with the token is admitted
// (without a token, any client's first valid frame admits it). Until then a connection is a
// stranger, and strangers are bounded three ways, so that they can neither starve admitted
// clients nor use up the host's descriptors (the launcher spawns workers with them):
//   - time: a stranger is closed hello_timeout after it was accepted, whatever it sends (an idle
//     connection, a byte per second, half a hello);
//   - number: at most max_unauthenticated strangers; a new one closes the oldest, so a flood
//     recycles its own connections and a client that says hello at once (its hello is read
//     right at accept) gets in;
//   - size: a stranger's frame is at most kMaxHelloBytes and that is all that is buffered for it.
// An admitted client that stops in the middle of a frame for stall_timeout is closed too (a
// client idle between requests is not). When accept() finds no descriptor left (EMFILE), the
// oldest stranger is closed to make room; with none, a spare descriptor kept for this is freed
// to accept the connection and close it at once, so the backlog drains and poll() does not spin.
// Closings are reported by a warning at most once a minute.
class TCPStoreServer {
 public:
  // Listens on `port` (0: a free one). An empty token admits everyone.
  TCPStoreServer(uint16_t port, std::string token, TCPStoreServerOptions opts = {});
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
    bool authed = false;  // admitted (Note [Store under attack])
    bool counted = false;
    Clock::time_point hello_deadline;  // while not authed
    bool mid_frame = false;            // the buffer ends in an incomplete frame
    Clock::time_point last_byte;       // when the last bytes arrived
    bool closing = false;  // close once `out` is flushed
    bool dead = false;     // close at the end of this poll round
    std::optional<Pending> pending;
  };

  void run() noexcept;
  void loop();
  void accept_all();
  // Closes the oldest connection not yet admitted; false when there is none.
  bool drop_oldest_stranger();
  void admit(uint64_t id, Connection& c);
  void note_closed(int& counter);
  void report_closed();
  size_t max_buffered(const Connection& c) const;
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
  TCPStoreServerOptions opts_;
  Fd listener_;
  Fd spare_;  // freed to accept-and-close when descriptors run out
  Fd wake_read_, wake_write_;
  std::atomic<bool> stop_{false};

  // Owned by the server thread.
  KeyValueTable table_;
  std::unordered_map<uint64_t, Connection> conns_;
  std::unordered_map<std::string, std::vector<uint64_t>> waiters_;
  std::vector<uint64_t> resumed_;  // connections whose parked request was just answered
  uint64_t next_id_ = 1;
  std::set<uint64_t> strangers_;  // connections not yet admitted, oldest (smallest id) first
  // Connections closed by Note [Store under attack] since the last warning.
  int closed_hello_ = 0, closed_cap_ = 0, closed_stall_ = 0, closed_no_fd_ = 0;
  Clock::time_point next_report_{};
  Clock::time_point accept_paused_until_{};

  std::mutex workers_mu_;
  std::condition_variable workers_cv_;
  int64_t workers_ = 0;

  std::thread thread_;  // last: started once everything above exists
};

}  // namespace lockstep::dist::detail
