/**
 * @file pool_layout.hpp
 * @brief What a device pool says of its segments: the blocks that tile them (a memory
 * snapshot), where a block lies for IPC, and the segment events a memory history records.
 */
#pragma once

#include <emmpool/driver.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace emmpool {

/// @brief Where a block is in its life, as a snapshot shows it.
enum class block_status : std::uint8_t { free = 0, allocated = 1, waiting = 2 };

/// @brief Which requests a segment serves: small ones, large ones, or (growable) large ones
/// from pages mapped on demand into one address reservation.
enum class segment_type : std::uint8_t { small = 0, large = 1, growable = 2 };

/// @brief One block of a pool's segments (pool_queries::layout()). The blocks of a segment
/// tile it, in address order.
struct layout_block {
  device_ptr segment;          ///< the segment's base
  std::size_t segment_size;
  device_ptr ptr;
  std::size_t size;
  block_status state;
  std::uint8_t tag;            ///< the library that allocated it (alloc_tag; 0 if free)
  segment_type kind;           ///< growable: address space, its free blocks mapped in part
  stream_handle stream;        ///< the stream named at allocation (legacy_stream: none)
};

/// @brief Where a pooled block lies in its segment, for IPC.
struct ipc_info {
  ipc_bytes handle;            ///< the segment's handle
  device_ptr segment_base;
  std::size_t segment_size;
  std::size_t offset;          ///< block address - segment base
};

/// @brief A shared block's key: 16 random bytes, made when the block is first shared and
/// forgotten when it is freed (or, held, when its last hold goes). Only a process that was
/// given it may ask for the block's pages, and only while the block is the one shared.
using share_key = std::array<unsigned char, 16>;

/// @brief The pages under a block of the growable segment, for another process to map
/// (pool_sharing::share_pages): one file descriptor per page, in address order. The descriptors
/// are the pool's, valid while the pages are (a page's goes when the page goes back to the
/// driver): duplicate them to send them, never close them.
struct shared_pages {
  device_ptr first_page;   ///< the address of the first page
  std::size_t page_size;
  std::size_t offset;      ///< the shared address - first_page
  std::size_t block_size;  ///< the block's bytes from the shared address on
  std::vector<int> fds;
  share_key key;           ///< what a receiver shows to be given them (ipc_service.hpp)
};

/// @brief A change of the memory a pool holds from the driver, for a memory history
/// (pool_observers::take_segment_events()): a fixed segment made or released, or pages of the
/// growable segment mapped or unmapped.
struct segment_event {
  enum class kind : std::uint8_t { made = 0, released = 1, mapped = 2, unmapped = 3 };
  kind what;
  segment_type type;
  std::uint8_t tag;            ///< the library whose request made it (alloc_tag); 0 otherwise
  device_ptr address;          ///< the segment's base, or the first page mapped or unmapped
  std::size_t size;            ///< bytes made, released, mapped or unmapped
};

}  // namespace emmpool
