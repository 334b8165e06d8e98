// HashStore: the in-process Store, a mutex-guarded table and a condition variable for waiters.
#include "lockstep/distributed/store/hash_store.h"

#include "distributed/store/kv_table.h"
#include "lockstep/base/error.h"

namespace lockstep::dist {

using detail::join_keys;

HashStore::HashStore(std::chrono::milliseconds timeout)
    : Store(timeout), table_(std::make_unique<detail::KeyValueTable>()) {}

HashStore::~HashStore() = default;

void HashStore::do_set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    table_->set(key, value);
  }
  changed_.notify_all();
}

Bytes HashStore::do_get(const std::string& key) {
  const auto t = timeout();
  std::unique_lock<std::mutex> lock(mu_);
  const bool found = changed_.wait_for(lock, t, [&] { return table_->find(key) != nullptr; });
  LS_CHECK(found, "store get(\"", key, "\") timed out after ", t.count(),
           " ms: the key was never set");
  return *table_->find(key);
}

int64_t HashStore::do_add(const std::string& key, int64_t delta) {
  int64_t v = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    v = table_->add(key, delta);
  }
  changed_.notify_all();
  return v;
}

Bytes HashStore::do_compare_set(const std::string& key, const Bytes& expected,
                                const Bytes& desired) {
  Bytes v;
  {
    std::lock_guard<std::mutex> lock(mu_);
    v = table_->compare_set(key, expected, desired);
  }
  changed_.notify_all();
  return v;
}

bool HashStore::do_check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_->missing(keys).empty();
}

void HashStore::do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool found =
      changed_.wait_for(lock, timeout, [&] { return table_->missing(keys).empty(); });
  LS_CHECK(found, "store wait timed out after ", timeout.count(),
           " ms; keys still missing: ", join_keys(table_->missing(keys)));
}

bool HashStore::do_delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return table_->erase(key);
}

int64_t HashStore::do_num_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  return table_->size();
}

}  // namespace lockstep::dist
