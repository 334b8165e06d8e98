// The backend registry: process-group backends by name and factory, nothing more.
#include <map>
#include <mutex>

#include "distributed/builtin_backends.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/process_group.h"

namespace lockstep::dist {

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, BackendFactory> factories;
};

Registry& registry() {
  static Registry r;
  return r;
}

// The built-in backends register through register_backend() like any other, on the registry's
// first use rather than from static initializers, which a static library's linker drops with
// any object file nothing references (this call is what references them). The thread doing so
// must not wait for itself when it comes back through register_backend().
thread_local bool registering_builtins = false;

void ensure_builtins() {
  if (registering_builtins) return;
  static std::once_flag once;
  std::call_once(once, [] {
    registering_builtins = true;
    struct Done {
      ~Done() { registering_builtins = false; }
    } done;
    detail::register_builtin_backends();
  });
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
  LS_CHECK(!name.empty(), "register_backend: expected a name, got an empty string");
  LS_CHECK(factory != nullptr, "register_backend: no factory given for '", name, "'");
  ensure_builtins();  // first, so that a caller's factory of a built-in's name replaces it
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[name] = std::move(factory);
}

bool has_backend(const std::string& name) {
  ensure_builtins();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.factories.count(name) > 0;
}

std::vector<std::string> backend_names() {
  ensure_builtins();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [name, f] : r.factories) names.push_back(name);
  return names;
}

ProcessGroupPtr create_process_group(const std::string& backend, const BackendConfig& config) {
  ensure_builtins();
  BackendFactory factory;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(backend);
    if (it == r.factories.end()) {
      const std::string why = detail::why_not_built(backend);
      if (!why.empty()) LS_THROW("process group backend '", backend, "' is not available: ", why);
      std::string known;
      for (const auto& [name, f] : r.factories) known += (known.empty() ? "" : ", ") + name;
      LS_THROW("unknown process group backend '", backend, "'; registered backends: ", known);
    }
    factory = it->second;
  }
  if (config.size == 1) return std::make_shared<WorldOfOneGroup>(config.timeout);
  LS_CHECK(config.store != nullptr, "create_process_group(", backend, "): a group of ", config.size,
           " ranks needs a store to rendezvous through; none was given");
  return factory(config);
}

}  // namespace lockstep::dist
