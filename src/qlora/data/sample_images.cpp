#include "qlora/data/sample_images.h"

#include <algorithm>
#include <stdexcept>

#include "qlora/images/decode.h"

namespace qlora::data {

namespace {

images::ProcessedImage process_one(const RecordImage& img, const std::string& origin, const DatasetOptions& o) {
  if (!o.image_processor)
    throw std::invalid_argument(
        "the record holds an image but the model has no image processor: " +
        (o.image_processor_error.empty()
             ? std::string("no preprocessor_config.json or processor_config.json beside its tokenizer (images train a "
                           "vision-language model)")
             : o.image_processor_error));
  images::DecodeOptions limits;
  limits.max_pixels = o.max_image_pixels;
  const images::Image decoded = img.bytes.empty()
                                    ? images::load_image(img.path, origin, limits)
                                    : images::decode_image(img.bytes.data(), img.bytes.size(), img.name, origin, limits);
  return o.image_processor->process(decoded, origin + ": " + img.name);
}

}  // namespace

std::vector<images::ProcessedImage> process_record_images(const RenderedRecord& record, const DatasetOptions& o) {
  std::vector<images::ProcessedImage> out;
  for (const RecordImage& img : record.images) out.push_back(process_one(img, record.origin, o));
  return out;
}

std::vector<SampleImage> sample_images(const RenderedRecord& record, const std::vector<images::ProcessedImage>& processed) {
  std::vector<SampleImage> out;
  for (size_t k = 0; k < processed.size(); ++k)
    out.push_back({record.images[k], record.origin, processed[k].num_image_tokens, processed[k].grid});
  return out;
}

images::ProcessedImage image_pixels(const SampleImage& image, const DatasetOptions& o) {
  return process_one(image.source, image.origin, o);
}

std::vector<Segment> expand_image_placeholders(const std::vector<Segment>& segments,
                                               const images::ImageProcessor& processor,
                                               const std::vector<images::ProcessedImage>& images) {
  const std::string& placeholder = processor.placeholder();
  std::vector<Segment> out = segments;
  size_t k = 0;
  for (Segment& s : out) {
    std::string text;
    size_t at = 0;
    for (size_t hit; (hit = s.text.find(placeholder, at)) != std::string::npos; at = hit + placeholder.size()) {
      if (k >= images.size())
        throw std::invalid_argument("the rendered text holds more image placeholders ('" + placeholder + "') than the " +
                                    std::to_string(images.size()) + " image(s) of the record");
      text += s.text.substr(at, hit - at) + processor.expansion(images[k++]);
    }
    s.text = text + s.text.substr(at);
  }
  if (k != images.size())
    throw std::invalid_argument("the record has " + std::to_string(images.size()) + " image(s), the template rendered " +
                                std::to_string(k) + " placeholder(s) ('" + placeholder +
                                "') for them (a system message's image, or a template without images?)");
  return out;
}

int64_t image_token_id(const images::ImageProcessor& processor, const Tokenizer& tokenizer) {
  const std::string& token = processor.rules().image_token;
  const std::vector<int64_t> ids = tokenizer.encode(token);
  if (ids.size() != 1)
    throw std::invalid_argument(tokenizer.path() + ": the image processor's image token '" + token +
                                "' is not one token of this tokenizer (" + std::to_string(ids.size()) + " ids)");
  return ids[0];
}

void check_images_kept(const Sample& s, int64_t image_token, int64_t max_seq_len) {
  int64_t want = 0;
  for (const SampleImage& p : s.images) want += p.num_image_tokens;
  const int64_t have = std::count(s.tokens.begin(), s.tokens.end(), image_token);
  if (have == want) return;
  if (s.truncated)
    throw std::invalid_argument("max_seq_len " + std::to_string(max_seq_len) + " cuts into its images (" +
                                std::to_string(want) + " image tokens, " + std::to_string(have) +
                                " kept): raise data.max_seq_len or use smaller images");
  throw std::invalid_argument("its text holds " + std::to_string(have) + " image tokens, its images take " +
                              std::to_string(want) + " (an image token written in the text itself?)");
}

}  // namespace qlora::data
