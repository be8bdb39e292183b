#include <emmpool/detail/growable_space.hpp>
#include <emmpool/detail/segment_index.hpp>

namespace emmpool::detail {

segment* segment_index::holding_live(device_ptr ptr) const
{
  auto it = segments_.upper_bound(ptr);
  if (it == segments_.begin()) { return nullptr; }
  --it;
  auto* const seg = it->second.get();
  return ptr < seg->base + seg->size && seg->live_blocks != 0 ? seg : nullptr;
}

block const* segment_index::block_at(segment const& seg, device_ptr ptr) noexcept
{
  // Walk the segment's blocks in address order (a rare ask; a small segment holds at most a
  // few thousand blocks).
  for (auto const* b = seg.first; b != nullptr && b->ptr <= ptr; b = b->next) {
    if (ptr < b->ptr + b->size) { return b; }
  }
  return nullptr;
}

std::optional<std::pair<device_ptr, std::size_t>> segment_index::live_extent(device_ptr ptr) const
{
  if (auto const* blk = live_.get(ptr)) {  // the array's start: the usual ask
    return std::pair{ptr, blk->size};
  }
  auto const* seg = holding_live(ptr);
  if (seg == nullptr) { return std::nullopt; }
  auto const* b = block_at(*seg, ptr);  // a view inside an array
  if (b == nullptr || b->state != block_state::allocated) { return std::nullopt; }
  return std::pair{b->ptr, b->size};
}

std::optional<ipc_info> segment_index::ipc(device_ptr ptr, driver& drv, int device) const
{
  auto* const seg = holding_live(ptr);
  if (seg == nullptr) { return std::nullopt; }
  if (seg->growable) { growable_space::throw_no_ipc(); }
  // A segment is never released while a block in it is live, exported or not: the handle
  // stays valid for as long as the block.
  if (!seg->ipc) { seg->ipc = drv.ipc_handle(device, seg->base); }
  return ipc_info{*seg->ipc, seg->base, seg->size, static_cast<std::size_t>(ptr - seg->base)};
}

std::vector<layout_block> segment_index::layout() const
{
  std::vector<layout_block> out;
  for (auto const& [base, seg] : segments_) {
    auto const kind = static_cast<segment_type>(seg->kind());
    for (auto const* b = seg->first; b != nullptr; b = b->next) {
      bool const free = b->state == block_state::free;
      auto const state = free                               ? block_status::free
                         : b->state == block_state::pending ? block_status::waiting
                                                            : block_status::allocated;
      out.push_back(layout_block{seg->base, seg->size, b->ptr, b->size, state,
                                 free ? std::uint8_t{0} : b->tag, kind,
                                 free ? legacy_stream : b->alloc_stream.handle});
    }
  }
  return out;
}

}  // namespace emmpool::detail
