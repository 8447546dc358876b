// kvshare's one error type and result alias, shared by every module.
#pragma once

#include <fmt/format.h>

#include <string>
#include <tl/expected.hpp>
#include <utility>

namespace kvshare {

// What went wrong, with context: the object (path, fd, peer pid, JSON field, byte offset)
// and, when the operating system was involved, its errno value. `message` never carries
// the errno text; `what()` appends it.
class Error {
 public:
  Error() = default;
  Error(int errno_value, std::string message) : errno_value_(errno_value), message_(std::move(message)) {}

  int errno_value() const { return errno_value_; }
  const std::string& message() const { return message_; }
  // "message: strerror(errno)" when errno_value is non-zero, else the message.
  std::string what() const;

  // Returns a copy whose message is "context: message" — for adding the outer object
  // (the file being read, the request being served) as an error travels up.
  Error with_context(std::string_view context) const;

 private:
  int errno_value_ = 0;
  std::string message_;
};

template <class T>
using Result = tl::expected<T, Error>;

// `return fail(EINVAL, "state file {}: bad magic {:#x}", path, magic);`
template <class... Args>
tl::unexpected<Error> fail(int errno_value, fmt::format_string<Args...> format, Args&&... args) {
  return tl::unexpected<Error>(Error(errno_value, fmt::format(format, std::forward<Args>(args)...)));
}

inline tl::unexpected<Error> fail(Error error) { return tl::unexpected<Error>(std::move(error)); }

}  // namespace kvshare

// The one early-return mechanism for Result (C++ has no `?`): in a function returning
// Result<U>, evaluate a Result<T> expression and return its error, if any.
//   KVSHARE_TRY(write_header(out));                       // the value, if any, is dropped
//   KVSHARE_TRY_ASSIGN(auto n, in.take<uint32_t>("n"));  // declares n
//   KVSHARE_TRY_ASSIGN(w.output, ld.matrix("output"));   // assigns an existing object
// KVSHARE_TRY_ASSIGN expands to several statements: use it as a statement of a block, never
// as the lone body of an unbraced if or loop.
#define KVSHARE_TRY_CONCAT_(a, b) a##b
#define KVSHARE_TRY_NAME_(n) KVSHARE_TRY_CONCAT_(kvshare_try_, n)
#define KVSHARE_TRY(expr)                                                                \
  do {                                                                                   \
    auto&& kvshare_try_result_ = (expr);                                                 \
    if (!kvshare_try_result_) return ::tl::make_unexpected(kvshare_try_result_.error()); \
  } while (0)
// __COUNTER__ becomes a number once, as the argument n, so the three uses name one temporary.
#define KVSHARE_TRY_ASSIGN(dst, expr) KVSHARE_TRY_ASSIGN_N_(__COUNTER__, dst, expr)
#define KVSHARE_TRY_ASSIGN_N_(n, dst, expr) KVSHARE_TRY_ASSIGN_(KVSHARE_TRY_NAME_(n), dst, expr)
#define KVSHARE_TRY_ASSIGN_(tmp, dst, expr)            \
  auto&& tmp = (expr);                                 \
  if (!tmp) return ::tl::make_unexpected(tmp.error()); \
  dst = std::move(*tmp)
