/**
 * @file detail/segment_log.hpp
 * @brief The optional record of the memory a pool takes from the driver and gives back
 * (pool_observers::take_segment_events): what a memory history shows as segment_alloc,
 * segment_free, segment_map and segment_unmap. Off, it costs one branch per segment made or
 * released. Not thread-safe: its pool's mutex.
 */
#pragma once

#include <emmpool/pool_layout.hpp>

#include <cstddef>
#include <utility>
#include <vector>

namespace emmpool::detail {

class segment_log {
 public:
  /// Events kept at most between two takes: a history nobody reads must not grow unbounded.
  static constexpr std::size_t kept = std::size_t{1} << 16;

  [[nodiscard]] bool on() const noexcept { return on_; }
  void set(bool on) noexcept
  {
    on_ = on;
    if (!on) { events_.clear(); }
  }
  /// Never throws: it is called once the driver has done its part, and a history that misses
  /// an event (no memory for it) beats a pool whose books are left half done.
  void record(segment_event::kind what, segment_type type, std::uint8_t tag, device_ptr address,
              std::size_t size) noexcept
  {
    if (!on_ || events_.size() >= kept) { return; }
    try {
      events_.push_back(segment_event{what, type, tag, address, size});
    } catch (...) {
    }
  }
  /// The oldest events, at most max; the rest stay.
  [[nodiscard]] std::vector<segment_event> take(std::size_t max)
  {
    if (max >= events_.size()) { return std::exchange(events_, {}); }
    std::vector<segment_event> out(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(max));
    events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(max));
    return out;
  }

 private:
  bool on_{};
  std::vector<segment_event> events_;
};

}  // namespace emmpool::detail
