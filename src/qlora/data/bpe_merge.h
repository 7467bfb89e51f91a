// The byte-pair merge loop tiktoken's format and HF's BPE model share: starting from units
// (bytes for tiktoken, initial symbols for HF), repeatedly merge the adjacent pair of parts with
// the lowest rank, leftmost first, until no pair has a rank. Both libraries pick pairs this way;
// they differ only in what ranks a pair (the joined token's rank vs. the merge's line), which the
// caller supplies.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <queue>
#include <utility>
#include <vector>

namespace qlora::data {

inline constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();

// Parts are named by their first unit. rank(a, b, end) ranks joining part [a, b) with part
// [b, end), kNoRank if they do not merge; merged(a, b) is told when they were joined;
// emit(a, end) receives the final parts in order.
template <class Rank, class Merged, class Emit>
void bpe_merge(size_t n, const Rank& rank, const Merged& merged, const Emit& emit) {
  // Pieces up to this many units merge by a quadratic scan on the stack, longer ones with a heap.
  constexpr size_t kShort = 64;
  if (n <= kShort) {
    // Nearly every piece: tiktoken's own loop on arrays on the stack. Part i is
    // [start[i], start[i + 1]); r[i] ranks parts i and i + 1 joined.
    uint32_t start[kShort + 1], r[kShort + 1];
    size_t parts = n;
    for (size_t i = 0; i <= n; ++i) start[i] = static_cast<uint32_t>(i);
    const auto pair_rank = [&](size_t i) { return i + 1 < parts ? rank(start[i], start[i + 1], start[i + 2]) : kNoRank; };
    for (size_t i = 0; i < parts; ++i) r[i] = pair_rank(i);
    for (;;) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < parts; ++i) best = r[i] < r[best] ? i : best;
      if (parts < 2 || r[best] == kNoRank) break;
      merged(start[best], start[best + 1]);
      std::copy(start + best + 2, start + parts + 1, start + best + 1);
      std::copy(r + best + 2, r + parts, r + best + 1);
      --parts;
      r[best] = pair_rank(best);
      if (best > 0) r[best - 1] = pair_rank(best - 1);
    }
    for (size_t i = 0; i < parts; ++i) emit(start[i], start[i + 1]);
    return;
  }
  // Long pieces (a base64 blob, a run of one letter): a doubly linked list plus a heap keyed
  // (rank, start) picks the same pairs in O(n log n) where the scan is quadratic. Part i is
  // [i, next[i]); pair_rank[i] ranks part i joined with the next one.
  std::vector<uint32_t> next(n), prev(n), pair_rank(n, kNoRank);
  for (size_t i = 0; i < n; ++i) {
    next[i] = static_cast<uint32_t>(i + 1);
    prev[i] = static_cast<uint32_t>(i - 1);  // wraps for i = 0; never read there
  }
  const auto rank_after = [&](uint32_t i) { return next[i] < n ? rank(i, next[i], next[next[i]]) : kNoRank; };
  using Entry = std::pair<uint32_t, uint32_t>;  // (rank, start)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (uint32_t i = 0; i + 1 < n; ++i) {
    pair_rank[i] = rank_after(i);
    if (pair_rank[i] != kNoRank) heap.emplace(pair_rank[i], i);
  }
  std::vector<bool> alive(n, true);
  while (!heap.empty()) {
    const auto [rk, i] = heap.top();
    heap.pop();
    if (!alive[i] || pair_rank[i] != rk) continue;  // stale: a neighbour merged since
    const uint32_t j = next[i];
    merged(i, j);
    alive[j] = false;
    next[i] = next[j];
    if (next[i] < n) prev[next[i]] = i;
    pair_rank[i] = rank_after(i);
    if (pair_rank[i] != kNoRank) heap.emplace(pair_rank[i], i);
    if (i > 0) {
      const uint32_t p = prev[i];
      pair_rank[p] = rank_after(p);
      if (pair_rank[p] != kNoRank) heap.emplace(pair_rank[p], p);
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) emit(i, next[i]);
}

}  // namespace qlora::data
