// GlooStoreAdapter: Gloo's rendezvous runs over a lockstep Store (TCPStore, HashStore, ...).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "lockstep/base/error.h"
#include "lockstep/distributed/store/store.h"

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
    wait({key}, timeout_);
    const Bytes value = store_->get(key);
    return std::vector<char>(value.begin(), value.end());
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  // Waits in short slices and looks for kAbortKey between them: a rank that failed to set up
  // its transport says so there, and the others fail at once with its message instead of
  // waiting out the timeout for addresses that will never come.
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) break;
      try {
        store_->wait(keys, std::min(left, kSlice));
        return;
      } catch (const Error&) {
        // not there yet (or the store hiccuped): look for an abort, then try again
      }
      if (store_->check({kAbortKey})) {
        LS_THROW("another rank failed while connecting: ", store_->get_string(kAbortKey));
      }
    }
    std::string missing;
    for (const auto& k : keys) {
      if (!store_->check({k})) missing += (missing.empty() ? "\"" : ", \"") + k + "\"";
    }
    LS_THROW("timed out after ", timeout.count(), " ms waiting for the other ranks' addresses ",
             "(keys ", missing, ")");
  }

  static constexpr const char* kAbortKey = "lockstep_abort";

 private:
  static constexpr std::chrono::milliseconds kSlice{100};

  std::shared_ptr<dist::Store> store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace lockstep::dist::detail
