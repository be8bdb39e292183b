/**
 * @file ipc_service.hpp
 * @brief How a block of this process's pools reaches another process safely: the pages of a
 * growable block pass as file descriptors over a Unix socket, and a block stays unreused for
 * as long as any process may use it.
 *
 * Descriptors. A growable block's pages are shared one descriptor per page
 * (cuMemExportToShareableHandle). A descriptor crosses processes only through a Unix socket
 * (SCM_RIGHTS) or pidfd_getfd, PyTorch's way for its expandable segments, which needs ptrace
 * rights over the sender: Yama's ptrace_scope=1 (Ubuntu's default) refuses a child its
 * parent's, and containers without CAP_SYS_PTRACE refuse it outright. So each process that
 * shares pages runs this service: a thread listening on an abstract Unix socket, which hands
 * a receiver duplicates of the pages' descriptors (as multiprocessing's resource sharer, NCCL
 * and cuda.core pass theirs). A receiver asks with an offer: the service's address, the
 * block's key (pool_sharing::share_pages: 16 random bytes, only in the handles of that block),
 * and the pages as the sender numbers them (the first page's address, the page size, the
 * sender's descriptor numbers). The service serves only the block of that key, while it is
 * the block shared (not freed, or held by a lease), and only its own pages
 * (pool_sharing::duplicate_shared_pages): an offer of a block freed since is refused, never
 * served with another block's pages, and a handle of one block reaches no other. It also
 * refuses a peer of another user (SO_PEERCRED), and a receiver talks only to a service of its
 * own user.
 *
 * Leases. A receiver maps the pages, and the sender's pool would hand them to a new block as
 * soon as the sender frees its own: the receiver's writes would land in the new block. A lease
 * (lease()) holds the block (pool_sharing::hold) for as long as any copy of a pipe's write end
 * is open, in any process (the sender's handle, a copy in flight, each receiver's handle and
 * mapping): the service watches the read end, and when the last writer is gone (closed, or its
 * process ended) it releases the hold. The kernel does the counting, so a receiver that dies
 * still lets the block go.
 *
 * Thread-safe. The service thread watches the leases and accepts connections; each request is
 * served on a thread of its own (at most max_serving at once), so that a peer that stops
 * talking delays no lease and no other request. Those threads call into the pools (hold
 * release, duplicates), never the other way; the service is started on first use and lives
 * as long as the process (made by pool_registry, never destroyed). In a child forked from a
 * process that started it the service is inert: the threads did not follow, CUDA cannot be
 * used there anyway, and the child closes its copy of the listener at once (so that the name
 * goes with the process that made it).
 */
#pragma once

#include <emmpool/driver.hpp>
#include <emmpool/pool_layout.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

namespace emmpool {

class device_pool;

/// @brief What a receiver needs to ask the sending process for a block's pages.
struct page_offer {
  std::string address;       ///< the sender's service (an abstract socket name, leading NUL)
  share_key key{};           ///< the block's (pool_sharing::share_pages)
  int device{};              ///< the sender's device ordinal (its pool)
  device_ptr first_page{};   ///< the address of the first page, in the sender
  std::size_t page_size{};
  std::vector<int> fds;      ///< the sender's descriptor numbers, one per page
};

class ipc_service {
 public:
  /// `pool_of(device)`: the pool of a device if it exists, else null (the service never makes
  /// one: a request names a device, and a device the process never used holds nothing).
  explicit ipc_service(std::function<device_pool*(int)> pool_of);
  ipc_service(ipc_service const&)            = delete;
  ipc_service& operator=(ipc_service const&) = delete;

  /// @brief The service's address, for offers; starts it on first use.
  /// @throws pool_error in a forked child, or where no socket or thread can be made
  [[nodiscard]] std::string address();

  /// @brief Hold the live block of `device`'s pool holding ptr until every copy of the
  /// returned descriptor (the write end of a pipe, close-on-exec, the caller's) is closed,
  /// here or in any process it is passed to. @return {the descriptor, the block's address}
  /// @throws pool_error (ptr no live block: nothing held)
  [[nodiscard]] std::pair<int, device_ptr> lease(int device, device_ptr ptr);
  /// @brief Leases whose writers are not all closed yet.
  [[nodiscard]] std::size_t leases() const;

  /// @brief Requests answered, and refused (a wrong key or peer, pages gone), so far.
  [[nodiscard]] std::uint64_t served() const;
  [[nodiscard]] std::uint64_t refused() const;

  /// @brief Descriptors of this process for the pages of `offer`, asked of the process that
  /// made it (its service: no ptrace rights needed). The caller owns and closes them.
  /// @throws pool_error saying why not (the sender gone or refusing, the descriptor limit)
  [[nodiscard]] static std::vector<int> fetch(page_offer const& offer);

  /// @brief The most descriptors one offer may name (an address space of pages is far less).
  static constexpr std::size_t max_pages = std::size_t{1} << 20;
  /// @brief Requests served at once; a connection past them is closed unanswered (its peer
  /// says the sender did not answer).
  static constexpr int max_serving = 16;

 private:
  struct lease_entry {
    int read_end;
    int device;
    device_ptr at;
    std::uint64_t generation;  // the pool's at the hold: a reset since released it
  };
  void start();                   // once: socket, thread
  void run() noexcept;            // the thread
  void accept_one(int connection) noexcept;  // served on a thread of its own
  void serve(int connection) noexcept;
  void wake() noexcept;
  [[nodiscard]] bool forked() const noexcept { return owner_.load() != ::getpid(); }

  std::function<device_pool*(int)> pool_of_;
  mutable std::mutex mutex_;
  std::once_flag started_;
  std::string start_error_;       // why start() failed, if it did
  std::string address_;
  std::atomic<long> owner_{0};    // the process that started it (a forked child is another)
  std::atomic<int> serving_{0};   // requests being served now
  int listen_fd_{-1};
  int wake_fd_{-1};               // an eventfd: new leases to watch
  std::vector<lease_entry> leases_;
  std::uint64_t served_{};
  std::uint64_t refused_{};
};

}  // namespace emmpool
