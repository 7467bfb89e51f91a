#include "qlora/train/untrained_tokens.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <stdexcept>

namespace qlora::train {

namespace {

// Rows per block when a [vocab, hidden] matrix is widened: 1024 x 4096 fp64 is 32 MB.
constexpr int64_t kBlockRows = 1024;

// The L2 norm of every row of w: [vocab] fp32 (on w's device).
at::Tensor row_norms(const at::Tensor& w) {
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < w.size(0); r += kBlockRows)
    parts.push_back(w.narrow(0, r, std::min(kBlockRows, w.size(0) - r)).to(at::kFloat).norm(2, {1}));
  return at::cat(parts);
}

// Rows of w that are trained by the rule (kUntrainedRowFraction x the median row norm): [vocab] bool.
at::Tensor trained_mask(const at::Tensor& w) {
  const at::Tensor norms = row_norms(w);
  return norms >= norms.median() * kUntrainedRowFraction;
}

// The mean of w's trained rows, accumulated in fp64: [hidden] in w's dtype.
at::Tensor trained_mean(const at::Tensor& w, const at::Tensor& trained, const std::string& matrix) {
  const int64_t n = trained.sum().item<int64_t>();
  if (n == 0) throw std::invalid_argument(matrix + ": no trained row to take the mean of");
  at::Tensor sum = at::zeros({w.size(1)}, w.options().dtype(at::kDouble));
  for (int64_t r = 0; r < w.size(0); r += kBlockRows) {
    const int64_t len = std::min(kBlockRows, w.size(0) - r);
    sum += (w.narrow(0, r, len).to(at::kDouble) * trained.narrow(0, r, len).unsqueeze(1)).sum(0);
  }
  return (sum / static_cast<double>(n)).to(w.scalar_type());
}

at::Tensor ids_tensor(const std::vector<int64_t>& ids, const at::Tensor& like) {
  return at::tensor(ids, at::kLong).to(like.device());
}

// A copy of w with rows `ids` set to the mean of its trained rows.
at::Tensor with_mean_rows(const at::Tensor& w, const std::vector<int64_t>& ids, const std::string& matrix) {
  const at::Tensor mean = trained_mean(w, trained_mask(w), matrix);
  at::Tensor out = w.clone();
  out.index_copy_(0, ids_tensor(ids, w), mean.unsqueeze(0).expand({static_cast<int64_t>(ids.size()), w.size(1)}).contiguous());
  return out;
}

bool tied(const models::DecoderModel& m) { return m.config.tie_word_embeddings; }

std::string embed_name(const models::DecoderModel& m) {
  return "embed_tokens (" + models::layout_key(m.key_layout, m.architecture().embed_key) + ")";
}

std::string head_name(const models::DecoderModel& m) {
  return "lm_head (" + models::layout_key(m.key_layout, models::hf_key(models::output_projection(m.architecture()), 0)) + ")";
}

// "1 '<s>', 2 '</s>'": the first 20 ids with their tokens (JSON-quoted: control bytes stay visible).
std::string token_list(const std::vector<int64_t>& ids, const data::Tokenizer& tok) {
  std::string out;
  const size_t shown = std::min<size_t>(ids.size(), 20);
  for (size_t i = 0; i < shown; ++i) {
    std::string piece;
    try {
      piece = nlohmann::json(tok.id_to_piece(ids[i])).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } catch (const std::exception&) {
      piece = "(no token: beyond the tokenizer)";
    }
    out += (i ? ", " : "") + std::to_string(ids[i]) + " " + piece;
  }
  if (shown < ids.size()) out += ", and " + std::to_string(ids.size() - shown) + " more";
  return out;
}

std::string describe(const models::DecoderModel& m, const UntrainedTokens& u, const data::Tokenizer& tok) {
  std::string out;
  if (!u.embed.empty()) out += embed_name(m) + (tied(m) ? ", tied to lm_head" : "") + ": " + token_list(u.embed, tok);
  if (!u.head.empty()) out += (out.empty() ? "" : "; ") + head_name(m) + ": " + token_list(u.head, tok);
  return out;
}

}  // namespace

