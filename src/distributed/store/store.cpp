// Store's shared plumbing: timeouts and the string overloads.
#include "lockstep/distributed/store/store.h"

#include <algorithm>

#include "lockstep/base/error.h"

namespace lockstep::dist {

Store::Store(std::chrono::milliseconds timeout) : timeout_ms_(0) { set_timeout(timeout); }

void Store::set_timeout(std::chrono::milliseconds timeout) {
  LS_CHECK(timeout.count() >= 0, "store timeout: expected >= 0 ms, got ", timeout.count(), " ms");
  timeout_ms_.store(std::min(timeout, kMaxStoreTimeout).count());
}

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  LS_CHECK(timeout.count() >= 0, "store wait: expected a timeout >= 0 ms, got ", timeout.count(),
           " ms");
  do_wait(keys, std::min(timeout, kMaxStoreTimeout));
}

std::chrono::milliseconds Store::timeout() const {
  return std::chrono::milliseconds(timeout_ms_.load());
}

void Store::set(const std::string& key, std::string_view value) { do_set(key, to_bytes(value)); }

std::string Store::get_string(const std::string& key) { return to_string(do_get(key)); }

std::string Store::compare_set(const std::string& key, std::string_view expected,
                               std::string_view desired) {
  return to_string(do_compare_set(key, to_bytes(expected), to_bytes(desired)));
}

}  // namespace lockstep::dist
