// Store: the key-value interface every process of a job reaches for rendezvous and bootstrap data.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep::dist {

using Bytes = std::vector<uint8_t>;

// How long get() and wait() block by default before failing (PyTorch's default as well).
inline constexpr std::chrono::milliseconds kDefaultStoreTimeout{300'000};
// Longer timeouts are clamped to this (ten years), so that no deadline computed from one
// overflows the clock.
inline constexpr std::chrono::milliseconds kMaxStoreTimeout{int64_t{10} * 365 * 24 * 3600 * 1000};

// A key-value store shared by the processes (or threads) of a job. Implementations are
// thread-safe; ownership is shared (std::shared_ptr<Store>) since a store outlives the process
// groups and prefix views built on it.
//
// The public methods are non-virtual and forward to the do_* hooks, so that the string
// convenience overloads stay visible on every derived type.
//
// Semantics, shared with PyTorch's c10d stores:
// - get() blocks until the key exists or timeout() expires (lockstep::Error naming the key and
//   the timeout).
// - add() keeps a counter as a decimal string ("42"); a missing key counts as 0. Adding to a
//   value that is not a decimal integer is an Error.
// - compare_set(): if the key exists and holds `expected`, it becomes `desired`; if the key is
//   missing and `expected` is empty, it is set to `desired`. Returns the value now stored, except
//   that a missing key with a non-empty `expected` returns `expected` (as PyTorch does).
// - wait() blocks until every key exists; on timeout the Error names the keys still missing.
class Store {
 public:
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  void set(const std::string& key, const Bytes& value) { do_set(key, value); }
  void set(const std::string& key, std::string_view value);
  Bytes get(const std::string& key) { return do_get(key); }
  std::string get_string(const std::string& key);
  int64_t add(const std::string& key, int64_t delta) { return do_add(key, delta); }
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
    return do_compare_set(key, expected, desired);
  }
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired);
  // Non-blocking: whether every key exists now.
  bool check(const std::vector<std::string>& keys) { return do_check(keys); }
  void wait(const std::vector<std::string>& keys) { do_wait(keys, timeout()); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Whether the key existed.
  bool delete_key(const std::string& key) { return do_delete_key(key); }
  int64_t num_keys() { return do_num_keys(); }

  virtual void set_timeout(std::chrono::milliseconds timeout);
  virtual std::chrono::milliseconds timeout() const;

 protected:
  explicit Store(std::chrono::milliseconds timeout = kDefaultStoreTimeout);

  virtual void do_set(const std::string& key, const Bytes& value) = 0;
  virtual Bytes do_get(const std::string& key) = 0;
  virtual int64_t do_add(const std::string& key, int64_t delta) = 0;
  virtual Bytes do_compare_set(const std::string& key, const Bytes& expected,
                               const Bytes& desired) = 0;
  virtual bool do_check(const std::vector<std::string>& keys) = 0;
  virtual void do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  virtual bool do_delete_key(const std::string& key) = 0;
  virtual int64_t do_num_keys() = 0;

 private:
  std::atomic<int64_t> timeout_ms_;
};

inline Bytes to_bytes(std::string_view s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

}  // namespace lockstep::dist
