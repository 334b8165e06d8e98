// LOCKSTEP_ERROR_FILE: recording why a worker died.
#include "lockstep/distributed/error_file.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <memory>
#include <mutex>

#include <nlohmann/json.hpp>

#include "lockstep/base/env_var.h"
#include "lockstep/base/worker_env.h"

namespace lockstep::dist {

namespace {

void write_record(nlohmann::json j) {
  try {
    const auto path = env_string(env::kErrorFile);
    if (!path) return;
    j["time"] = static_cast<int64_t>(std::time(nullptr));
    j["pid"] = static_cast<int64_t>(::getpid());
    // Replace, not append: the file holds this worker's last word. dump() with replace for
    // invalid UTF-8, since messages may carry arbitrary bytes.
    const std::string text =
        j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    std::unique_ptr<FILE, decltype(&std::fclose)> f(std::fopen(path->c_str(), "w"), &std::fclose);
    if (f) std::fwrite(text.data(), 1, text.size(), f.get());
  } catch (...) {
    // Nothing to be done: the record is the worker's last word, given on a best-effort basis.
  }
}

}  // namespace

void record_error(const std::string& message) { write_record({{"message", message}}); }

void record_stop(int sig, const std::string& message) {
  write_record({{"message", message}, {"stop_signal", sig}});
}

namespace {

std::terminate_handler previous_handler = nullptr;

[[noreturn]] void on_terminate() {
  std::string message = "terminate called without an active exception";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      message = ex.what();
    } catch (...) {
      message = "terminate called after throwing a non-std::exception";
    }
  }
  record_error(message);
  if (previous_handler != nullptr) previous_handler();
  std::abort();
}

}  // namespace

void install_error_handler() {
  static std::once_flag once;
  std::call_once(once, [] { previous_handler = std::set_terminate(on_terminate); });
}

}  // namespace lockstep::dist