void TokenIdSet::add(const data::Sample& s) {
  for (const auto* seq : {&s.tokens, &s.labels})
    for (int64_t id : *seq) {
      if (id < 0) continue;  // data::kIgnoreIndex
      if (static_cast<size_t>(id) >= seen_.size()) seen_.resize(static_cast<size_t>(id) + 1);
      seen_[static_cast<size_t>(id)] = true;
    }
}

std::vector<int64_t> TokenIdSet::ids() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < seen_.size(); ++i)
    if (seen_[i]) out.push_back(static_cast<int64_t>(i));
  return out;
}

std::vector<int64_t> untrained_rows(const at::Tensor& w, const std::vector<int64_t>& ids) {
  const c10::NoGradGuard no_grad;
  std::vector<int64_t> in_range;
  std::copy_if(ids.begin(), ids.end(), std::back_inserter(in_range), [&w](int64_t id) { return id < w.size(0); });
  if (in_range.empty()) return {};
  const at::Tensor trained = trained_mask(w).index_select(0, ids_tensor(in_range, w)).cpu().contiguous();
  const bool* is_trained = trained.data_ptr<bool>();
  std::vector<int64_t> out;
  for (size_t i = 0; i < in_range.size(); ++i)
    if (!is_trained[i]) out.push_back(in_range[i]);
  return out;
}

UntrainedTokens find_untrained_tokens(const models::DecoderModel& m, const std::vector<int64_t>& ids) {
  UntrainedTokens u;
  u.embed = untrained_rows(m.embed_tokens, ids);
  if (!tied(m)) u.head = untrained_rows(m.lm_head.base_dense, ids);
  return u;
}

void set_untrained_rows_to_mean(models::DecoderModel& m, const UntrainedTokens& u) {
  const c10::NoGradGuard no_grad;
  const bool is_tied = tied(m);
  if (!u.embed.empty()) m.embed_tokens = with_mean_rows(m.embed_tokens, u.embed, embed_name(m));
  if (is_tied) m.lm_head.base_dense = m.embed_tokens.detach();  // as load_decoder ties them
  else if (!u.head.empty()) m.lm_head.base_dense = with_mean_rows(m.lm_head.base_dense, u.head, head_name(m));
  std::vector<int64_t> ids;
  std::set_union(u.embed.begin(), u.embed.end(), u.head.begin(), u.head.end(), std::back_inserter(ids));
  const at::Tensor idx = ids_tensor(ids, m.embed_tokens);
  m.token_rows.ids = ids;
  m.token_rows.embed = m.embed_tokens.index_select(0, idx).cpu();
  m.token_rows.head = is_tied ? at::Tensor() : m.lm_head.base_dense.index_select(0, idx).cpu();
}

void apply_untrained_tokens_policy(models::DecoderModel& m, const std::vector<int64_t>& ids, const data::Tokenizer& tok,
                                   UntrainedTokensPolicy policy, bool log) {
  const UntrainedTokens u = find_untrained_tokens(m, ids);
  if (u.empty()) return;
  char rule[96];
  std::snprintf(rule, sizeof rule, "row L2 norm < %g x the median row norm of the matrix", kUntrainedRowFraction);
  const std::string which = describe(m, u, tok);
  if (policy == UntrainedTokensPolicy::kError)
    throw std::invalid_argument(
        "the training data uses tokens whose rows the base model never trained (" + std::string(rule) + "): " + which +
        ". LoRA cannot move these rows: training against them gives NaN losses or a model that never stops. Set "
        "model.untrained_tokens = \"mean\" to set them to the mean of the trained rows (the exports carry them), "
        "or use a template without these tokens (or the instruct model, which trained them)");
  if (log)
    std::printf("untrained token rows (%s) used by the data, set to the mean of the trained rows "
                "(model.untrained_tokens = \"mean\"): %s\n",
                rule, which.c_str());
  set_untrained_rows_to_mean(m, u);
}

}  // namespace qlora::train
