// A record's images on their way into its sample (issue 52): each decoded (images/decode.h) and
// processed as the model's processor does (images/processor.h), and each placeholder the chat
// template rendered for it replaced by the processor's expansion (its image tokens), in order, as
// transformers' processor replaces them in the rendered text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qlora/data/dataset.h"

namespace qlora::data {

// The record's images processed; errors (a file that does not decode, is missing, is over the
// pixel budget) name the record's origin and the image.
std::vector<images::ProcessedImage> process_record_images(const RenderedRecord& record, const DatasetOptions& options);

// `segments` with the k-th occurrence of the processor's placeholder replaced by images[k]'s
// expansion. Throws std::invalid_argument when the text holds another number of placeholders.
std::vector<Segment> expand_image_placeholders(const std::vector<Segment>& segments,
                                               const images::ImageProcessor& processor,
                                               const std::vector<images::ProcessedImage>& images);

// The sample's record of each processed image, its pixel values dropped (image_pixels makes them again).
std::vector<SampleImage> sample_images(const RenderedRecord& record, const std::vector<images::ProcessedImage>& processed);

// An image's pixel values (and grid) for a batch: decoded and processed again, as when it was read.
images::ProcessedImage image_pixels(const SampleImage& image, const DatasetOptions& options);

// Throws std::invalid_argument unless `s` holds each of its images' image tokens (`image_token`:
// image_token_id's) whole, s.images' num_image_tokens in all: a sample that max_seq_len (named in the
// error) cut into an image, or whose text writes an image token itself.
void check_images_kept(const Sample& s, int64_t image_token, int64_t max_seq_len);

// The id of the processor's image token (one token), or std::invalid_argument saying the tokenizer
// does not have it as one token.
int64_t image_token_id(const images::ImageProcessor& processor, const Tokenizer& tokenizer);

}  // namespace qlora::data
