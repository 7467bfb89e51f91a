// Samples → padded or packed int64 batches.
//
// Label convention: Batch::labels are ALREADY SHIFTED. labels[b, t] is the target for the
// logits at position t (the next token of the same sample), kIgnoreIndex at each sample's last
// token and on padding. The loss is cross_entropy(logits.view(-1, V), labels.view(-1),
// ignore_index=-100) with no further shift. Shifting per sample (not per row) is what keeps a
// packed sample's last token from being trained to predict the next sample's first token.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "qlora/data/dataset.h"

namespace qlora::data {

struct Batch {
  at::Tensor tokens;        // [batch, seq] int64; padding = pad_id
  at::Tensor labels;        // [batch, seq] int64; shifted targets, kIgnoreIndex where no loss
  at::Tensor position_ids;  // [batch, seq] int64; restart at 0 at every sample start
  // [batch, seq] int64: index of the sample within its row (0, 1, ...), -1 on padding.
  // Attention is NOT masked across packed samples by the model unless a mask is passed: build
  // one with block_causal_mask(document_ids).
  at::Tensor document_ids;
  // Number of labels != kIgnoreIndex: the loss terms in this batch. Sum it over the micro-batches
  // of a step and divide the summed loss by it so every token weighs the same.
  int64_t num_label_tokens = 0;
  // The rows' images in token order (row by row, left to right); their pixels are made when the
  // step needs them (sample_images.h's image_pixels).
  std::vector<SampleImage> images;
};

// One packed row of fixed length, labels already shifted (see above).
struct PackedRow {
  std::vector<int64_t> tokens, labels, position_ids, document_ids;
  std::vector<SampleImage> images;  // its samples' images, in order
};

// Right-pads to the longest sample, or to `pad_to` when larger (0: longest). Throws
// std::invalid_argument on an empty list or a sample whose tokens and labels differ in length.
Batch collate(const std::vector<Sample>& samples, int64_t pad_id, int64_t pad_to = 0);

// Greedy in-order packing (torchtune's PackedDataset strategy): samples are appended to the
// current row until the next one does not fit, then the row is right-padded to seq_len. A
// sample longer than seq_len throws (truncate it first: DatasetOptions::max_seq_len).
std::vector<PackedRow> pack_samples(const std::vector<Sample>& samples, int64_t seq_len,
                                    int64_t pad_id);

// Stacks packed rows (all of one length) into a batch.
Batch collate_packed(const std::vector<PackedRow>& rows);

// [batch, seq, seq] bool, true where query i may attend to key j: same document and j <= i.
// Padding (-1) attends causally among itself so no row is fully masked (no NaN softmax).
at::Tensor block_causal_mask(const at::Tensor& document_ids);

}  // namespace qlora::data
