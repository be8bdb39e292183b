/**
 * @file error.hpp
 * @brief The exceptions emmpool throws, and the macros that throw them with file and line.
 *
 * Hierarchy (mapped to Python in cpp/bindings/module.cpp):
 *   std::bad_alloc  <- emmpool::out_of_memory       -> emmpool.OutOfMemoryError (a MemoryError)
 *   std::runtime_error <- emmpool::cuda_error       -> emmpool.CudaError (has .code, .call)
 *                           <- emmpool::driver_unavailable -> emmpool.DriverUnavailableError
 *   std::invalid_argument (bad input)               -> ValueError
 *   std::logic_error (a pointer the pool does not own, double free) -> emmpool.PoolError
 */
#pragma once

#include <cstddef>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <string>

namespace emmpool {

/// @brief A CUDA driver call failed. Carries the call, the driver's error code and name.
class cuda_error : public std::runtime_error {
 public:
  cuda_error(std::string call, int code, std::string const& name, std::string const& where)
    : cuda_error{call, code, call + " failed: " + name + " (" + std::to_string(code) + ") at " + where}
  {
  }
  /// @brief The driver function that failed, e.g. "cuMemAlloc".
  [[nodiscard]] std::string const& call() const noexcept { return call_; }
  /// @brief The CUresult value.
  [[nodiscard]] int code() const noexcept { return code_; }

 protected:
  /// @brief With a message of its own (see driver_unavailable).
  cuda_error(std::string call, int code, std::string const& message)
    : std::runtime_error{message}, call_{std::move(call)}, code_{code}
  {
  }

 private:
  std::string call_;
  int code_;
};

/// @brief No usable CUDA driver: libcuda.so.1 missing, too old, or cuInit failed.
///
/// Its message is for whoever meets it first, often on a machine without a GPU: one sentence
/// saying what is missing, what that means and what to do, with no error number or source
/// location (the code stays available as code()).
class driver_unavailable : public cuda_error {
 public:
  /// @param call the step that failed: "dlopen", "dlsym" or "cuInit"
  /// @param code a CUresult for code()
  /// @param sentence the whole message
  driver_unavailable(std::string call, int code, std::string const& sentence)
    : cuda_error{std::move(call), code, sentence}
  {
  }
};

/// @brief The pool could not satisfy a request, even after the whole out-of-memory ladder.
class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string message) : message_{std::move(message)} {}
  [[nodiscard]] char const* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

/// @brief Misuse of the pool: freeing a pointer it does not own, or freeing twice.
class pool_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {
[[noreturn]] inline void throw_invalid(char const* message, char const* file, int line)
{
  throw std::invalid_argument{std::string{message} + " (" + file + ":" + std::to_string(line) + ")"};
}

/// A size as error messages and descriptions print it: "1.50 MiB".
inline std::string human_bytes(std::size_t bytes)
{
  char buf[32];
  double const v = static_cast<double>(bytes);
  if (bytes >= (std::size_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1 << 30));
  } else if (bytes >= (std::size_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", v / (1 << 20));
  } else if (bytes >= 1024) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", v / 1024);
  } else {
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  }
  return buf;
}
}  // namespace detail

}  // namespace emmpool

#define EMMPOOL_STRINGIFY_DETAIL(x) #x
#define EMMPOOL_STRINGIFY(x) EMMPOOL_STRINGIFY_DETAIL(x)
#define EMMPOOL_WHERE __FILE__ ":" EMMPOOL_STRINGIFY(__LINE__)

/// Precondition on caller input: throws std::invalid_argument (ValueError in Python).
#define EMMPOOL_EXPECTS(cond, message)                                   \
  do {                                                                   \
    if (!(cond)) { ::emmpool::detail::throw_invalid(message, __FILE__, __LINE__); } \
  } while (0)
