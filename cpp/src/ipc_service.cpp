#include <emmpool/pool_sharing.hpp>
#include <emmpool/detail/descriptors.hpp>
#include <emmpool/detail/fork_guard.hpp>
#include <emmpool/detail/random_key.hpp>
#include <emmpool/device_pool.hpp>
#include <emmpool/error.hpp>
#include <emmpool/ipc_service.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

namespace emmpool {

namespace {

// The wire: a request, then a reply and the descriptors in messages of at most
// fds_per_message (the kernel's SCM_MAX_FD is 253), each with one byte of payload.
constexpr char request_magic[8] = {'E', 'M', 'M', 'P', 'O', 'O', 'L', 'Q'};
constexpr char reply_magic[8]   = {'E', 'M', 'M', 'P', 'O', 'O', 'L', 'A'};
constexpr std::uint32_t wire_version   = 2;
constexpr std::size_t fds_per_message  = 250;
constexpr int io_timeout_seconds       = 10;  // a peer that stops answering is dropped

struct request_header {
  char magic[8];
  std::uint32_t version;
  std::int32_t device;
  unsigned char key[16];  // the block's (share_key)
  std::uint64_t first_page;
  std::uint64_t page_size;
  std::uint64_t count;  // then `count` int32 descriptor numbers
};

struct reply_header {
  char magic[8];
  std::uint32_t refused;   // 0: `count` descriptors follow; else `message_size` bytes say why
  std::uint32_t message_size;
  std::uint64_t count;
};

std::string errno_text() { return std::strerror(errno); }

void set_timeouts(int fd)
{
  timeval tv{io_timeout_seconds, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

bool send_all(int fd, void const* data, std::size_t n)
{
  auto const* p = static_cast<char const*>(data);
  while (n > 0) {
    auto const k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) { continue; }
    if (k <= 0) { return false; }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

bool receive_all(int fd, void* data, std::size_t n)
{
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    auto const k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) { continue; }
    if (k <= 0) { return false; }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

// One message of descriptors (and a byte, as SCM_RIGHTS needs some payload).
bool send_fds(int fd, int const* fds, std::size_t n)
{
  char byte = 0;
  iovec io{&byte, 1};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * n));
  msghdr msg{};
  msg.msg_iov        = &io;
  msg.msg_iovlen     = 1;
  msg.msg_control    = control.data();
  msg.msg_controllen = control.size();
  auto* c            = CMSG_FIRSTHDR(&msg);
  c->cmsg_level      = SOL_SOCKET;
  c->cmsg_type       = SCM_RIGHTS;
  c->cmsg_len        = CMSG_LEN(sizeof(int) * n);
  std::memcpy(CMSG_DATA(c), fds, sizeof(int) * n);
  for (;;) {
    auto const k = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) { continue; }
    return k == 1;
  }
}

// Receive one message of descriptors into `out`; false (keeping what came) on failure, with
// `truncated` set where the kernel dropped some (the receiver at its descriptor limit).
bool receive_fds(int fd, std::vector<int>& out, bool& truncated)
{
  char byte = 0;
  iovec io{&byte, 1};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds_per_message));
  msghdr msg{};
  msg.msg_iov        = &io;
  msg.msg_iovlen     = 1;
  msg.msg_control    = control.data();
  msg.msg_controllen = control.size();
  ssize_t k          = 0;
  do {
    k = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  } while (k < 0 && errno == EINTR);
  bool got = false;
  for (auto* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) { continue; }
    auto const n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < n; ++i) {
      int d = -1;
      std::memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof d);
      out.push_back(d);
    }
    got = n > 0;
  }
  truncated = k == 1 && (msg.msg_flags & MSG_CTRUNC) != 0;
  return k == 1 && got && !truncated;
}

sockaddr_un address_of(std::string const& name, socklen_t& length)
{
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  EMMPOOL_EXPECTS(!name.empty() && name.size() < sizeof a.sun_path,
                  "an IPC service address is an abstract socket name");
  std::memcpy(a.sun_path, name.data(), name.size());
  length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  return a;
}

// Closes the descriptors it owns when it goes (a reply that failed half way included).
struct owned_descriptors {
  std::vector<int> fds;
  ~owned_descriptors() { detail::close_descriptors(fds); }
};

// The process at the other end of connection `c`, as the kernel says (SO_PEERCRED).
std::optional<ucred> peer_of(int c) noexcept
{
  ucred peer{};
  socklen_t length = sizeof peer;
  if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0) { return std::nullopt; }
  return peer;
}

}  // namespace

