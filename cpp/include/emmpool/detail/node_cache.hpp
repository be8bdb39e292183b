/**
 * @file detail/node_cache.hpp
 * @brief Keeps the nodes of a node-based container (the pool's size-ordered free sets) for
 * reuse: every split and every coalesce inserts into and erases from those sets, and without
 * this each insert is a malloc and each erase a free.
 *
 * node_cache holds freed chunks of one size (the first size it is given) on a free list and
 * hands them out again; cached_allocator<T> is a standard allocator over one node_cache, for
 * containers that allocate one element at a time (std::set, std::map). Chunks of other sizes
 * and arrays go to operator new / delete. The cache keeps at most as many chunks as the
 * container ever held at once, and frees them when it is destroyed (after its containers:
 * declare it first). Not thread-safe (the pool's mutex).
 */
#pragma once

#include <cstddef>
#include <new>

namespace emmpool::detail {

class node_cache {
 public:
  node_cache() = default;
  node_cache(node_cache const&)            = delete;
  node_cache& operator=(node_cache const&) = delete;
  ~node_cache()
  {
    while (head_ != nullptr) {
      auto* next = head_->next;
      ::operator delete(head_);
      head_ = next;
    }
  }

  [[nodiscard]] void* take(std::size_t bytes)
  {
    if (head_ != nullptr && bytes == chunk_) {
      auto* c = head_;
      head_   = c->next;
      return c;
    }
    return ::operator new(bytes < sizeof(link) ? sizeof(link) : bytes);
  }

  void give(void* p, std::size_t bytes) noexcept
  {
    if (chunk_ == 0 && bytes >= sizeof(link)) { chunk_ = bytes; }
    if (bytes != chunk_) {
      ::operator delete(p);
      return;
    }
    head_ = new (p) link{head_};
  }

 private:
  struct link {
    link* next;
  };
  link* head_{};
  std::size_t chunk_{};  // the one size kept; 0 until the first give()
};

template <class T>
struct cached_allocator {
  using value_type = T;

  explicit cached_allocator(node_cache* cache) noexcept : cache_{cache} {}
  template <class U>
  cached_allocator(cached_allocator<U> const& other) noexcept : cache_{other.cache_}
  {
  }

  [[nodiscard]] T* allocate(std::size_t n)
  {
    if (n == 1) { return static_cast<T*>(cache_->take(sizeof(T))); }
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept
  {
    if (n == 1) {
      cache_->give(p, sizeof(T));
    } else {
      ::operator delete(p);
    }
  }

  template <class U>
  friend bool operator==(cached_allocator const& a, cached_allocator<U> const& b) noexcept
  {
    return a.cache_ == b.cache_;
  }
  template <class U>
  friend bool operator!=(cached_allocator const& a, cached_allocator<U> const& b) noexcept
  {
    return a.cache_ != b.cache_;
  }

  node_cache* cache_;
};

}  // namespace emmpool::detail
