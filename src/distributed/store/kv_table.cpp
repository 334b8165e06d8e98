// KeyValueTable: counters as decimal strings, compare_set with PyTorch's semantics.
#include "distributed/store/kv_table.h"

#include <charconv>

#include "lockstep/base/error.h"

namespace lockstep::dist::detail {

const Bytes* KeyValueTable::find(const std::string& key) const {
  auto it = map_.find(key);
  return it == map_.end() ? nullptr : &it->second;
}

int64_t KeyValueTable::add(const std::string& key, int64_t delta) {
  int64_t current = 0;
  auto it = map_.find(key);
  if (it != map_.end()) {
    const char* first = reinterpret_cast<const char*>(it->second.data());
    const char* last = first + it->second.size();
    auto [end, ec] = std::from_chars(first, last, current);
    LS_CHECK(ec == std::errc() && end == last && first != last, "store add(\"", key,
             "\"): expected the value to be a decimal integer, got \"",
             std::string(first, std::min<size_t>(it->second.size(), 64)), "\"");
  }
  int64_t next = 0;
  LS_CHECK(!__builtin_add_overflow(current, delta, &next), "store add(\"", key, "\", ", delta,
           "): the counter ", current, " would overflow int64");
  std::string text = std::to_string(next);
  map_[key] = Bytes(text.begin(), text.end());
  return next;
}

Bytes KeyValueTable::compare_set(const std::string& key, const Bytes& expected,
                                 const Bytes& desired) {
  auto it = map_.find(key);
  if (it == map_.end()) {
    if (!expected.empty()) return expected;  // PyTorch's answer for a missing key
    map_[key] = desired;
    return desired;
  }
  if (it->second == expected) it->second = desired;
  return it->second;
}

std::vector<std::string> KeyValueTable::missing(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  for (const auto& k : keys)
    if (!contains(k)) out.push_back(k);
  return out;
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i) out += ", ";
    out += "\"" + keys[i] + "\"";
  }
  return out;
}

}  // namespace lockstep::dist::detail
