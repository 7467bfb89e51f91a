#include "qlora/train/output_dir.h"

#include <algorithm>
#include <filesystem>
#include <random>
#include <stdexcept>

#include "qlora/io/read_file.h"
#include "qlora/io/durable_file.h"
#include "qlora/train/evaluate.h"

namespace qlora::train {

bool OutputDirs::shared() const {
  return std::all_of(lead_of.begin(), lead_of.end(), [](int l) { return l == 0; });
}

int OutputDirs::count() const {
  int n = 0;
  for (size_t r = 0; r < lead_of.size(); ++r) n += leads(static_cast<int>(r));
  return n;
}

std::vector<int> OutputDirs::ranks_with(int rank) const {
  std::vector<int> out;
  for (size_t r = 0; r < lead_of.size(); ++r)
    if (lead_of[r] == lead_of.at(static_cast<size_t>(rank))) out.push_back(static_cast<int>(r));
  return out;
}

std::vector<bool> OutputDirs::sees_dir_of(int rank) const {
  std::vector<bool> out;
  for (int l : lead_of) out.push_back(l == lead_of.at(static_cast<size_t>(rank)));
  return out;
}

std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.empty()) return "no rank";
  bool contiguous = true;
  for (size_t i = 1; i < ranks.size(); ++i) contiguous = contiguous && ranks[i] == ranks[i - 1] + 1;
  if (ranks.size() == 1) return "rank " + std::to_string(ranks[0]);
  if (contiguous) return "ranks " + std::to_string(ranks.front()) + "-" + std::to_string(ranks.back());
  std::string s = "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string OutputDirs::describe() const {
  std::string s = std::to_string(count()) + (count() == 1 ? " directory: " : " directories: ");
  for (size_t r = 0; r < lead_of.size(); ++r)
    if (leads(static_cast<int>(r))) s += (r ? "; " : "") + rank_list(ranks_with(static_cast<int>(r)));
  return s;
}

OutputDirs find_output_dirs(engine::World& world, const std::string& dir, c10::Device device) {
  const int n = world.size(), me = world.rank();
  if (n == 1) return {{0}};
  const auto marker = [&](int r) { return dir + "/.qlora_dir_check." + std::to_string(r); };
  std::random_device rd;  // 52 random bits, + 1: exact in a double, never 0
  const double token =
      static_cast<double>((static_cast<uint64_t>(rd()) << 20 ^ rd()) & ((uint64_t{1} << 52) - 1)) + 1;
  const auto text = [](double t) { return std::to_string(static_cast<uint64_t>(t)); };
  io::write_file_atomic(marker(me), text(token));
  const std::vector<double> tokens = every_rank(world, token, device);  // also: every marker is written
  std::vector<bool> sees(static_cast<size_t>(n));
  int lead = me;
  for (int r = n - 1; r >= 0; --r) {
    const auto seen = io::read_file(marker(r));
    sees[static_cast<size_t>(r)] = seen && *seen == text(tokens[static_cast<size_t>(r)]);
    if (sees[static_cast<size_t>(r)]) lead = r;
  }
  OutputDirs dirs;
  for (double l : every_rank(world, lead, device)) dirs.lead_of.push_back(static_cast<int>(l));  // also: all have read
  std::filesystem::remove(marker(me));
  std::vector<int> odd;  // ranks whose view differs from the directories their leads imply
  for (int r = 0; r < n; ++r)
    if (sees[static_cast<size_t>(r)] != (dirs.lead_of[static_cast<size_t>(r)] == lead)) odd.push_back(r);
  const std::vector<double> odd_counts = every_rank(world, static_cast<double>(odd.size()), device);
  for (int r = 0; r < n; ++r)
    if (odd_counts[static_cast<size_t>(r)] > 0)
      throw std::invalid_argument(
          "checkpoint.output_dir = " + dir + ": rank " + std::to_string(r) +
          " sees some of the files other ranks write there but not all (" + dirs.describe() +
          " by their lowest ranks); it must be one filesystem for all ranks, or one per node");
  return dirs;
}

}  // namespace qlora::train
