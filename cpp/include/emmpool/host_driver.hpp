/**
 * @file host_driver.hpp
 * @brief A driver with no GPU: fake device address ranges, and events a test completes by hand.
 *
 * It lets CI run the pool logic (splitting, coalescing, deferred reuse, the out-of-memory
 * ladder, threads) without a GPU. Device "memory" is address space only: nothing may be
 * dereferenced, which is all a pool needs. Faults can be injected at chosen calls.
 *
 * Streams: any handle other than the context streams is a live stream the first time it is
 * seen (tests may use made-up handles), with an id of its own. create_stream() and
 * destroy_stream() model a client's stream lifetime: a destroyed stream's handle may be handed
 * to the next created stream, as CUDA may, and any use of a destroyed stream's handle
 * (stream_id, record_event) counts in stats().dead_stream_uses and throws
 * dead_stream_error, which no pool code catches: the test fails loudly.
 */
#pragma once

#include <emmpool/driver.hpp>

#include <cstdint>
#include <map>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace emmpool {

/// @brief A destroyed stream's handle reached the host driver: on a GPU, undefined behaviour.
struct dead_stream_error : std::logic_error {
  using std::logic_error::logic_error;
};

class host_driver final : public driver {
 public:
  /// @param devices number of fake devices
  /// @param capacity bytes each fake device can hand out before allocate() reports out of memory
  explicit host_driver(int devices = 1, std::size_t capacity = std::size_t{1} << 34);
  ~host_driver() override;

  // --- test controls ------------------------------------------------------------------------
  /// @brief Complete every event recorded so far (the GPU caught up).
  void complete_all_events();
  /// @brief When on, events complete as soon as they are recorded (an idle GPU).
  void set_auto_complete(bool on);
  /// @brief The next n calls to allocate() fail with out_of_memory.
  void fail_next_allocations(int n);
  /// @brief The next n calls to record_event() fail with a cuda_error.
  void fail_next_event_records(int n);
  /// @brief The next n calls to deallocate() fail with a cuda_error (a sticky error, say).
  void fail_next_deallocations(int n);
  /// @brief The next n calls to synchronize_device() fail with a cuda_error, waiting for
  /// nothing (a sticky error: the work it would wait for may still run).
  void fail_next_device_syncs(int n);
  /// @brief Run `wait` at every synchronize_event() and synchronize_device(), before they
  /// return (and outside the driver's lock): the GPU work they wait for, e.g. a host callback
  /// that needs a lock of the program's (Python's GIL). Empty: none.
  void set_sync_wait(std::function<void()> wait);
  /// @brief Change a device's capacity (bytes).
  void set_capacity(int device, std::size_t bytes);
  /// @brief Pretend the device's context was reset: every live segment becomes invalid (its
  /// buffer id reads 0) and freeing one is an error, as with a real context reset.
  void invalidate_device(int device);
  /// @brief A new stream: the handle of the most recently destroyed stream if there is one
  /// (handles get reused), a new handle otherwise; always a new id.
  [[nodiscard]] stream_handle create_stream();
  /// @brief Destroy a stream: from now on its handle must not be used, until a new stream
  /// gets it. @throws dead_stream_error if it is a context stream or already destroyed
  void destroy_stream(stream_handle stream);
  /// @brief Off: stream_id() answers 0, as a driver without cuStreamGetId (before CUDA 12).
  void set_stream_ids(bool on);
  /// @brief Off: vmm_page_size() answers 0, as a device without
  /// CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (the pool falls back to fixed
  /// segments). On by default, with 2 MiB pages.
  void set_vmm_supported(bool on);
  /// @brief The next n calls to create_physical() fail with out_of_memory (cuMemCreate).
  void fail_next_creates(int n);
  /// @brief The next n calls to map_physical() fail with a cuda_error (cuMemMap), after
  /// `after` more succeed (to fail a map part way through a range).
  void fail_next_maps(int n, int after = 0);
  /// @brief The next n calls to unmap_physical() fail with a cuda_error.
  void fail_next_unmaps(int n);
  /// @brief The next n calls to reserve_address() fail with a cuda_error.
  void fail_next_reservations(int n);
  /// @brief The next n calls to export_physical() fail with a cuda_error
  /// (cuMemExportToShareableHandle), after `after` more succeed.
  void fail_next_exports(int n, int after = 0);
  /// @brief The next n calls to import_physical() fail with a cuda_error
  /// (cuMemImportFromShareableHandle), after `after` more succeed.
  void fail_next_imports(int n, int after = 0);

