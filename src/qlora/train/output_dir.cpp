#include "qlora/train/output_dir.h"

#include <cmath>
#include <filesystem>
#include <random>

#include "qlora/io/read_file.h"
#include "qlora/io/safetensors.h"  // write_file_atomic
#include "qlora/train/evaluate.h"

namespace qlora::train {

bool output_dir_is_shared(engine::World& world, const std::string& dir, c10::Device device) {
  if (world.size() == 1) return true;
  const std::string marker = dir + "/.qlora_shared_dir_check";
  // 52 random bits: exact in the double the sum carries to every rank.
  double token = 0;
  if (world.rank() == 0) {
    std::random_device rd;
    token = static_cast<double>((static_cast<uint64_t>(rd()) << 20 ^ rd()) & ((uint64_t{1} << 52) - 1)) + 1;
    io::write_file_atomic(marker, std::to_string(static_cast<uint64_t>(token)));
  }
  token = all_ranks_sum(world, token, device);  // also: rank 0 has written before anyone reads
  const auto seen = io::read_file(marker);
  const bool sees = seen && *seen == std::to_string(static_cast<uint64_t>(token));
  const double missing = all_ranks_sum(world, sees ? 0.0 : 1.0, device);
  if (world.rank() == 0) std::filesystem::remove(marker);
  return missing == 0;
}

}  // namespace qlora::train
