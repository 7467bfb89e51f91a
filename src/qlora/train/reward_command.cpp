#include "qlora/train/reward_command.h"

#include <sys/wait.h>

#include <charconv>
#include <cmath>
#include <stdexcept>

#include "qlora/io/subprocess.h"
#include "qlora/jinja/utf8.h"

namespace qlora::train {
namespace {

// A line as the error quotes it: at most 80 bytes, control characters escaped by the JSON dump.
std::string quoted(std::string_view line) {
  std::string s(line.substr(0, 80));
  if (line.size() > 80) s += "...";
  return nlohmann::json(utf8_replace_invalid(s)).dump();
}

bool parse_finite(std::string_view s, double& out) {
  while (!s.empty() && (s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return !s.empty() && ec == std::errc() && end == s.data() + s.size() && std::isfinite(out);
}

std::string stderr_tail(const io::SubprocessResult& r) {
  if (r.err_tail.empty()) return " (nothing on stderr)";
  return "; its stderr ends:\n" + utf8_replace_invalid(r.err_tail);
}

}  // namespace

std::string reward_command_input(const std::vector<RewardInput>& inputs) {
  std::string text;
  for (const RewardInput& in : inputs) {
    nlohmann::json line = in.record.is_object() ? in.record : nlohmann::json::object();
    line["completion"] = utf8_replace_invalid(in.completion);
    line["completion_tokens"] = in.completion_tokens;
    text += line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  }
  return text;
}

std::vector<double> run_reward_command(const std::string& command, const std::vector<RewardInput>& inputs,
                                       double timeout_s) {
  const std::string who = "grpo.reward_command '" + command + "'";
  const io::SubprocessResult r = io::run_subprocess(command, reward_command_input(inputs), timeout_s);
  if (r.timed_out)
    throw std::runtime_error(who + " did not finish within grpo.reward_timeout_s = " + nlohmann::json(timeout_s).dump() +
                             " s on " + std::to_string(inputs.size()) + " completions and was killed" + stderr_tail(r));
  if (!WIFEXITED(r.status) || WEXITSTATUS(r.status) != 0)
    throw std::runtime_error(who + " " + io::describe_exit(r.status) + stderr_tail(r));
  if (r.out_overflow)
    throw std::runtime_error(who + " wrote more than " + std::to_string(io::kMaxOutBytes >> 20) +
                             " MiB on stdout; expected one number per line (other output belongs on stderr)");
  std::vector<double> values;
  std::string_view out = r.out;
  for (size_t line = 1; !out.empty(); ++line) {
    const size_t nl = out.find('\n');
    const std::string_view text = out.substr(0, nl);
    out = nl == std::string_view::npos ? std::string_view() : out.substr(nl + 1);
    double v = 0;
    if (!parse_finite(text, v))
      throw std::runtime_error(who + ": line " + std::to_string(line) + " of its output is " + quoted(text) +
                               ", expected a finite number (one per completion; other output belongs on stderr)");
    values.push_back(v);
  }
  if (values.size() != inputs.size())
    throw std::runtime_error(who + " wrote " + std::to_string(values.size()) + " lines for " +
                             std::to_string(inputs.size()) +
                             " completions; expected one number per line, one line per completion, in order" +
                             (r.stdin_closed_early ? " (it did not read all of its input)" : ""));
  return values;
}

}  // namespace qlora::train
