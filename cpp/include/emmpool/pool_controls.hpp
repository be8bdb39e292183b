/**
 * @file pool_controls.hpp
 * @brief What a framework asks of a device pool beyond allocating and freeing: a cap, memory
 * another allocator holds against it, CUDA graph captures, deferred cleanup, a reset.
 *
 * A view of one pool (device_pool.hpp), made where needed (`pool_controls{pool}.reset()`):
 * it holds nothing of its own, takes the pool's lock for each call, and changes only what the
 * pool lets it (it is a friend of the pool's; the pool never calls it).
 */
#pragma once

#include <cstddef>

namespace emmpool {

class device_pool;

class pool_controls {
 public:
  explicit pool_controls(device_pool& pool) noexcept : pool_{&pool} {}

  // ---- the cap (detail/pool_cap.hpp) ----------------------------------------------------------

  /// @brief Change the cap on bytes reserved (what maximum_size set; 0: none but the device's
  /// memory). Wholly free segments go back to the driver until reserved fits, if they can;
  /// otherwise the cap only stops growth. Frees waiting for their fence are waited for first
  /// (not during a capture). @throws pool_error if more than `bytes` is still in use
  void set_maximum_size(std::size_t bytes);
  /// @brief The cap on bytes reserved (SIZE_MAX: none).
  [[nodiscard]] std::size_t maximum_size() const;

  /// @brief Bytes that another allocator reserves for this pool's clients on the device (a
  /// PyTorch MemPool made with its own allocator) change by `delta`: they count against the cap
  /// as the pool's own segments do, so that the device keeps one budget. An increase that
  /// would pass the cap first gives wholly free segments back (not during a capture or a
  /// deferral). @returns false, counting nothing, if the increase still does not fit
  [[nodiscard]] bool reserve_outside(std::ptrdiff_t delta);
  /// @brief What reserve_outside() counts now.
  [[nodiscard]] std::size_t reserved_outside() const;

  // ---- when not to give memory back (detail/capture_mode.hpp) ---------------------------------

  /// @brief While deferred (calls nest), nothing is returned to the driver; blocks still flow
  /// back into the pool.
  void defer_cleanup_begin();
  void defer_cleanup_end();

  /// @brief A CUDA graph may be captured on this device until the matching capture_end()
  /// (PyTorch's private pools say when; calls nest). Meanwhile the pool makes no CUDA call that
  /// a capture forbids or would record into the graph. Frees still return blocks to their
  /// stream's order; those with a record_stream fence wait, unfenced, until the last
  /// capture_end(); what waits for a fence waits until then too. Growth still asks the driver:
  /// a capturing thread relaxes its capture mode around its own calls.
  void capture_begin();
  /// @throws pool_error without a matching capture_begin()
  void capture_end();
  [[nodiscard]] bool capturing() const;

  // ---- a reset (detail/retired_segments.hpp) --------------------------------------------------

  /// @brief The context is about to be reset: wait for pending frees, release everything free,
  /// retire segments that still hold live blocks (never reused, freed when empty, and only if
  /// the driver still knows them), release every hold (pool_sharing), and drop cached events.
  /// @throws pool_error while a CUDA graph is captured on the device (capture_begin() without
  /// its capture_end()): waiting for frees would synchronize inside the capture
  void reset();

  /// @brief The peaks (in use, reserved) start again from now.
  void reset_peaks();

 private:
  device_pool* pool_;
};

}  // namespace emmpool
