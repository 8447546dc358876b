#include "layout/error.h"

#include <cstring>

namespace kvshare {

std::string Error::what() const {
  if (errno_value_ == 0) return message_;
  char buffer[256];
  // GNU strerror_r returns the text (possibly not in buffer); it is thread-safe, strerror is not.
  const char* text = strerror_r(errno_value_, buffer, sizeof buffer);
  return message_ + ": " + text;
}

Error Error::with_context(std::string_view context) const {
  return Error(errno_value_, std::string(context) + ": " + message_);
}

}  // namespace kvshare
