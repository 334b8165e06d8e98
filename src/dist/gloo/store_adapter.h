// GlooStoreAdapter: Gloo's rendezvous runs over a lockstep Store (TCPStore, HashStore, ...).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "lockstep/dist/store.h"

namespace lockstep::dist::detail {

// gloo::rendezvous::Context::connectFullMesh publishes each rank's addresses under keys of its
// own and waits for everyone else's; it needs set, get and wait, which every Store has. The
// adapter does not own the keys' namespace: hand it a PrefixStore per group.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<dist::Store> store, std::chrono::milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, Bytes(data.begin(), data.end()));
  }

  std::vector<char> get(const std::string& key) override {
    store_->wait({key}, timeout_);
    const Bytes value = store_->get(key);
    return std::vector<char>(value.begin(), value.end());
  }

  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<dist::Store> store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace lockstep::dist::detail
