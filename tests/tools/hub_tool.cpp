// Answers what conformance.hub_cache asks of qlora's Hub cache resolution, one JSON line per call,
// with the process's environment (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME, HOME):
//
//   hub_tool cache                       {"cache": hub_cache_dir()}
//   hub_tool model VALUE                 {"dir": resolve_local_or_hub(VALUE, model)} or {"error": message}
//   hub_tool snapshot ID[@REV] DIR       {"dir": hub_snapshot_dir(ID, model, DIR)} or {"error": message}
//   hub_tool splits DIR                  {"splits": {split: [file, ...]}, "order": [split, ...]} or {"error"}
//   hub_tool data VALUE SPLIT            {"file": resolve_data_file(VALUE, SPLIT)} or {"error": message}
#include <cstdio>
#include <exception>
#include <string>

#include <nlohmann/json.hpp>

#include "qlora/data/data_files.h"
#include "qlora/io/hub_cache.h"

using nlohmann::ordered_json;
using namespace qlora;

namespace {

ordered_json answer(int argc, char** argv) {
  const std::string cmd = argv[1];
  if (cmd == "cache" && argc == 2) return {{"cache", io::hub_cache_dir().string()}};
  if (cmd == "model" && argc == 3)
    return {{"dir", io::resolve_local_or_hub(argv[2], io::HubRepoType::kModel, "model.checkpoint_dir")}};
  if (cmd == "snapshot" && argc == 4) {
    const auto id = io::parse_hub_id(argv[2]);
    if (!id) return {{"error", std::string("not a Hub id: ") + argv[2]}};
    return {{"dir", io::hub_snapshot_dir(*id, io::HubRepoType::kModel, argv[3]).string()}};
  }
  if (cmd == "splits" && argc == 3) {
    ordered_json splits = ordered_json::object(), order = ordered_json::array();
    for (const auto& [name, files] : data::data_splits(argv[2])) {
      splits[name] = files;
      order.push_back(name);
    }
    return {{"splits", splits}, {"order", order}};
  }
  if (cmd == "data" && argc == 4) return {{"file", data::resolve_data_file(argv[2], argv[3], "data.path")}};
  throw std::invalid_argument("usage: hub_tool cache | model VALUE | snapshot ID DIR | splits DIR | data VALUE SPLIT");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: hub_tool cache | model VALUE | snapshot ID DIR | splits DIR | data VALUE SPLIT\n");
    return 2;
  }
  ordered_json out;
  try {
    out = answer(argc, argv);
  } catch (const std::exception& e) {
    out = {{"error", e.what()}};
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
