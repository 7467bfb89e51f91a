// Renders a chat template with qlora's Jinja interpreter, for tests/conformance/test_jinja_templates.py:
//
//   chat_template_tool TEMPLATE.jinja CASES.json OUT.json
//
// CASES: [{"context": {...}, "now": seconds}, ...]; OUT: [{"text", "spans"} or {"error", "raised"}, ...]
// in order. A template that does not parse fails the whole run (exit 1, the message on stderr).
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "qlora/jinja/template.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: chat_template_tool TEMPLATE.jinja CASES.json OUT.json\n");
    return 2;
  }
  try {
    std::ifstream tf(argv[1], std::ios::binary);
    std::stringstream source;
    source << tf.rdbuf();
    const auto t = qlora::jinja::Template::parse(source.str(), argv[1]);
    std::ifstream cf(argv[2]);
    const auto cases = nlohmann::ordered_json::parse(cf);
    nlohmann::json out = nlohmann::json::array();
    for (const auto& c : cases) {
      qlora::jinja::RenderOptions o;
      if (c.contains("now")) o.now_unix_seconds = c["now"].get<int64_t>();
      try {
        const auto r = t.render(c.at("context"), o);
        out.push_back({{"text", r.text}, {"spans", r.generation_spans}});
      } catch (const qlora::jinja::RaisedError& e) {
        out.push_back({{"error", e.message()}, {"raised", true}});
      } catch (const qlora::jinja::TemplateError& e) {
        out.push_back({{"error", e.what()}, {"raised", false}});
      }
    }
    std::ofstream(argv[3]) << out.dump();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
