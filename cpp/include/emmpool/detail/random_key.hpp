/**
 * @file detail/random_key.hpp
 * @brief 16 bytes from the kernel's random source: shared blocks' keys (pool_sharing.hpp) and
 * the IPC service's socket name (ipc_service.hpp), which no other process may guess.
 */
#pragma once

#include <emmpool/error.hpp>
#include <emmpool/pool_layout.hpp>

#include <cerrno>
#include <cstring>
#include <string>

#include <sys/random.h>

namespace emmpool::detail {

/// @throws pool_error where the kernel gives no random bytes
inline share_key random_key()
{
  share_key k{};
  std::size_t got = 0;
  while (got < k.size()) {
    auto const n = ::getrandom(k.data() + got, k.size() - got, 0);
    if (n < 0 && errno == EINTR) { continue; }
    if (n <= 0) {
      throw pool_error{std::string{"emmpool: no random bytes for a shared block's key: "} +
                       std::strerror(errno)};
    }
    got += static_cast<std::size_t>(n);
  }
  return k;
}

/// Compared in constant time: a peer learns nothing of a key from how long a refusal took.
inline bool same_key(unsigned char const* a, share_key const& b) noexcept
{
  unsigned char diff = 0;
  for (std::size_t i = 0; i < b.size(); ++i) { diff |= static_cast<unsigned char>(a[i] ^ b[i]); }
  return diff == 0;
}

}  // namespace emmpool::detail
