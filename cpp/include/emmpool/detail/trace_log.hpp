/**
 * @file detail/trace_log.hpp
 * @brief The optional record of a pool's allocations and frees (pool_observers::set_tracing,
 * `python -m emmpool.trace`, the replay benchmark). Off, it costs its pool one branch per call.
 */
#pragma once

#include <emmpool/driver.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace emmpool {

/// @brief One allocation or free, as the optional trace records it.
struct trace_record {
  std::uint64_t time_ns;  ///< steady clock
  device_ptr ptr;
  std::size_t size;       ///< bytes requested (allocation) or held (free)
  stream_handle stream;
  char op;                ///< 'a' allocation, 'f' free
  std::uint8_t tag;       ///< alloc_tag
};

namespace detail {

/// Not thread-safe: its pool's mutex.
class trace_log {
 public:
  [[nodiscard]] bool on() const noexcept { return on_; }
  void set(bool on) noexcept { on_ = on; }
  void record(char op, device_ptr ptr, std::size_t size, stream_handle stream, std::uint8_t tag)
  {
    auto const now = std::chrono::steady_clock::now().time_since_epoch();
    auto const ns  = std::chrono::duration_cast<std::chrono::nanoseconds>(now).count();
    records_.push_back({static_cast<std::uint64_t>(ns), ptr, size, stream, op, tag});
  }
  /// @brief The records since the last call, oldest first; the trace keeps running.
  [[nodiscard]] std::vector<trace_record> take() { return std::exchange(records_, {}); }

 private:
  bool on_{};
  std::vector<trace_record> records_;
};

}  // namespace detail
}  // namespace emmpool
