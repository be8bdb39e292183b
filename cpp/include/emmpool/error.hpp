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
#include <new>
#include <stdexcept>
#include <string>

namespace emmpool {

/// @brief A CUDA driver call failed. Carries the call, the driver's error code and name.
class cuda_error : public std::runtime_error {
 public:
  cuda_error(std::string call, int code, std::string const& name, std::string const& where)
    : std::runtime_error{call + " failed: " + name + " (" + std::to_string(code) + ") at " + where},
      call_{std::move(call)},
      code_{code}
  {
  }
  /// @brief The driver function that failed, e.g. "cuMemAlloc".
  [[nodiscard]] std::string const& call() const noexcept { return call_; }
  /// @brief The CUresult value.
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  std::string call_;
  int code_;
};

/// @brief No usable CUDA driver: libcuda.so.1 missing, too old, or cuInit failed.
class driver_unavailable : public cuda_error {
 public:
  using cuda_error::cuda_error;
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
