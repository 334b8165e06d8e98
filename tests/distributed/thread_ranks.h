// Ranks as threads: each runs a body with its own process group over one shared HashStore.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/distributed/gloo/process_group_gloo.h"
#include "lockstep/distributed/store/hash_store.h"

namespace lockstep::testing {

// Runs body(rank, make(config)) on `world` threads, one store between them, and returns each
// rank's exception message ("" when it succeeded).
inline std::vector<std::string> run_ranks_with(
    int world, const std::function<dist::ProcessGroupPtr(const dist::BackendConfig&)>& make,
    const std::function<void(int, dist::ProcessGroupPtr)>& body,
    std::chrono::milliseconds timeout) {
  auto store = std::make_shared<dist::HashStore>(std::chrono::seconds(30));
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        dist::BackendConfig c;
        c.store = store;
        c.rank = r;
        c.size = world;
        c.timeout = timeout;
        body(r, make(c));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Runs body(rank, group) on `world` threads and returns each rank's exception message ("" when
// it succeeded). Groups are Gloo's even for a world of one unless `via_registry`, which builds
// them as create_process_group("gloo") does (a world of one is then a WorldOfOneGroup).
inline std::vector<std::string> run_ranks(
    int world, const std::function<void(int, dist::ProcessGroupPtr)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(60), bool via_registry = false) {
  return run_ranks_with(
      world,
      [via_registry](const dist::BackendConfig& c) -> dist::ProcessGroupPtr {
        if (via_registry) return dist::create_process_group("gloo", c);
        return std::make_shared<dist::ProcessGroupGloo>(c);
      },
      body, timeout);
}

// As run_ranks, with groups of `backend` ("gloo", "shm", ...) from the registry
// (create_process_group).
inline std::vector<std::string> run_ranks_on(
    const std::string& backend, int world,
    const std::function<void(int, dist::ProcessGroupPtr)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  return run_ranks_with(
      world,
      [&backend](const dist::BackendConfig& c) { return dist::create_process_group(backend, c); },
      body, timeout);
}

}  // namespace lockstep::testing
