// lockstep::Error and the LS_CHECK family: every failure the library reports goes through here.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace lockstep {

// The one exception type the library throws. what() reads "message (file:line)".
class Error : public std::runtime_error {
 public:
  Error(const std::string& msg, const char* file, int line);
  const std::string& message() const { return msg_; }

 private:
  std::string msg_;
};

namespace detail {
// Concatenates any streamable arguments; used to build LS_CHECK messages lazily.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace lockstep

// LS_CHECK(cond, parts...): throws lockstep::Error with the parts concatenated when cond is false.
// The message should say what was expected and what was found.
#define LS_CHECK(cond, ...)                                                              \
  do {                                                                                   \
    if (!(cond)) [[unlikely]] {                                                          \
      ::lockstep::detail::throw_error(__FILE__, __LINE__,                                \
                                      ::lockstep::detail::str_cat(__VA_ARGS__));         \
    }                                                                                    \
  } while (0)

#define LS_THROW(...) \
  ::lockstep::detail::throw_error(__FILE__, __LINE__, ::lockstep::detail::str_cat(__VA_ARGS__))
