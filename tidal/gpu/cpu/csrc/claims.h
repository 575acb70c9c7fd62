// Parallel loops whose threads take over the work of a thread that falls behind.
//
// at::parallel_for gives each thread a fixed share, so a step is as slow as its slowest thread. On a
// small host the engine's threads share the cores with the HTTP frontend and the client, which wake up
// at every token: a thread they preempt for a few hundred microseconds holds the whole kernel back
// while the other waits at the barrier. Here each thread still starts on its own contiguous share and
// walks it front to back in order (so a kernel's prefetch of what comes next stays right), and a thread
// done with its share takes chunks from the back of the others'. A chunk is claimed by a compare-and-swap
// on its share's (front, back) pair, so no chunk runs twice and none is skipped.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tidal_cpu {

// One thread's share of the chunks, [front, back), packed in one word so both ends move atomically.
class Share {
 public:
  void reset(uint32_t front, uint32_t back) { ends_.store(pack(front, back), std::memory_order_relaxed); }

  // The chunk at the front (the owner's next), or -1 when the share is empty.
  int64_t take_front() {
    uint64_t ends = ends_.load(std::memory_order_relaxed);
    while (front_of(ends) < back_of(ends))
      if (ends_.compare_exchange_weak(ends, pack(front_of(ends) + 1, back_of(ends)), std::memory_order_relaxed))
        return front_of(ends);
    return -1;
  }

  // The chunk at the back (taken by a thread done with its own share), or -1 when the share is empty.
  int64_t take_back() {
    uint64_t ends = ends_.load(std::memory_order_relaxed);
    while (front_of(ends) < back_of(ends))
      if (ends_.compare_exchange_weak(ends, pack(front_of(ends), back_of(ends) - 1), std::memory_order_relaxed))
        return back_of(ends) - 1;
    return -1;
  }

  // Where the share ends now: the owner's next chunk is its own only below this.
  int64_t back() const { return back_of(ends_.load(std::memory_order_relaxed)); }

 private:
  static uint64_t pack(uint32_t front, uint32_t back) { return uint64_t(front) << 32 | back; }
  static uint32_t front_of(uint64_t ends) { return uint32_t(ends >> 32); }
  static uint32_t back_of(uint64_t ends) { return uint32_t(ends); }

  alignas(64) std::atomic<uint64_t> ends_{0};  // a cache line each: the owners do not contend
};

// Multiply-adds (rows x N x K) below which an int linear runs on one thread: a second costs more than it
// saves. Timed from Python at one row (AVX2 host): a 768 x 768 linear (590 K) takes 34-39 us on one thread and
// 24-29 on two; a 256-wide model's largest layer (256 x 1376 = 352 K) 24-32 us on one, no less on two, and
// there the fork and join and the worker spinning on a core the HTTP frontend and the client need cost more
// than they save. Counted in multiply-adds, not bytes: int4's half byte per weight is as much arithmetic.
constexpr int64_t kSplitWork = 1 << 19;

// The threads a linear of `multiply_adds` runs on (parallel_claims' max_threads).
inline int64_t linear_threads(int64_t multiply_adds) {
  return multiply_adds >= kSplitWork ? int64_t(at::get_num_threads()) : 1;
}

// Runs body(begin, end, ahead_end) over [0, n) in chunks of `chunk` items on up to `max_threads` threads,
// each chunk exactly once. ahead_end bounds what the body may prefetch past `end` as its thread's likely
// next work: the rest of the thread's own share (end itself when the chunk was taken from another's).
template <class Body>
void parallel_claims(int64_t n, int64_t chunk, int64_t max_threads, const Body& body) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>({max_threads, int64_t(at::get_num_threads()), chunks});
  if (threads <= 1 || at::in_parallel_region()) {
    body(0, n, n);
    return;
  }
  std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].reset(uint32_t(chunks * t / threads), uint32_t(chunks * (t + 1) / threads));
  auto run = [&](int64_t c, int64_t ahead_chunks) {
    body(c * chunk, std::min(n, (c + 1) * chunk), std::min(n, ahead_chunks * chunk));
  };
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      for (int64_t c; (c = shares[t].take_front()) >= 0;) run(c, shares[t].back());
      for (int64_t k = 1; k < threads; ++k)
        for (int64_t c; (c = shares[(t + k) % threads].take_back()) >= 0;) run(c, c + 1);
    }
  });
}

}  // namespace tidal_cpu
