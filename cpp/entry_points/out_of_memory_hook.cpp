#include "out_of_memory_hook.hpp"

#include <atomic>

namespace emmpool::out_of_memory_hook {
namespace {

std::atomic<function> hook{nullptr};

}  // namespace

void install(function f) noexcept { hook.store(f, std::memory_order_release); }

function installed() noexcept { return hook.load(std::memory_order_acquire); }

}  // namespace emmpool::out_of_memory_hook
