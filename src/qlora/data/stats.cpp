#include "qlora/data/stats.h"

#include <algorithm>
#include <stdexcept>

#include "qlora/data/batching.h"

namespace qlora::data {
namespace {

std::vector<LengthBin> length_histogram(const std::vector<Sample>& samples, int64_t lo, int64_t hi, int64_t bins) {
  if (samples.empty()) return {};
  const int64_t width = std::max<int64_t>(1, (hi - lo + bins) / bins);  // ceil((hi - lo + 1) / bins)
  std::vector<LengthBin> h;
  for (int64_t start = lo; start <= hi; start += width) h.push_back(LengthBin{start, start + width - 1, 0});
  for (const auto& s : samples) ++h[static_cast<size_t>((static_cast<int64_t>(s.tokens.size()) - lo) / width)].count;
  return h;
}

}  // namespace

int64_t trained_token_count(const Sample& s) {
  if (s.labels.size() < 2) return 0;
  return std::count_if(s.labels.begin() + 1, s.labels.end(), [](int64_t l) { return l != kIgnoreIndex; });
}

int64_t samples_ending_trained(const std::vector<Sample>& samples, int64_t token) {
  return std::count_if(samples.begin(), samples.end(), [token](const Sample& s) {
    return !s.tokens.empty() && s.tokens.back() == token && s.labels.back() == token;
  });
}

DatasetStats dataset_stats(const std::vector<Sample>& samples, int64_t pack_seq_len, int64_t histogram_bins) {
  if (histogram_bins < 1) throw std::invalid_argument("dataset_stats: histogram_bins must be >= 1");
  DatasetStats st;
  st.samples = static_cast<int64_t>(samples.size());
  st.min_tokens = samples.empty() ? 0 : INT64_MAX;
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    const auto n = static_cast<int64_t>(s.tokens.size());
    const int64_t trained = trained_token_count(s);
    st.tokens += n;
    st.trained_tokens += trained;
    st.truncated += s.truncated;
    if (trained == 0) st.untrained.push_back(static_cast<int64_t>(i));
    st.min_tokens = std::min(st.min_tokens, n);
    st.max_tokens = std::max(st.max_tokens, n);
  }
  st.histogram = length_histogram(samples, st.min_tokens, st.max_tokens, histogram_bins);
  if (pack_seq_len > 0 && !samples.empty()) {
    st.packed_rows = static_cast<int64_t>(pack_samples(samples, pack_seq_len, 0).size());
    st.packing_efficiency = static_cast<double>(st.tokens) / static_cast<double>(st.packed_rows * pack_seq_len);
  }
  return st;
}

}  // namespace qlora::data
