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
  /// shared_pages); std::nullopt if no live growable block holds ptr (a fixed block's is
  /// ipc_handle()'s). The block's pages stay while it is live, exported or not.
  /// @throws cuda_error where the driver cannot export them
  [[nodiscard]] std::optional<shared_pages> share_pages(device_ptr ptr);

  /// @brief Duplicates of the descriptors share_pages() gave for the pages from `first_page`
  /// on (the sending process's numbers, `fds`), for another process that asks for them (the
  /// IPC service); std::nullopt where they no longer describe the pages mapped there (the
  /// block was freed since). The caller owns and closes them. @throws pool_error
  [[nodiscard]] std::optional<std::vector<int>> duplicate_shared_pages(
    device_ptr first_page, std::size_t page_size, std::vector<int> const& fds);

  /// @brief Keep the live block holding ptr (which may point inside it) from being handed out
  /// again until as many release_hold() as hold(): memory another process may still read or
  /// write (an export). Its free while held is taken (the caller's pointer is no longer live,
  /// a second free is an error) but waits, its bytes still in use, for the last release; then
  /// it is fenced as any free. A reset releases every hold.
  /// @return the block's address, which release_hold() takes
  /// @throws pool_error if no live block of this pool holds ptr
  [[nodiscard]] device_ptr hold(device_ptr ptr);
  /// @brief Undo one hold() of the block at `block`; the last one of a block freed meanwhile
  /// settles its free. Nothing for a block the pool no longer holds (a reset released it, or
  /// a forked child's copy of the pool).
  void release_hold(device_ptr block);
  /// @brief Blocks held now (hold()), freed or not.
  [[nodiscard]] std::size_t held_blocks() const;

 private:
  device_pool* pool_;
};

}  // namespace emmpool
