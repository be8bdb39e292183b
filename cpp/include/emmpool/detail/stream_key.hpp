/**
 * @file detail/stream_key.hpp
 * @brief How the pools name a stream: its key (stream_ref), taken only while the stream is
 * certain to be alive ("stream lifetime" in reuse_rule.hpp). The lowest layer of the reuse
 * rule: it knows the driver's stream ids and nothing of blocks, batches or lanes.
 */
#pragma once

#include <emmpool/driver.hpp>
#include <emmpool/error.hpp>

#include <cstdint>

namespace emmpool {

/// As the stream of a free: fence it on the stream named when the block was allocated (the
/// CuPy and PyTorch entry points, whose frees carry no stream they vouch for, use this). Never
/// reaches the driver, and names no stream to allocate on or to record.
inline constexpr stream_handle allocation_stream = ~stream_handle{0};

namespace detail {

/// @brief A stream as the pool remembers it: the handle, and the driver's id of the stream
/// behind it (stream_id), taken while its owner guaranteed it alive. Context streams (null,
/// legacy) never die and carry id 0. Two refs name the same stream only if both parts match:
/// once a stream is destroyed, a new stream may get its handle.
struct stream_ref {
  stream_handle handle{legacy_stream};
  std::uint64_t id{};

  [[nodiscard]] constexpr bool is_context() const noexcept { return is_context_stream(handle); }
  /// Whether this ref names one stream for sure: a context stream, or one with its driver id
  /// (a driver without cuStreamGetId gives 0: then a reused handle cannot be told apart, and
  /// the pool never records on such a stream after the call that named it).
  [[nodiscard]] constexpr bool identified() const noexcept { return is_context() || id != 0; }
  [[nodiscard]] constexpr bool is_none() const noexcept { return handle == 0 && id == none_id; }
  friend constexpr bool operator==(stream_ref a, stream_ref b) noexcept
  {
    return a.handle == b.handle && a.id == b.id;
  }
  friend constexpr bool operator!=(stream_ref a, stream_ref b) noexcept { return !(a == b); }

  /// No stream (record_stream not used): an id no driver hands out with the null handle.
  static constexpr std::uint64_t none_id = ~std::uint64_t{0};
  static constexpr stream_ref none() noexcept { return {0, none_id}; }
};

/// @brief Makes the keys of one device's streams. Stateless but for the driver it asks.
class stream_keys {
 public:
  stream_keys(driver& drv, int device) noexcept : driver_{&drv}, device_{device} {}

  /// @brief The key of a stream that its caller guarantees alive during this call: the
  /// per-thread stream as the legacy one (a free may come from another thread), context
  /// streams as they are, any other stream with its driver id (one cuStreamGetId).
  [[nodiscard]] stream_ref of_alive(stream_handle alive) const
  {
    if (alive == per_thread_stream) { return {legacy_stream, 0}; }
    if (is_context_stream(alive)) { return {alive, 0}; }
    return {alive, driver_->stream_id(device_, alive)};
  }

  /// @brief The key of the stream an allocation names (alive: it is allocated on).
  /// @throws std::invalid_argument for allocation_stream
  [[nodiscard]] stream_ref of_allocation(stream_handle stream) const
  {
    EMMPOOL_EXPECTS(stream != allocation_stream,
                    "allocation_stream names no stream to allocate on");
    return of_alive(stream);  // cuStreamGetId never waits
  }

  /// @brief The key a free of a block allocated on `allocated` is fenced on, freed from
  /// `stream`: the allocation's own key for allocation_stream or for that stream's handle
  /// (never asked again: the stream may be gone), else the caller's stream, alive now (its
  /// id is asked: the one step of a free that may throw, before anything changed).
  [[nodiscard]] stream_ref of_free(stream_ref allocated, stream_handle stream) const
  {
    return frees_on_allocation_stream(allocated, stream) ? allocated : of_alive(stream);
  }

  /// @brief The key record_stream(block, stream) fences first: `stream` is the caller's, alive
  /// until the free; 0, the CUDA runtime's name for the default stream, is the legacy one.
  /// @throws std::invalid_argument for allocation_stream
  [[nodiscard]] stream_ref of_recorded(stream_handle stream) const
  {
    EMMPOOL_EXPECTS(stream != allocation_stream, "allocation_stream names no stream to record");
    return of_alive(stream == 0 ? legacy_stream : stream);
  }

  /// @brief Whether a free from `stream` of a block allocated on `allocated` is fenced on the
  /// allocation's key: allocation_stream, or a stream with that stream's handle.
  [[nodiscard]] static constexpr bool frees_on_allocation_stream(stream_ref allocated,
                                                                 stream_handle stream) noexcept
  {
    return stream == allocation_stream || stream == allocated.handle;
  }

 private:
  driver* driver_;
  int device_;
};

}  // namespace detail
}  // namespace emmpool
