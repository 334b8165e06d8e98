// KeyValueTable: the single-threaded key-value semantics shared by HashStore and the TCP server.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/distributed/store/store.h"

namespace lockstep::dist::detail {

// Not thread-safe: HashStore guards it with a mutex, the TCP server owns it on its one thread.
// Keeping the semantics (decimal counters, PyTorch's compare_set) in one place keeps the stores
// from drifting apart.
class KeyValueTable {
 public:
  void set(const std::string& key, Bytes value) { map_[key] = std::move(value); }
  const Bytes* find(const std::string& key) const;
  bool contains(const std::string& key) const { return map_.count(key) != 0; }
  // Throws lockstep::Error when the stored value is not a decimal integer or the sum overflows.
  int64_t add(const std::string& key, int64_t delta);
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired);
  bool erase(const std::string& key) { return map_.erase(key) != 0; }
  int64_t size() const { return static_cast<int64_t>(map_.size()); }
  std::vector<std::string> missing(const std::vector<std::string>& keys) const;

 private:
  std::unordered_map<std::string, Bytes> map_;
};

// "a, b, c" for error messages, each key quoted.
std::string join_keys(const std::vector<std::string>& keys);

}  // namespace lockstep::dist::detail