ipc_service::ipc_service(std::function<device_pool*(int)> pool_of) : pool_of_{std::move(pool_of)} {}

void ipc_service::start()
{
  std::call_once(started_, [this] {
    try {
      // Every local process may list abstract socket names: the name says nothing of a key.
      auto const tag = detail::random_key();
      char name[64];
      std::snprintf(name, sizeof name, "emmpool-%d-%02x%02x%02x%02x%02x%02x%02x%02x",
                    static_cast<int>(::getpid()), tag[0], tag[1], tag[2], tag[3], tag[4], tag[5],
                    tag[6], tag[7]);
      // An abstract name (a leading NUL): no file to clean up, gone with the socket.
      std::string address(1, '\0');
      address += name;
      int const fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) { throw pool_error{"emmpool: no socket for the IPC service: " + errno_text()}; }
      socklen_t length = 0;
      auto const a     = address_of(address, length);
      if (::bind(fd, reinterpret_cast<sockaddr const*>(&a), length) != 0 || ::listen(fd, 64) != 0) {
        auto const why = errno_text();
        ::close(fd);
        throw pool_error{"emmpool: the IPC service cannot listen: " + why};
      }
      int const wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      if (wake < 0) {
        auto const why = errno_text();
        ::close(fd);
        throw pool_error{"emmpool: no eventfd for the IPC service: " + why};
      }
      listen_fd_ = fd;
      wake_fd_   = wake;
      address_   = std::move(address);
      owner_     = ::getpid();
      std::thread{[this] { run(); }}.detach();  // lives as long as the process
      // A forked child keeps no copy of the listener: once this process exits its name is
      // gone, and a late receiver is refused at once rather than queued on a child's copy.
      static ipc_service* started = this;  // pool_registry's: one per process
      (void)::pthread_atfork(nullptr, nullptr, [] {
        ::close(started->listen_fd_);
        ::close(started->wake_fd_);
      });
    } catch (std::exception const& e) {
      start_error_ = e.what();
    }
  });
  if (!start_error_.empty()) { throw pool_error{start_error_}; }
  if (owner_ != ::getpid()) { detail::throw_forked(); }
}

std::string ipc_service::address()
{
  start();
  return address_;
}

std::pair<int, device_ptr> ipc_service::lease(int device, device_ptr ptr)
{
  start();
  auto* const pool = pool_of_(device);
  if (pool == nullptr) {
    throw pool_error{"emmpool: device " + std::to_string(device) + " has no pool to hold a block of"};
  }
  std::uint64_t generation = 0;
  auto const at = pool_sharing{*pool}.hold(ptr, &generation);  // throws: nothing held
  int ends[2]   = {-1, -1};
  if (::pipe2(ends, O_CLOEXEC) != 0) {
    auto const why = errno_text();
    pool_sharing{*pool}.release_hold(at, generation);
    throw pool_error{"emmpool: no pipe for an IPC lease: " + why};
  }
  (void)::fcntl(ends[0], F_SETFL, O_NONBLOCK);
  {
    std::lock_guard lock{mutex_};
    leases_.push_back({ends[0], device, at, generation});
  }
  wake();
  return {ends[1], at};
}

// In a forked child each answers 0 without the lock, which a thread that did not follow may
// have held at the fork.
std::size_t ipc_service::leases() const
{
  if (forked()) { return 0; }
  std::lock_guard lock{mutex_};
  return leases_.size();
}

std::uint64_t ipc_service::served() const
{
  if (forked()) { return 0; }
  std::lock_guard lock{mutex_};
  return served_;
}

std::uint64_t ipc_service::refused() const
{
  if (forked()) { return 0; }
  std::lock_guard lock{mutex_};
  return refused_;
}

void ipc_service::wake() noexcept
{
  std::uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof one);
}

namespace {

// Whether every writer of a lease's pipe is gone: its read end at end of file. What a writer
// wrote (nobody should) is read and dropped: only the end releases the hold.
bool writers_gone(int read_end) noexcept
{
  char sink[256];
  for (;;) {
    auto const k = ::read(read_end, sink, sizeof sink);
    if (k == 0) { return true; }
    if (k > 0 || errno == EINTR) { continue; }
    return errno != EAGAIN && errno != EWOULDBLOCK;  // another error: nothing more to watch
  }
}

}  // namespace

