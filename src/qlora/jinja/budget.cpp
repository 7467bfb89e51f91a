#include "qlora/jinja/budget.h"

#include <stdexcept>
#include <string>

namespace qlora::jinja {
namespace {

thread_local BudgetScope* current = nullptr;

std::string mib(int64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

// n * unit, or past `limit` when that is larger than limit (no overflow).
uint64_t times(int64_t n, size_t unit, uint64_t limit) {
  if (n <= 0 || unit == 0) return 0;
  return static_cast<uint64_t>(n) > limit / unit ? limit + 1 : static_cast<uint64_t>(n) * unit;
}

}  // namespace

BudgetScope::BudgetScope(const RenderBudget& l) : limits(l), outer_(current) { current = this; }
BudgetScope::~BudgetScope() { current = outer_; }

void budget_steps(int64_t n) {
  BudgetScope* b = current;
  if (!b || n <= 0) return;
  if (n > b->limits.max_steps - b->steps) {
    throw std::runtime_error("the template ran past its budget of " + std::to_string(b->limits.max_steps) +
                             " steps (statements, expressions, loop iterations), far above what a chat template needs");
  }
  b->steps += n;
}

void budget_copied(size_t bytes) {
  BudgetScope* b = current;
  if (!b) return;
  if (bytes > static_cast<uint64_t>(b->limits.max_bytes - b->bytes)) {
    throw std::runtime_error("the template ran past its budget of " + mib(b->limits.max_bytes) +
                             " of strings built and copied, far above what a chat template needs");
  }
  b->bytes += static_cast<int64_t>(bytes);
}

void budget_append(size_t size, size_t add) {
  const BudgetScope* b = current;
  if (!b) return;
  const auto limit = static_cast<uint64_t>(b->limits.max_string_bytes);
  if (add > limit || size > limit - add) {
    throw std::runtime_error("the template built a string past its budget of " + mib(b->limits.max_string_bytes) +
                             " for one string, far above what a chat template renders");
  }
  budget_copied(add);
}

void budget_repeat(int64_t n, size_t bytes, size_t items) {
  const BudgetScope* b = current;
  if (!b) return;
  if (items == 0) {
    budget_bytes(times(n, bytes, static_cast<uint64_t>(b->limits.max_string_bytes)));
    return;
  }
  budget_steps(static_cast<int64_t>(times(n, items, static_cast<uint64_t>(b->limits.max_steps))));
  budget_copied(times(n, bytes, static_cast<uint64_t>(b->limits.max_bytes)));
}

}  // namespace qlora::jinja