  struct counters {
    std::uint64_t allocations, deallocations, event_records, event_queries, event_syncs;
    std::size_t bytes_reserved;   ///< bytes in live segments, all devices
    std::size_t live_segments;    ///< segments not yet deallocated, all devices
    std::size_t live_events;      ///< events created and not destroyed
    std::uint64_t context_releases;
    std::uint64_t device_syncs;
    std::uint64_t stream_id_queries;
    std::uint64_t dead_stream_uses;  ///< must stay 0: see the file comment
    // Virtual memory management. Physical memory counts against the device's capacity as
    // segments do, from its creation until its last handle is released and its last mapping
    // unmapped; bytes_physical is not part of bytes_reserved.
    std::uint64_t maps, unmaps, creates, releases, exports, imports;
    std::size_t bytes_physical;      ///< physical memory alive, all devices
    std::size_t bytes_mapped;        ///< physical memory mapped, all devices
    std::size_t live_mappings;
    std::size_t live_handles;        ///< created or imported, not released
    std::size_t live_reservations;
    std::size_t bytes_address_reserved;
    std::size_t live_exports;        ///< exported descriptors some process still holds open
  };
  [[nodiscard]] counters stats() const;
  /// @brief Whether every byte of [ptr, ptr + bytes) is memory a kernel could touch: inside a
  /// live segment, or inside mapped pages. What a block in use or pending must always be.
  [[nodiscard]] bool accessible(int device, device_ptr ptr, std::size_t bytes) const;

  // --- driver -------------------------------------------------------------------------------
  [[nodiscard]] std::string name() const override { return "host"; }
  [[nodiscard]] int device_count() override { return devices_; }
  [[nodiscard]] int current_device() override { return 0; }
  [[nodiscard]] device_ptr allocate(int device, std::size_t bytes) override;
  void deallocate(int device, device_ptr ptr) override;
  [[nodiscard]] std::uint64_t buffer_id(int device, device_ptr ptr) override;
  [[nodiscard]] event_handle create_event(int device) override;
  void destroy_event(int device, event_handle event) override;
  void record_event(int device, event_handle event, stream_handle stream) override;
  [[nodiscard]] bool event_completed(int device, event_handle event) override;
  void synchronize_event(int device, event_handle event) override;
  void synchronize_device(int device) override;
  [[nodiscard]] std::uint64_t stream_id(int device, stream_handle stream) override;
  void release_context(int device) override;
  [[nodiscard]] ipc_bytes ipc_handle(int device, device_ptr segment_base) override;
  /// The model's processes are one: a handle opens the segment it names, while it is live.
  [[nodiscard]] device_ptr ipc_open(int device, ipc_bytes const& handle) override;
  void ipc_close(int device, device_ptr ptr) override;
  /// @brief Legacy IPC handles opened and not closed yet (each open counts, as CUDA's do).
  [[nodiscard]] std::size_t ipc_opens() const;
  [[nodiscard]] memory_info memory_info_of(int device) override;
  [[nodiscard]] void* host_allocate(int device, std::size_t bytes, unsigned flags) override;
  void host_deallocate(int device, void* ptr) override;
  void host_register(int device, void* ptr, std::size_t bytes, unsigned flags) override;
  void host_unregister(int device, void* ptr) override;
  // VMM, modelled as CUDA checks it: reservations are page aligned; a mapping maps all of one
  // live handle, inside one reservation, page aligned, over no other mapping; an unmap names
  // exactly one mapping; a reservation is freed whole and only once it holds no mapping; the
  // memory lives while a handle to it (created, or imported from an exported descriptor), a
  // mapping of it or an exported descriptor of it does. An exported descriptor is a real one,
  // one end of a socket pair whose other end the driver keeps: it names the memory (import
  // reads that back) and, as CUDA's does, holds it for as long as any copy of it is open, in
  // this process or one it was passed to; the driver sees the last copy close when its own
  // end hangs up. Within one host_driver: the model has no memory across processes.
  [[nodiscard]] std::size_t vmm_page_size(int device) override;
  [[nodiscard]] device_ptr reserve_address(int device, std::size_t bytes) override;
  void free_address(int device, device_ptr base, std::size_t bytes) override;
  [[nodiscard]] physical_handle create_physical(int device, std::size_t bytes) override;
  void release_physical(int device, physical_handle h) override;
  void map_physical(int device, device_ptr at, std::size_t bytes, physical_handle h) override;
  void unmap_physical(int device, device_ptr at, std::size_t bytes) override;
  [[nodiscard]] int export_physical(int device, physical_handle h) override;
  [[nodiscard]] physical_handle import_physical(int device, int fd) override;
  /// The one it returns and the end of the pair it keeps.
  [[nodiscard]] std::size_t descriptors_per_export() const noexcept override { return 2; }

