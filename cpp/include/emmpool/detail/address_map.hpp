/**
 * @file detail/address_map.hpp
 * @brief A hash map from block address to a non-null pointer, stored flat: the pool's live-block
 * map, looked up and changed on every allocation and free.
 *
 * std::unordered_map allocates a node per insert and frees it per erase (a malloc + free per
 * allocate/free pair); this keeps the entries in one array: open addressing, linear probing,
 * deletion by backward shift (no tombstones, so lookups stay short under churn). The subset of
 * std::unordered_map's interface the pool uses, with the same meaning: find / end / erase(it) /
 * emplace / count / clear / reserve / iteration over {first, second}. Any insert or erase
 * invalidates iterators. Not thread-safe (the pool's mutex).
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

namespace emmpool::detail {

template <class Value>
class address_map {
  static_assert(std::is_pointer_v<Value>, "values are pointers: null marks an empty slot");

 public:
  struct slot {
    std::uint64_t first{};
    Value second{};  ///< null: empty
  };

  class iterator {
   public:
    iterator(slot* at, slot* end) noexcept : at_{at}, end_{end} { skip(); }
    slot& operator*() const noexcept { return *at_; }
    slot* operator->() const noexcept { return at_; }
    iterator& operator++() noexcept
    {
      ++at_;
      skip();
      return *this;
    }
    friend bool operator==(iterator a, iterator b) noexcept { return a.at_ == b.at_; }
    friend bool operator!=(iterator a, iterator b) noexcept { return a.at_ != b.at_; }

   private:
    friend class address_map;
    void skip() noexcept
    {
      while (at_ != end_ && at_->second == nullptr) { ++at_; }
    }
    slot* at_;
    slot* end_;
  };

  address_map() = default;
  address_map(address_map const&)            = delete;
  address_map& operator=(address_map const&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  iterator begin() noexcept { return {slots_.get(), slots_.get() + capacity_}; }
  iterator end() noexcept { return {slots_.get() + capacity_, slots_.get() + capacity_}; }

  /// Room for `n` entries without rehashing.
  void reserve(std::size_t n)
  {
    std::size_t cap = 16;
    while (cap * max_load_num < n * max_load_den) { cap *= 2; }
    if (cap > capacity_) { rehash(cap); }
  }

  [[nodiscard]] iterator find(std::uint64_t key) noexcept
  {
    if (capacity_ == 0) { return end(); }
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      slot& s = slots_[i];
      if (s.second == nullptr) { return end(); }
      if (s.first == key) { return {&s, slots_.get() + capacity_}; }
    }
  }

  [[nodiscard]] std::size_t count(std::uint64_t key) const noexcept
  {
    return get(key) != nullptr ? 1 : 0;
  }
  /// The value at key, or null (find() for a reader that changes nothing).
  [[nodiscard]] Value get(std::uint64_t key) const noexcept
  {
    auto* self = const_cast<address_map*>(this);
    auto it    = self->find(key);
    return it != self->end() ? it->second : nullptr;
  }

  /// Insert (key, value) if key is absent; value must not be null. @return whether inserted
  bool emplace(std::uint64_t key, Value value)
  {
    if ((size_ + 1) * max_load_den > capacity_ * max_load_num) {
      rehash(capacity_ == 0 ? 16 : capacity_ * 2);
    }
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      slot& s = slots_[i];
      if (s.second == nullptr) {
        s.first  = key;
        s.second = value;
        ++size_;
        return true;
      }
      if (s.first == key) { return false; }
    }
  }

  void erase(iterator it) noexcept
  {
    // Backward shift: move later entries of the probe run into the hole when their home lies
    // at or before it (cyclically), so that no lookup ever stops early at an empty slot.
    auto hole = static_cast<std::size_t>(it.at_ - slots_.get());
    for (std::size_t i = (hole + 1) & mask_;; i = (i + 1) & mask_) {
      slot& s = slots_[i];
      if (s.second == nullptr) { break; }
      std::size_t const h = home(s.first);
      // s may fill the hole if its home is not in (hole, i] cyclically.
      bool const stays = hole <= i ? (hole < h && h <= i) : (hole < h || h <= i);
      if (!stays) {
        slots_[hole] = s;
        hole         = i;
      }
    }
    slots_[hole] = slot{};
    --size_;
  }

  void clear() noexcept
  {
    for (std::size_t i = 0; i < capacity_; ++i) { slots_[i] = slot{}; }
    size_ = 0;
  }

 private:
  // At most 1/2 full: short probe runs.
  static constexpr std::size_t max_load_num = 1;
  static constexpr std::size_t max_load_den = 2;

  [[nodiscard]] std::size_t home(std::uint64_t key) const noexcept
  {
    // Block addresses are multiples of 256: drop those bits, then a Fibonacci hash.
    return static_cast<std::size_t>(((key >> 8) * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }

  void rehash(std::size_t capacity)
  {
    auto old       = std::move(slots_);
    auto const old_capacity = capacity_;
    slots_    = std::make_unique<slot[]>(capacity);
    capacity_ = capacity;
    mask_     = capacity - 1;
    shift_    = 64;
    for (std::size_t c = capacity; c > 1; c >>= 1) { --shift_; }
    size_ = 0;
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (old[i].second != nullptr) { emplace(old[i].first, old[i].second); }
    }
  }

  std::unique_ptr<slot[]> slots_;
  std::size_t capacity_{};  // a power of two, or 0
  std::size_t mask_{};
  unsigned shift_{64};
  std::size_t size_{};
};

struct block;
/// Live blocks by address (a pool's and, after a reset, the retired ones').
using live_map = address_map<block*>;

}  // namespace emmpool::detail
