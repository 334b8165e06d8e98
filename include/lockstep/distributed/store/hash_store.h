// HashStore: an in-process Store for tests and single-process jobs that run ranks as threads.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>

#include "lockstep/distributed/store/store.h"

namespace lockstep::dist {

namespace detail {
class KeyValueTable;
}

// Thread-safe: one mutex over the table, one condition variable that blocked get()/wait() sleep
// on and that every write wakes.
class HashStore : public Store {
 public:
  explicit HashStore(std::chrono::milliseconds timeout = kDefaultStoreTimeout);
  ~HashStore() override;

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
  std::mutex mu_;
  std::condition_variable changed_;
  std::unique_ptr<detail::KeyValueTable> table_;
};

}  // namespace lockstep::dist