 private:
  struct reservation {
    int device;
    std::size_t bytes;
  };
  struct memory {
    int device;
    std::size_t bytes;
    std::size_t holders;  // live handles and mappings
  };
  struct mapping {
    int device;
    std::size_t bytes;
    std::uint64_t memory;
  };
  struct segment {
    int device;
    std::size_t bytes;
    std::uint64_t id;
  };
  void check_device(int device) const;
  void wait_for_work(std::unique_lock<std::mutex>& lock);  // sync_wait_, the lock let go
  std::uint64_t live_stream_id(stream_handle stream, char const* call);  // mutex_ held
  void drop_holder(std::uint64_t memory);  // mutex_ held: the memory goes with its last
  void reap_exports();                     // mutex_ held: exports closed everywhere let go

  mutable std::mutex mutex_;
  int devices_;
  std::vector<std::size_t> capacity_;
  std::vector<std::size_t> used_;
  std::vector<device_ptr> next_address_;
  std::map<device_ptr, segment> segments_;
  std::map<device_ptr, reservation> reservations_;
  std::map<device_ptr, mapping> mappings_;
  std::map<std::uint64_t, memory> memories_;
  std::map<physical_handle, std::uint64_t> handles_;  // live handle -> its memory
  physical_handle next_handle_ = 1;
  std::uint64_t next_memory_ = 1;
  bool vmm_supported_ = true;
  // An injected failure: `n` calls fail once `after` more have succeeded.
  struct fault {
    int n{};
    int after{};
    bool due() noexcept  // counts this call
    {
      if (n == 0) { return false; }
      if (after > 0) {
        --after;
        return false;
      }
      --n;
      return true;
    }
  };
  int fail_creates_ = 0;
  fault fail_maps_;
  fault fail_exports_;
  fault fail_imports_;
  struct exported {
    int kept;                // the driver's end of the pair; the other end was handed out
    std::uint64_t memory;
  };
  std::vector<exported> exports_;
  std::map<device_ptr, std::size_t> ipc_opens_;  // legacy IPC opens by base
  int fail_unmaps_ = 0;
  int fail_reservations_ = 0;
  std::unordered_map<event_handle, bool> events_;  // event -> completed
  // Where and when each event was last recorded: a stream's work completes in order, so
  // waiting for one of its events completes those recorded on it before (context streams,
  // the pool's one legacy stream, count as one).
  struct recording {
    stream_handle stream;
    std::uint64_t order;
  };
  std::unordered_map<event_handle, recording> recorded_;
  std::uint64_t records_{};
  std::unordered_map<void*, std::size_t> host_allocations_;
  std::map<std::uintptr_t, std::size_t> host_registrations_;
  std::unordered_map<stream_handle, std::uint64_t> streams_;  // live stream -> id
  std::unordered_set<stream_handle> dead_streams_;
  std::vector<stream_handle> reusable_handles_;  // destroyed, newest last
  stream_handle next_stream_ = 0x7000'0000;
  std::uint64_t next_stream_id_ = 1;
  std::uint64_t next_event_ = 1;
  std::uint64_t next_buffer_id_ = 1;
  bool auto_complete_ = false;
  std::function<void()> sync_wait_;
  bool stream_ids_ = true;
  int fail_allocations_ = 0;
  int fail_event_records_ = 0;
  int fail_deallocations_ = 0;
  int fail_device_syncs_ = 0;
  counters counters_{};
};

}  // namespace emmpool
