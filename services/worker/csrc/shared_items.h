// Work split over the thread pool so that a thread that finishes early takes over what the others have left.
//
// The stack's other processes share the worker's cores, and the two cores do not run equally fast. With
// an equal split up front, a call waits for the slower share, or for all that is left of a preempted
// thread's share (here, only for the item that thread is on: a call shorter than the preemption still
// waits for it). Each thread still starts on its own equal share of the items and walks it front to
// back (consecutive items are consecutive memory, so the hardware prefetcher keeps one stream per
// thread), but a thread that finishes takes the remaining items of the others' shares from their back
// ends, one at a time.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

namespace shared_items {

constexpr int64_t RANGES_PER_THREAD = 8;  // share_ranges: enough for a preempted thread's rest to be taken over

// One thread's share [front, back), both ends in one word so that owner and thief never take the same item.
struct alignas(64) Share {
  std::atomic<uint64_t> span{0};

  static uint64_t pack(int64_t front, int64_t back) { return static_cast<uint64_t>(back) << 32 | static_cast<uint32_t>(front); }
  void assign(int64_t front, int64_t back) { span.store(pack(front, back), std::memory_order_relaxed); }
  // The item at one end, or -1 when none is left.
  int64_t take(bool from_front) {
    uint64_t now = span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<uint32_t>(now), back = static_cast<int64_t>(now >> 32);
      if (front >= back) return -1;
      const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (span.compare_exchange_weak(now, next, std::memory_order_relaxed)) return from_front ? front : back - 1;
    }
  }
};

// Threads' equal shares of items 0 .. count-1, consecutive ranges in thread order.
inline std::vector<Share> equal_shares(int64_t count, int64_t threads) {
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) shares[t].assign(count * t / threads, count * (t + 1) / threads);
  return shares;
}

// Thread t's next item: the front of its own share, then the back of the others'; -1 when none is left.
inline int64_t take_next(std::vector<Share>& shares, int64_t t) {
  const int64_t threads = static_cast<int64_t>(shares.size());
  int64_t item = shares[t].take(true);
  for (int64_t other = 1; item < 0 && other < threads; ++other) item = shares[(t + other) % threads].take(false);
  return item;
}

// Elements per range when count elements are cut into about RANGES_PER_THREAD ranges per thread.
inline int64_t range_size(int64_t count, int64_t threads, int64_t min_size, int64_t max_size) {
  return std::clamp<int64_t>(count / (RANGES_PER_THREAD * threads), min_size, max_size);
}

}  // namespace shared_items

// Calls body(item) once for each of 0 .. items-1 (fewer than 2^31), on the pool's threads as above; nested
// in another parallel region, one thread calls it for all of them in order.
template <typename Body>
void share_items(int64_t items, const Body& body) {
  const int64_t threads = std::min<int64_t>(items, at::get_num_threads());
  auto shares = shared_items::equal_shares(items, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t item; (item = shares[t].take(true)) >= 0;) body(item);
    for (int64_t item; (item = shared_items::take_next(shares, begin)) >= 0;) body(item);  // the others' leftovers
  });
}

// Calls body(begin, end) over consecutive ranges that cover 0 .. count-1, shared as share_items shares
// its items: about RANGES_PER_THREAD ranges per thread, each of min_size .. max_size elements.
template <typename Body>
void share_ranges(int64_t count, int64_t min_size, int64_t max_size, const Body& body) {
  const int64_t size = shared_items::range_size(count, at::get_num_threads(), min_size, max_size);
  share_items((count + size - 1) / size, [&](int64_t item) { body(item * size, std::min(count, (item + 1) * size)); });
}

// share_ranges with no upper bound on a range's size.
template <typename Body>
void share_ranges(int64_t count, int64_t min_size, const Body& body) {
  share_ranges(count, min_size, std::numeric_limits<int64_t>::max(), body);
}
