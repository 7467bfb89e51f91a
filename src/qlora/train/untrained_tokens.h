// Untrained token rows: a base model may leave the embedding and output-head rows of tokens it never
// saw in pre-training near zero (Llama-3 base: its reserved special tokens, which chat templates use).
// A run whose data puts such a token into the inputs or the labels trains against rows LoRA cannot
// move: NaN losses, or a model that never emits its end-of-turn token. The recipes check the ids
// their data uses once, at start, before the engine shards the model; model.untrained_tokens says
// what then happens.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qlora/data/dataset.h"
#include "qlora/data/tokenizer.h"
#include "qlora/io/enum_names.h"
#include "qlora/models/decoder.h"

namespace qlora::train {

enum class UntrainedTokensPolicy {
  kError,  // refuse, naming the tokens, the matrix and the key
  kMean,   // set those rows to the mean of their matrix's trained rows (as Unsloth's fix_untrained_tokens)
};
inline constexpr io::EnumName<UntrainedTokensPolicy> kUntrainedTokensPolicyNames[] = {
    {UntrainedTokensPolicy::kError, "error"}, {UntrainedTokensPolicy::kMean, "mean"}};

// The rule: a row is untrained when its L2 norm is below this fraction of the median row norm of its
// whole matrix. The median of every row, not the mean: many untrained rows (Llama-3's 250 reserved
// tokens, a vocabulary padded to a multiple of 64) or a few rows of huge norm do not move it.
inline constexpr double kUntrainedRowFraction = 1e-3;

// The ids that occur in samples' tokens or scored labels.
class TokenIdSet {
 public:
  void add(const data::Sample& s);
  std::vector<int64_t> ids() const;  // ascending

 private:
  std::vector<bool> seen_;
};

// Which of `ids` (ascending) have an untrained row in w [vocab, hidden] (any float dtype), by the rule
// above; ascending. The norms are taken a block of rows at a time: no fp32 copy of w.
std::vector<int64_t> untrained_rows(const at::Tensor& w, const std::vector<int64_t>& ids);

struct UntrainedTokens {
  std::vector<int64_t> embed, head;  // ids with an untrained embed_tokens / lm_head row (head: empty when tied)
  bool empty() const { return embed.empty() && head.empty(); }
};
UntrainedTokens find_untrained_tokens(const models::DecoderModel& m, const std::vector<int64_t>& ids);

// Sets each listed row to the mean of its own matrix's trained rows, in a copy of the matrix (the loaded
// one may map the checkpoint read-only), and records every listed id's rows in m.token_rows for the
// exports. Call before the engine shards the model.
void set_untrained_rows_to_mean(models::DecoderModel& m, const UntrainedTokens& u);

// The check as the recipes run it, on every rank alike (each computes it from the same data and
// weights, so every rank does the same): finds the untrained rows of `ids`; none: nothing happens.
// Otherwise rank 0 (`log`) names them (id and token string per matrix); kError throws naming the
// tokens, the matrix and model.untrained_tokens; kMean sets them to the mean. A resumed run does the
// same at its start, so its rows are those of the run it continues (same base and data: the resume
// checkpoint's fingerprints check both).
void apply_untrained_tokens_policy(models::DecoderModel& m, const std::vector<int64_t>& ids, const data::Tokenizer& tok,
                                   UntrainedTokensPolicy policy, bool log);

}  // namespace qlora::train
