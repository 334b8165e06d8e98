// lockstep::Error construction.
#include "lockstep/base/error.h"

#include <cstring>

namespace lockstep {

namespace {
const char* basename_of(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
}  // namespace

Error::Error(const std::string& msg, const char* file, int line)
    : std::runtime_error(msg + " (" + basename_of(file) + ":" + std::to_string(line) + ")"),
      msg_(msg) {}

namespace detail {
void throw_error(const char* file, int line, const std::string& msg) {
  throw Error(msg, file, line);
}
}  // namespace detail

}  // namespace lockstep
