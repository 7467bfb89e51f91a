#include "qlora/data/batching.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace qlora::data {
namespace {

void check_sample(const Sample& s, size_t index) {
  if (s.tokens.size() != s.labels.size()) {
    throw std::invalid_argument("sample " + std::to_string(index) + " has " +
                                std::to_string(s.tokens.size()) + " tokens but " +
                                std::to_string(s.labels.size()) + " labels");
  }
}

// Appends one sample to a row: shifted labels, positions from 0, the given document id.
void append_sample(PackedRow& row, const Sample& s, int64_t doc) {
  const size_t n = s.tokens.size();
  for (size_t t = 0; t < n; ++t) {
    row.tokens.push_back(s.tokens[t]);
    row.labels.push_back(t + 1 < n ? s.labels[t + 1] : kIgnoreIndex);
    row.position_ids.push_back(static_cast<int64_t>(t));
    row.document_ids.push_back(doc);
  }
  row.images.insert(row.images.end(), s.images.begin(), s.images.end());
}

// Padding: positions keep counting from 0 (any in-range value works; nothing reads them).
void pad_row(PackedRow& row, size_t length, int64_t pad_id) {
  for (int64_t p = 0; row.tokens.size() < length; ++p) {
    row.tokens.push_back(pad_id);
    row.labels.push_back(kIgnoreIndex);
    row.position_ids.push_back(p);
    row.document_ids.push_back(-1);
  }
}

at::Tensor stack_field(const std::vector<PackedRow>& rows,
                       std::vector<int64_t> PackedRow::*field, int64_t seq) {
  std::vector<int64_t> flat;
  flat.reserve(rows.size() * static_cast<size_t>(seq));
  for (const auto& r : rows) flat.insert(flat.end(), (r.*field).begin(), (r.*field).end());
  return at::from_blob(flat.data(), {static_cast<int64_t>(rows.size()), seq}, at::kLong).clone();
}

}  // namespace

Batch collate(const std::vector<Sample>& samples, int64_t pad_id, int64_t pad_to) {
  if (samples.empty()) throw std::invalid_argument("collate: no samples");
  size_t longest = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    check_sample(samples[i], i);
    longest = std::max(longest, samples[i].tokens.size());
  }
  longest = std::max(longest, static_cast<size_t>(std::max<int64_t>(pad_to, 0)));
  std::vector<PackedRow> rows(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    append_sample(rows[i], samples[i], 0);
    pad_row(rows[i], longest, pad_id);
  }
  return collate_packed(rows);
}

std::vector<PackedRow> pack_samples(const std::vector<Sample>& samples, int64_t seq_len,
                                    int64_t pad_id) {
  if (seq_len <= 0) throw std::invalid_argument("pack_samples: seq_len must be positive");
  const auto len = static_cast<size_t>(seq_len);
  std::vector<PackedRow> rows;
  PackedRow row;
  int64_t doc = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    check_sample(samples[i], i);
    const size_t n = samples[i].tokens.size();
    if (n > len) {
      throw std::invalid_argument("pack_samples: sample " + std::to_string(i) + " has " +
                                  std::to_string(n) + " tokens, more than the packed length " +
                                  std::to_string(seq_len) +
                                  "; set the dataset's max_seq_len to at most that");
    }
    if (n == 0) continue;
    if (row.tokens.size() + n > len) {
      pad_row(row, len, pad_id);
      rows.push_back(std::move(row));
      row = PackedRow{};
      doc = 0;
    }
    append_sample(row, samples[i], doc++);
  }
  if (!row.tokens.empty()) {
    pad_row(row, len, pad_id);
    rows.push_back(std::move(row));
  }
  return rows;
}

Batch collate_packed(const std::vector<PackedRow>& rows) {
  if (rows.empty()) throw std::invalid_argument("collate_packed: no rows");
  const size_t seq = rows[0].tokens.size();
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    if (r.tokens.size() != seq || r.labels.size() != seq || r.position_ids.size() != seq ||
        r.document_ids.size() != seq) {
      throw std::invalid_argument("collate_packed: row " + std::to_string(i) +
                                  " differs in length from row 0 (" + std::to_string(seq) + ")");
    }
  }
  const auto s = static_cast<int64_t>(seq);
  Batch b;
  b.tokens = stack_field(rows, &PackedRow::tokens, s);
  b.labels = stack_field(rows, &PackedRow::labels, s);
  b.position_ids = stack_field(rows, &PackedRow::position_ids, s);
  b.document_ids = stack_field(rows, &PackedRow::document_ids, s);
  for (const auto& r : rows) {
    b.num_label_tokens += std::count_if(r.labels.begin(), r.labels.end(),
                                        [](int64_t l) { return l != kIgnoreIndex; });
    b.images.insert(b.images.end(), r.images.begin(), r.images.end());
  }
  return b;
}

at::Tensor block_causal_mask(const at::Tensor& document_ids) {
  if (document_ids.dim() != 2) {
    throw std::invalid_argument("block_causal_mask: document_ids must be [batch, seq]");
  }
  const int64_t seq = document_ids.size(1);
  const auto same_doc = document_ids.unsqueeze(2).eq(document_ids.unsqueeze(1));  // [b, s, s]
  const auto causal =
      at::ones({seq, seq}, document_ids.options().dtype(at::kBool)).tril();  // [s, s]
  return same_doc.logical_and(causal);
}

}  // namespace qlora::data
