// The one error type of mambamoe. Every failure a user can cause (bad deck, bad file, bad shape) is reported as
// an mm::Error whose message names what went wrong and where: the file and line, the deck key, or the shape.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace mm {

class Error : public std::runtime_error {
 public:
  // `context` says where (a file:line, a deck key, a layer name); `what` says what went wrong.
  Error(std::string context, const std::string& what)
      : std::runtime_error(context.empty() ? what : context + ": " + what), context_(std::move(context)) {}
  explicit Error(const std::string& what) : Error(std::string{}, what) {}
  const std::string& context() const noexcept { return context_; }

 private:
  std::string context_;
};

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Throw mm::Error(context, message...) unless `cond` holds.
template <class... Args>
inline void require(bool cond, const std::string& context, Args&&... message) {
  if (!cond) throw Error(context, detail::concat(std::forward<Args>(message)...));
}

}  // namespace mm
