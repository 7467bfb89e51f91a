// Answers what conformance.hub_cache asks of qlora's Hub cache resolution. Requests come as JSON
// lines on stdin, {"args": [...], "env": {NAME: value or null}}, each answered by one JSON line on
// stdout, after setting (null: unsetting) its "env" variables (HF_HUB_CACHE, HF_HOME, HOME, ...):
// one process for all of them, as LibTorch takes most of a second to load.
//
//   ["cache"]                       {"cache": hub_cache_dir()}
//   ["model", VALUE]                {"dir": resolve_local_or_hub(VALUE, model)} or {"error": message}
//   ["snapshot", ID[@REV], DIR]     {"dir": hub_snapshot_dir(ID, model, DIR)} or {"error": message}
//   ["splits", DIR]                 {"splits": {split: [file, ...]}, "order": [split, ...]} or {"error"}
//   ["data", VALUE, SPLIT]          {"file": resolve_data_file(VALUE, SPLIT)} or {"error": message}
//   ["records", PATH]               {"records": [record, ...], "origins": [...]}: read_json_records(PATH),
//                                   the JSON objects every record format reads (binary values as
//                                   {"bytes": [...], "subtype": null}) or {"error": message}
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <exception>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qlora/data/data_files.h"
#include "qlora/data/dataset.h"
#include "qlora/io/hub_cache.h"

using nlohmann::ordered_json;
using namespace qlora;

namespace {

ordered_json answer(const std::vector<std::string>& a) {
  const std::string cmd = a.empty() ? "" : a[0];
  if (cmd == "cache" && a.size() == 1) return {{"cache", io::hub_cache_dir().string()}};
  if (cmd == "model" && a.size() == 2)
    return {{"dir", io::resolve_local_or_hub(a[1], io::HubRepoType::kModel, "model.checkpoint_dir")}};
  if (cmd == "snapshot" && a.size() == 3) {
    const auto id = io::parse_hub_id(a[1]);
    if (!id) return {{"error", "not a Hub id: " + a[1]}};
    return {{"dir", io::hub_snapshot_dir(*id, io::HubRepoType::kModel, a[2]).string()}};
  }
  if (cmd == "splits" && a.size() == 2) {
    ordered_json splits = ordered_json::object(), order = ordered_json::array();
    for (const auto& [name, files] : data::data_splits(a[1])) {
      splits[name] = files;
      order.push_back(name);
    }
    return {{"splits", splits}, {"order", order}};
  }
  if (cmd == "data" && a.size() == 3) return {{"file", data::resolve_data_file(a[1], a[2], "data.path")}};
  if (cmd == "records" && a.size() == 2) {
    ordered_json records = ordered_json::array(), origins = ordered_json::array();
    data::read_json_records(a[1], [&](const nlohmann::json& record, const std::string& origin) {
      records.push_back(ordered_json::parse(record.dump()));  // binary values as {"bytes", "subtype"}
      origins.push_back(origin);
    });
    return {{"records", records}, {"origins", origins}};
  }
  throw std::invalid_argument(
      "unknown request; expected cache | model VALUE | snapshot ID DIR | splits DIR | data VALUE SPLIT | records PATH");
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    ordered_json out;
    try {
      const auto request = nlohmann::json::parse(line);
      const nlohmann::json env = request.value("env", nlohmann::json::object());
      for (const auto& [name, value] : env.items())
        value.is_null() ? ::unsetenv(name.c_str()) : ::setenv(name.c_str(), value.get<std::string>().c_str(), 1);
      out = answer(request.at("args").get<std::vector<std::string>>());
    } catch (const std::exception& e) {
      out = {{"error", e.what()}};
    }
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}
