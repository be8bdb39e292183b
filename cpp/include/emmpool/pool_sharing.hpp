/**
 * @file pool_sharing.hpp
 * @brief A device pool's blocks as another process reaches them: a fixed segment's legacy IPC
 * handle, a growable block's pages (their descriptors), and holds, which keep a block from
 * reuse while another process may use it (ipc_service.hpp carries them across).
 *
 * A view of one pool (device_pool.hpp), made where needed (`pool_sharing{pool}.hold(p)`): it
 * holds nothing of its own and takes the pool's lock for each call (a friend of the pool's;
 * the pool never calls it).
 */
#pragma once

#include <emmpool/driver.hpp>
#include <emmpool/pool_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace emmpool {

class device_pool;

class pool_sharing {
 public:
  explicit pool_sharing(device_pool& pool) noexcept : pool_{&pool} {}

  /// @brief IPC description of the block containing ptr (which may point inside it);
  /// std::nullopt if the pool did not allocate it. A segment is never released to the driver
  /// while a block in it is live, exported or not.
  /// @throws pool_error for a block of a growable segment (cuIpcGetMemHandle cannot export
  /// VMM memory: share_pages() shares it)
  [[nodiscard]] std::optional<ipc_info> ipc_handle(device_ptr ptr);

  /// @brief For a live block of the growable segment holding ptr (which may point inside it):
  /// the pages under it, as another process maps them (their file descriptors: see
  /// shared_pages), and the block's key (made on its first share, the same until it is
  /// freed); std::nullopt if no live growable block holds ptr (a fixed block's is
  /// ipc_handle()'s). The block's pages stay while it is live, exported or not.
  /// @throws cuda_error where the driver cannot export them, pool_error (no random key)
  [[nodiscard]] std::optional<shared_pages> share_pages(device_ptr ptr);

  /// @brief Whether another process asking with `key` for these pages (as
  /// duplicate_shared_pages() takes them) would be given them now.
  [[nodiscard]] bool offers(unsigned char const* key, device_ptr first_page,
                            std::size_t page_size, std::vector<int> const& fds) const;
  /// @brief Duplicates of the descriptors share_pages() gave for a block's pages (the
  /// sending process's numbers, `fds`, from `first_page` on), for another process that asks
  /// for them (the IPC service) with the block's `key` (16 bytes); std::nullopt unless the
  /// block of that key is still the one shared (not freed, or held: hold()) and `first_page`,
  /// `page_size` and `fds` are what share_pages() gave for all of it. The caller owns and
  /// closes them. @throws pool_error
  [[nodiscard]] std::optional<std::vector<int>> duplicate_shared_pages(
    unsigned char const* key, device_ptr first_page, std::size_t page_size,
    std::vector<int> const& fds);

  /// @brief Keep the live block holding ptr (which may point inside it) from being handed out
  /// again until as many release_hold() as hold(): memory another process may still read or
  /// write (an export). Its free while held is taken (the caller's pointer is no longer live,
  /// a second free is an error) but waits, its bytes still in use, for the last release; then
  /// it is fenced as any free. A reset releases every hold.
  /// @param generation_out where given, the pool's reset generation, read under the same lock
  /// @return the block's address, which release_hold() takes
  /// @throws pool_error if no live block of this pool holds ptr
  [[nodiscard]] device_ptr hold(device_ptr ptr, std::uint64_t* generation_out = nullptr);
  /// @brief Undo one hold() of the block at `block`; the last one of a block freed meanwhile
  /// settles its free. Nothing for a block the pool no longer holds (a reset released it, or
  /// a forked child's copy of the pool), nor where `generation` (hold()'s) is not the pool's
  /// now: after a reset, a block at the same address is another block, held by others.
  void release_hold(device_ptr block, std::optional<std::uint64_t> generation = std::nullopt);
  /// @brief Blocks held now (hold()), freed or not.
  [[nodiscard]] std::size_t held_blocks() const;

 private:
  device_pool* pool_;
};

}  // namespace emmpool
