// Work items (a linear's column or row blocks) shared among the threads of one parallel region by
// claims on a shared counter, rather than in fixed contiguous shares: a thread the system takes away
// for a moment (on a 2-core machine, the gateway's and the client's work at every streamed token
// wakes while the model's threads hold both cores; a neighbour's steal on a shared host) then delays
// the region by its last claim only, the other threads taking the rest. Claims shrink as the items
// run out (half of what is left over the threads, down to a `kShare`th of a thread's share), so
// threads that ran undisturbed finish within a small claim of each other, and each still reads long
// runs of consecutive items. What an item computes must not depend on the thread that takes it.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {
namespace claims {

class Claims {
 public:
  static constexpr int64_t kShare = 16;

  Claims(int64_t items, int64_t threads)
      : items_(items), threads_(std::max<int64_t>(1, threads)),
        least_(std::max<int64_t>(1, items / (std::max<int64_t>(1, threads) * kShare))) {}

  // f(item) for every item the calling thread claims, in increasing order within a claim.
  template <typename F>
  void each(F&& f) {
    int64_t begin = next_.load(std::memory_order_relaxed);
    while (begin < items_) {
      const int64_t size = std::max(least_, (items_ - begin) / (2 * threads_));
      if (!next_.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed)) continue;
      for (int64_t item = begin; item < std::min(begin + size, items_); ++item) f(item);
      begin = next_.load(std::memory_order_relaxed);
    }
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t items_, threads_, least_;
};

}  // namespace claims
}  // namespace