void ipc_service::run() noexcept
{
  std::vector<pollfd> watched;
  std::vector<lease_entry> watching;
  bool paused = false;  // accept() ran out of descriptors: the listener rests a moment
  for (;;) {
    {
      std::lock_guard lock{mutex_};
      watching = leases_;
    }
    watched.assign({pollfd{listen_fd_, static_cast<short>(paused ? 0 : POLLIN), 0},
                    pollfd{wake_fd_, POLLIN, 0}});
    for (auto const& l : watching) { watched.push_back({l.read_end, POLLIN, 0}); }
    if (::poll(watched.data(), watched.size(), paused ? 100 : -1) < 0) {
      if (errno == EINTR) { continue; }
      return;  // the process is going: nothing more to serve
    }
    paused = false;
    if ((watched[1].revents & POLLIN) != 0) {
      std::uint64_t n = 0;
      (void)::read(wake_fd_, &n, sizeof n);
    }
    for (std::size_t i = 0; i < watching.size(); ++i) {
      if (watched[i + 2].revents == 0 || !writers_gone(watching[i].read_end)) { continue; }
      auto const l = watching[i];
      {
        std::lock_guard lock{mutex_};
        leases_.erase(std::find_if(leases_.begin(), leases_.end(),
                                   [&](lease_entry const& e) { return e.read_end == l.read_end; }));
      }
      ::close(l.read_end);
      if (auto* pool = pool_of_(l.device)) {
        try {
          pool_sharing{*pool}.release_hold(l.at, l.generation);
        } catch (...) {
          // A settle that failed (an event record, say) leaves the block to the pool's next
          // call, as any free that failed: nothing to tell anyone here.
        }
      }
    }
    if ((watched[0].revents & POLLIN) != 0) {
      int const c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) {
        accept_one(c);
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        paused = true;  // the connection stays queued: polling again at once would spin
      }
    }
  }
}

void ipc_service::accept_one(int c) noexcept
{
  if (serving_.fetch_add(1) >= max_serving) {
    serving_.fetch_sub(1);
    ::close(c);
    return;
  }
  try {
    std::thread{[this, c] {
      serve(c);
      ::close(c);
      serving_.fetch_sub(1);
    }}.detach();
  } catch (...) {  // no thread: the peer hears nothing, as from a busy sender
    ::close(c);
    serving_.fetch_sub(1);
  }
}

void ipc_service::serve(int c) noexcept
{
  set_timeouts(c);
  auto refuse = [&](std::string const& why) {
    {
      std::lock_guard lock{mutex_};
      ++refused_;
    }
    reply_header r{};
    std::memcpy(r.magic, reply_magic, sizeof r.magic);
    r.refused      = 1;
    r.message_size = static_cast<std::uint32_t>(why.size());
    (void)(send_all(c, &r, sizeof r) && send_all(c, why.data(), why.size()));
    // What the peer sent beyond the header is read and dropped before the close, which would
    // otherwise reset the connection under the reply (bounded: a peer that goes on sending
    // is cut off).
    ::shutdown(c, SHUT_WR);
    char rest[4096];
    for (int i = 0; i < 16 && ::recv(c, rest, sizeof rest, 0) > 0; ++i) {}
  };
  try {
    auto const peer = peer_of(c);  // of this process's user (root may serve anyone)
    if (!peer || (peer->uid != ::geteuid() && ::geteuid() != 0)) {
      return refuse("emmpool: the sending process shares pages with its own user's processes only");
    }
    request_header q{};
    if (!receive_all(c, &q, sizeof q)) { return; }  // gone, or silent past the timeout
    if (std::memcmp(q.magic, request_magic, sizeof q.magic) != 0 || q.version != wire_version ||
        q.count == 0 || q.count > max_pages) {
      return refuse("emmpool: an ill-formed request for shared pages");
    }
    std::vector<std::int32_t> numbers(q.count);
    if (!receive_all(c, numbers.data(), numbers.size() * sizeof(std::int32_t))) { return; }
    auto* const pool = pool_of_(q.device);
    std::vector<int> const fds(numbers.begin(), numbers.end());
    if (pool == nullptr || !pool_sharing{*pool}.offers(q.key, q.first_page, q.page_size, fds)) {
      return refuse("emmpool: the sending process does not share these pages now (the block "
                    "was freed, and its lease released, before this process asked for them; or "
                    "the handle is not one it sent)");
    }
    // Counted once the request is known good: a peer without the key raises no limit.
    detail::reserve_descriptors(fds.size(), "handing shared pages to another process");
    owned_descriptors dups;
    if (auto got = pool_sharing{*pool}.duplicate_shared_pages(q.key, q.first_page, q.page_size,
                                                              fds)) {
      dups.fds = std::move(*got);
    } else {
      return refuse("emmpool: the sending process does not share these pages now (the block "
                    "was freed meanwhile)");
    }
    reply_header r{};
    std::memcpy(r.magic, reply_magic, sizeof r.magic);
    r.count   = dups.fds.size();
    bool sent = send_all(c, &r, sizeof r);
    for (std::size_t i = 0; sent && i < dups.fds.size(); i += fds_per_message) {
      sent = send_fds(c, dups.fds.data() + i, std::min(fds_per_message, dups.fds.size() - i));
    }
    if (!sent) { return; }  // the reply is cut: the receiver says so; the duplicates close
    std::lock_guard lock{mutex_};
    ++served_;
  } catch (std::exception const& e) {
    refuse(e.what());
  } catch (...) {
    refuse("emmpool: the sending process could not serve the request");
  }
}

