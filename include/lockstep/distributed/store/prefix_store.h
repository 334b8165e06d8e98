// PrefixStore: a view of another Store in which every key is namespaced as prefix + "/" + key.
#pragma once

#include <memory>

#include "lockstep/distributed/store/store.h"

namespace lockstep::dist {

// Lets independent users (process groups, the launcher's agents) share one store without key
// clashes. The timeout is the underlying store's (set_timeout() changes it for every view), and
// num_keys() counts every key of the underlying store, as PyTorch's PrefixStore does.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& underlying() const { return store_; }

  void set_timeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds timeout() const override;

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
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> full(const std::vector<std::string>& keys) const;

  std::string prefix_;
  std::shared_ptr<Store> store_;
};

}  // namespace lockstep::dist
