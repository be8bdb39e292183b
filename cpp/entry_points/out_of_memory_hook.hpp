// What an allocation asks before it gives up: a hook the program installs (emmpool's Python
// binding installs one that calls the user's out-of-memory callback, e.g. Dask's spilling),
// asked once the pool's own recovery (fences, waiting, trimming) has failed. Internal to the
// extension: the core knows no hook; every entry point reaches it through pool_calls.hpp.
#pragma once

#include <emmpool/device_pool.hpp>

#include <cstddef>
#include <string>

namespace emmpool::out_of_memory_hook {

/// What the hook answers.
enum class answer { freed_nothing, freed_something, raised };

/// Asked with no pool lock held and the caller's lock (the GIL) as the entry point holds it:
/// may free memory of `pool`'s device for a request of `size` bytes. `raised`: the hook failed
/// (its own error kept by whoever installed it); `error` then says what, in a line.
using function = answer (*)(device_pool& pool, std::size_t size, std::string& error);

/// Install it (the extension, at import); none by default: an allocation fails at once.
void install(function f) noexcept;
[[nodiscard]] function installed() noexcept;

/// Times an allocation asks at most: a hook that keeps saying it freed something, but never
/// enough, ends in out_of_memory all the same.
inline constexpr int max_asks = 8;

}  // namespace emmpool::out_of_memory_hook