std::vector<int> ipc_service::fetch(page_offer const& offer)
{
  auto const n = offer.fds.size();
  EMMPOOL_EXPECTS(n > 0 && n <= max_pages, "an offer names between 1 and max_pages pages");
  int const c = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c < 0) { throw pool_error{"emmpool: no socket to receive shared pages: " + errno_text()}; }
  std::vector<int> got;
  try {
    socklen_t length = 0;
    auto const a     = address_of(offer.address, length);
    set_timeouts(c);
    if (::connect(c, reinterpret_cast<sockaddr const*>(&a), length) != 0) {
      throw pool_error{"emmpool: cannot reach the process that shared this memory (" +
                       errno_text() +
                       "): it may have exited, or run in another network namespace"};
    }
    // A name another user took over (the sender gone) gets no request of ours.
    auto const peer = peer_of(c);
    if (!peer || (peer->uid != ::geteuid() && peer->uid != 0)) {
      throw pool_error{"emmpool: the process listening for this shared memory is not of this "
                       "user: the sender has exited"};
    }
    // Counted before anything arrives. A process that opens what it shared itself is both
    // ends: its service's copies of the pages are open while this side's arrive, so it needs
    // room for both.
    bool const self = peer->pid == ::getpid();
    detail::reserve_descriptors(self ? 2 * n : n, ("mapping " + std::to_string(n) +
                                                   " pages another process shares").c_str());
    request_header q{};
    std::memcpy(q.magic, request_magic, sizeof q.magic);
    q.version = wire_version;
    q.device  = offer.device;
    std::memcpy(q.key, offer.key.data(), sizeof q.key);
    q.first_page = offer.first_page;
    q.page_size  = offer.page_size;
    q.count      = n;
    std::vector<std::int32_t> numbers(offer.fds.begin(), offer.fds.end());
    reply_header r{};
    if (!send_all(c, &q, sizeof q) || !send_all(c, numbers.data(), n * sizeof(std::int32_t)) ||
        !receive_all(c, &r, sizeof r) || std::memcmp(r.magic, reply_magic, sizeof r.magic) != 0) {
      throw pool_error{"emmpool: the process that shared this memory did not answer (" +
                       errno_text() + ")"};
    }
    if (r.refused != 0) {
      std::string why(std::min<std::size_t>(r.message_size, 4096), '\0');
      if (!receive_all(c, why.data(), why.size())) { why = "emmpool: refused"; }
      throw pool_error{why};
    }
    if (r.count != n) { throw pool_error{"emmpool: the sending process sent other pages"}; }
    while (got.size() < n) {
      bool truncated = false;
      if (!receive_fds(c, got, truncated)) {
        throw pool_error{truncated ? "emmpool: the pages' descriptors did not all arrive: this "
                                     "process reached its descriptor limit as they came (raise "
                                     "it: ulimit -n)"
                                   : "emmpool: the pages' descriptors did not all arrive (" +
                                       errno_text() + ")"};
      }
    }
    if (got.size() != n) { throw pool_error{"emmpool: the sending process sent other pages"}; }
  } catch (...) {
    detail::close_descriptors(got);
    ::close(c);
    throw;
  }
  ::close(c);
  return got;
}

}  // namespace emmpool
