// Model files are untrusted input, and a chat template is a program: rendering one runs under a
// budget of work and of text, so that `'a' * 2000000000` or two nested range(99999) loops end in
// a clear error naming the template's file, key and line, not in minutes of work or bad_alloc.
//
// The renderer installs the budget for its thread while it runs (BudgetScope), and whatever builds
// text or walks a list charges it where it happens (operators, filters, methods, iterate()), so the
// charge needs no parameter through every signature. Outside a render nothing is charged.
//
// What a charge pays for: a step is one statement, expression, loop iteration or list element
// visited; bytes are those of each string built or copied (the interpreter copies strings by
// value). A string that would outgrow the one-string limit is refused before it is allocated.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qlora::jinja {

struct RenderBudget {
  // What real templates need (tests/jinja/test_budget.cpp measures every template of tests/data):
  // a 100-turn conversation with tools takes at most ~14,000 steps, ~400 KB of strings built and
  // copied and ~64 KB of text (Mistral-Small-3.2); a 1,000-turn one about ten times that. The
  // limits sit ~100x above the 100-turn render and ~10x above the 1,000-turn one, and stay small
  // enough that a runaway template stops within seconds (the interpreter runs ~1M loop steps a
  // second) and far below the memory a training run needs for itself.
  int64_t max_steps = 2'000'000;
  int64_t max_bytes = int64_t{512} << 20;        // all strings built or copied in one render
  int64_t max_string_bytes = int64_t{32} << 20;  // any one string, the output included
};

// Installs `limits` as the current thread's budget until destroyed (scopes nest: the inner wins).
class BudgetScope {
 public:
  explicit BudgetScope(const RenderBudget& limits);
  ~BudgetScope();
  BudgetScope(const BudgetScope&) = delete;
  BudgetScope& operator=(const BudgetScope&) = delete;

  const RenderBudget limits;
  int64_t steps = 0, bytes = 0;  // used so far

 private:
  BudgetScope* outer_;
};

// Pays for n steps; throws std::runtime_error (the evaluator adds the location) past the budget.
void budget_steps(int64_t n);
// Before appending `add` bytes to a string of `size` bytes (size 0: building a new string of
// `add`): throws when the string would outgrow the one-string limit or the bytes left.
void budget_append(size_t size, size_t add);
inline void budget_bytes(size_t n) { budget_append(0, n); }
// Pays for `bytes` of strings copied (a lookup, a list's strings walked): the bytes left only.
void budget_copied(size_t bytes);
// n copies of a string of `bytes` bytes (items 0), or of a list of `items` elements holding
// `bytes` bytes of strings: repetition, refused before n * size can overflow.
void budget_repeat(int64_t n, size_t bytes, size_t items = 0);

}  // namespace qlora::jinja
