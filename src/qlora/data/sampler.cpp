#include "qlora/data/sampler.h"
#include "qlora/io/durable_file.h"
#include "qlora/io/read_file.h"

#include <nlohmann/json.hpp>

#include <numeric>
#include <sstream>
#include <stdexcept>

namespace qlora::data {
namespace {

// Uniform in [0, n) without modulo bias: reject draws from the short last bucket.
uint64_t bounded(uint64_t& state, uint64_t n) {
  const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
  for (;;) {
    const uint64_t r = splitmix64_next(state);
    if (r >= threshold) return r % n;
  }
}

}  // namespace

uint64_t splitmix64_next(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Sampler::Sampler(SamplerOptions options) : options_(options) {
  if (options_.dataset_size <= 0) throw std::invalid_argument("sampler: dataset_size must be > 0");
  if (options_.batch_size <= 0) throw std::invalid_argument("sampler: batch_size must be > 0");
  if (options_.world_size <= 0) throw std::invalid_argument("sampler: world_size must be > 0");
  if (options_.rank < 0 || options_.rank >= options_.world_size) {
    throw std::invalid_argument("sampler: rank " + std::to_string(options_.rank) +
                                " is outside [0, world_size=" +
                                std::to_string(options_.world_size) + ")");
  }
}

int64_t Sampler::global_batches() const {
  const auto& o = options_;
  if (o.drop_last) return o.dataset_size / o.batch_size / o.world_size * o.world_size;
  return (o.dataset_size + o.batch_size - 1) / o.batch_size;
}

int64_t Sampler::batches_per_epoch() const {
  const int64_t g = global_batches();
  const int64_t w = options_.world_size, r = options_.rank;
  return g / w + (r < g % w ? 1 : 0);
}

std::vector<int64_t> Sampler::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(options_.dataset_size));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (!options_.shuffle) return order;
  // One stream per (seed, epoch): mixing the epoch through splitmix64 first keeps nearby seeds
  // and epochs from giving related streams.
  uint64_t e = static_cast<uint64_t>(epoch);
  uint64_t state = options_.seed ^ splitmix64_next(e);
  for (size_t i = order.size() - 1; i > 0; --i) {
    std::swap(order[i], order[bounded(state, i + 1)]);
  }
  return order;
}

std::vector<int64_t> Sampler::batch(int64_t epoch, int64_t b) const {
  if (b < 0 || b >= batches_per_epoch()) {
    throw std::out_of_range("sampler: batch " + std::to_string(b) + " outside [0, " +
                            std::to_string(batches_per_epoch()) + ")");
  }
  if (cached_epoch_ != epoch) {
    cached_order_ = epoch_order(epoch);
    cached_epoch_ = epoch;
  }
  const int64_t global = b * options_.world_size + options_.rank;
  const int64_t begin = global * options_.batch_size;
  const int64_t end = std::min(begin + options_.batch_size, options_.dataset_size);
  return {cached_order_.begin() + begin, cached_order_.begin() + end};
}

std::vector<int64_t> Sampler::next() {
  if (batches_per_epoch() == 0) return {};
  if (state_.position >= batches_per_epoch()) {
    ++state_.epoch;
    state_.position = 0;
  }
  return batch(state_.epoch, state_.position++);
}

void Sampler::set_state(const SamplerState& s) {
  if (s.epoch < 0 || s.position < 0 || s.position > batches_per_epoch()) {
    throw std::invalid_argument("sampler: state {epoch " + std::to_string(s.epoch) +
                                ", position " + std::to_string(s.position) +
                                "} is invalid; an epoch has " +
                                std::to_string(batches_per_epoch()) + " batches on this rank");
  }
  state_ = s;
}

std::string Sampler::state_json() const {
  const auto& o = options_;
  nlohmann::json j = {{"epoch", state_.epoch},           {"position", state_.position},
                      {"seed", o.seed},                  {"dataset_size", o.dataset_size},
                      {"batch_size", o.batch_size},      {"shuffle", o.shuffle},
                      {"drop_last", o.drop_last},        {"world_size", o.world_size},
                      {"rank", o.rank}};
  return j.dump(2) + "\n";
}

void Sampler::load_state_json(const std::string& text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(origin + ": bad JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(origin + ": expected a JSON object");
  const auto get_int = [&](const char* key) -> int64_t {
    const auto it = j.find(key);
    if (it == j.end()) throw std::invalid_argument(origin + ": missing key \"" + key + "\"");
    if (!it->is_number_integer()) {
      throw std::invalid_argument(origin + ": key \"" + key + "\" must be an integer");
    }
    return it->get<int64_t>();
  };
  const auto get_bool = [&](const char* key) -> bool {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_boolean()) {
      throw std::invalid_argument(origin + ": key \"" + key + "\" must be true or false");
    }
    return it->get<bool>();
  };
  const auto must_match = [&](const char* key, auto saved, auto now) {
    if (saved != now) {
      std::ostringstream msg;
      msg << origin << ": key \"" << key << "\" is " << saved << " but this run has " << now
          << "; the saved position would not resume the same order";
      throw std::invalid_argument(msg.str());
    }
  };
  const auto seed_it = j.find("seed");
  if (seed_it == j.end() || !seed_it->is_number_unsigned()) {
    throw std::invalid_argument(origin + ": key \"seed\" must be a non-negative integer");
  }
  const auto& o = options_;
  must_match("seed", seed_it->get<uint64_t>(), o.seed);
  must_match("dataset_size", get_int("dataset_size"), o.dataset_size);
  // The global batch, however many ranks share it (states of earlier releases: one rank drawing it all).
  must_match("batch_size x world_size", get_int("batch_size") * get_int("world_size"), o.batch_size * o.world_size);
  must_match("shuffle", get_bool("shuffle"), o.shuffle);
  must_match("drop_last", get_bool("drop_last"), o.drop_last);
  try {
    set_state(SamplerState{get_int("epoch"), get_int("position")});
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(origin + ": " + e.what());
  }
}

void Sampler::save_state(const std::string& path) const {
  // Durable like every other file of a resume checkpoint: a crash never leaves a torn state file.
  io::write_file_atomic(path, state_json());
}

void Sampler::load_state(const std::string& path) {
  const auto text = io::read_file(path);
  if (!text) throw std::invalid_argument("sampler: cannot open state file '" + path + "'");
  load_state_json(*text, path);
}

}  // namespace qlora::data
