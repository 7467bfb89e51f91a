// Recipe config: defaults, every error class (message names key, line, allowed values), overrides,
// exact round trip, hashing, the resume exactness check, and every shipped file in configs/.
#include "qlora/config/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;
using namespace qlora;
using namespace qlora::config;

namespace {

// The message of the ConfigError that parsing `text` throws ("" if none).
std::string parse_error(const std::string& text) {
  try {
    parse_config(text, "t.toml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string override_error(RecipeConfig& cfg, const std::string& text) {
  try {
    apply_override(cfg, text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// <repo>/configs, found from QLORA_TEST_DATA (<repo>/tests/data), which ctest sets.
fs::path configs_dir() {
  const char* data = std::getenv("QLORA_TEST_DATA");
  return (data ? fs::path(data).parent_path().parent_path() : fs::path("..")) / "configs";
}

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

}  // namespace

TEST(Config, EmptyTextGivesStructDefaults) {
  const RecipeConfig c = parse_config("", "empty");
  EXPECT_TRUE(c == RecipeConfig{});
  EXPECT_EQ(c.lora.rank, 8);
  EXPECT_EQ(c.lora.targets, (std::vector<std::string>{"q", "k", "v", "o"}));
  EXPECT_EQ(c.optim.lr, 2e-4);
  EXPECT_EQ(c.optim.schedule, optim::ScheduleKind::Cosine);
  EXPECT_EQ(c.training.grad_accum, 8);
  EXPECT_EQ(c.checkpoint.output_dir, "out");
  EXPECT_TRUE(c.model.activation_checkpointing);
  EXPECT_EQ(c.model.device, "auto");
  EXPECT_EQ(c.model.tokenizer, "");
  EXPECT_EQ(c.data.split, "train");
  EXPECT_EQ(c.model.untrained_tokens, train::UntrainedTokensPolicy::kError);
}

TEST(Config, ParsesEveryKind) {
  const RecipeConfig c = parse_config(R"(
[model]
checkpoint_dir = "/m/Llama-2-7b-hf"
dtype = "fp32"
base = "bf16"
activation_checkpointing = false
untrained_tokens = "mean"
[lora]
rank = 16
alpha = 32          # an integer is accepted where a float is expected
targets = ["q", "v", "gate", "up", "down", "output"]
[data]
template = "llama3-chat"
format = "chat"
max_seq_len = 2048
[optim]
lr = 3e-4
betas = [0.9, 0.95]
schedule = "constant"
[checkpoint]
merge_from = "original"
[logging]
progress = "plain"
)",
                                      "t.toml");
  EXPECT_EQ(c.model.checkpoint_dir, "/m/Llama-2-7b-hf");
  EXPECT_EQ(c.model.dtype, at::kFloat);
  EXPECT_EQ(c.model.base, BaseFormat::BF16);
  EXPECT_FALSE(c.model.activation_checkpointing);
  EXPECT_EQ(c.model.untrained_tokens, train::UntrainedTokensPolicy::kMean);
  EXPECT_EQ(c.lora.rank, 16);
  EXPECT_EQ(c.lora.alpha, 32.0);
  EXPECT_EQ(c.lora.targets.size(), 6u);
  EXPECT_EQ(c.data.template_, data::TemplateKind::kLlama3Chat);
  EXPECT_EQ(c.data.format, data::DatasetKind::kChat);
  EXPECT_EQ(c.data.max_seq_len, 2048);
  EXPECT_EQ(c.optim.lr, 3e-4);
  EXPECT_EQ(c.optim.betas[1], 0.95);
  EXPECT_EQ(c.optim.schedule, optim::ScheduleKind::Constant);
  EXPECT_EQ(c.checkpoint.merge_from, checkpoint::MergeSource::Original);
  EXPECT_EQ(c.logging.progress, report::ProgressMode::Plain);
  EXPECT_EQ(c.training.seed, 42);  // untouched section keeps defaults
}

TEST(Config, UnknownKeyNamesFileKeyLineAndKnownKeys) {
  const std::string e = parse_error("[optim]\nlr = 1e-4\nlrr = 2e-4\n");
  EXPECT_CONTAINS(e, "config t.toml: unknown key 'optim.lrr' (line 3)");
  EXPECT_CONTAINS(e, "known keys in [optim]: lr, weight_decay, betas, eps, warmup_steps");
}

TEST(Config, UnknownSectionAndTopLevelKey) {
  EXPECT_CONTAINS(parse_error("[optimizer]\nlr = 1.0\n"), "unknown section 'optimizer' (line 1)");
  EXPECT_CONTAINS(parse_error("seed = 3\n"), "unknown key 'seed' (line 1)");
  EXPECT_CONTAINS(parse_error("model = 3\n"), "'model' (line 1) must be a table");
}

TEST(Config, WrongTypeNamesKeyExpectedTypeAndLine) {
  std::string e = parse_error("[lora]\n\nrank = \"eight\"\n");
  EXPECT_CONTAINS(e, "key 'lora.rank' (line 3) expects an integer, got a string");
  e = parse_error("[lora]\nrank = 8.0\n");  // a float is not silently truncated
  EXPECT_CONTAINS(e, "'lora.rank' (line 2) expects an integer, got a float");
  e = parse_error("[data]\nshuffle = 1\n");
  EXPECT_CONTAINS(e, "'data.shuffle' (line 2) expects a boolean");
  e = parse_error("[optim]\nbetas = [0.9]\n");
  EXPECT_CONTAINS(e, "'optim.betas' (line 2) expects an array of 2 numbers");
  e = parse_error("[lora]\ntargets = [\"q\", 1]\n");
  EXPECT_CONTAINS(e, "'lora.targets' (line 2) expects an array of strings");
}

TEST(Config, InvalidEnumListsAllowedValues) {
  const std::string e = parse_error("[data]\ntemplate = \"vicuna\"\n");
  EXPECT_CONTAINS(e, "invalid value 'vicuna' for 'data.template' (line 2)");
  EXPECT_CONTAINS(e, "allowed: auto, alpaca, llama2-chat, llama3-chat, llama3.1-chat, chatml, qwen2.5, qwen3, gemma, mistral-v0.3, none");
  EXPECT_CONTAINS(parse_error("[model]\nbase = \"int8\"\n"), "allowed: nf4, bf16, fp32");
}

TEST(Config, RangeChecksNameKeyAndLine) {
  EXPECT_CONTAINS(parse_error("[lora]\nrank = 0\n"), "'lora.rank' (line 2) must be >= 1, got 0");
  EXPECT_CONTAINS(parse_error("[optim]\nlr = 0.0\n"), "'optim.lr' (line 2) must be > 0");
  EXPECT_CONTAINS(parse_error("[optim]\nlr = -1e-4\n"), "'optim.lr'");
  EXPECT_CONTAINS(parse_error("[lora]\ndropout = 1.0\n"), "'lora.dropout' (line 2) must be in [0, 1)");
  EXPECT_CONTAINS(parse_error("[training]\nbatch_size = 0\n"), "'training.batch_size' (line 2) must be >= 1");
  EXPECT_CONTAINS(parse_error("[training]\ngrad_accum = -2\n"), "'training.grad_accum'");
  EXPECT_CONTAINS(parse_error("[optim]\nbetas = [0.9, 1.0]\n"), "'optim.betas'");
  EXPECT_CONTAINS(parse_error("[lora]\ntargets = [\"q\", \"qkvo\"]\n"),
                  "'lora.targets' (line 2) must be a list of q, k, v, o, gate, up, down, output, qkv, gate_up, linear_qkv, "
                  "linear_z, linear_b, linear_a, linear_out, ple_gate, ple_proj, shared_gate, shared_up, shared_down, experts, "
                  "shared_expert, got 'qkvo'");
  EXPECT_CONTAINS(parse_error("[lora]\ntargets = [\"q\", \"q\"]\n"), "duplicates");
  EXPECT_CONTAINS(parse_error("[lora]\nvision_targets = [\"qkv\", \"qkv\"]\n"), "lora.vision_targets");
  EXPECT_CONTAINS(parse_error("[lora]\nvision_targets = [\"qkv\"]\nuse_dora = true\n"), "DoRA on the vision tower");
  EXPECT_CONTAINS(parse_error("[lora]\ntargets = []\n"), "'lora.targets' (line 2) must be non-empty");
  EXPECT_CONTAINS(parse_error("[data]\nval_fraction = 1.0\n"), "'data.val_fraction' (line 2) must be in [0, 1)");
  EXPECT_CONTAINS(parse_error("[data]\nval_path = \"v.jsonl\"\nval_fraction = 0.1\n"),
                  "'data.val_fraction' (line 3) must be 0 when data.val_path is set");
  EXPECT_CONTAINS(parse_error("[training]\neval_every_steps = -1\n"), "'training.eval_every_steps' (line 2) must be >= 0");
  EXPECT_CONTAINS(parse_error("[training]\non_nonfinite = \"ignore\"\n"),
                  "invalid value 'ignore' for 'training.on_nonfinite' (line 2); allowed: stop, skip");
  EXPECT_CONTAINS(parse_error("[model]\nuntrained_tokens = \"zero\"\n"),
                  "invalid value 'zero' for 'model.untrained_tokens' (line 2); allowed: error, mean");
  EXPECT_CONTAINS(parse_error("[model]\ndevice = \"gpu\"\n"),
                  "'model.device' (line 2) must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got \"gpu\"");
  EXPECT_CONTAINS(parse_error("[model]\ndevice = \"cuda:\"\n"), "'model.device'");
  EXPECT_CONTAINS(parse_error("[model]\ndevice = \"cuda:x1\"\n"), "'model.device'");
  EXPECT_CONTAINS(parse_error("[checkpoint]\ngguf = [\"q8_0\", \"q4\"]\n"), "'checkpoint.gguf' (line 2) must be a list of f32, f16");
  EXPECT_CONTAINS(parse_error("[checkpoint]\ngguf = [\"q8_0\", \"q8_0\"]\n"), "duplicates");
  EXPECT_CONTAINS(parse_error("[checkpoint]\nadapter_only = true\ngguf = [\"f16\"]\n"),
                  "'checkpoint.gguf' (line 3) must be empty when checkpoint.adapter_only = true");
  // Edge values that are valid.
  EXPECT_EQ(parse_error("[checkpoint]\ngguf = [\"f16\", \"q8_0\", \"q4_0\"]\n"), "");
  EXPECT_EQ(parse_error("[optim]\nmax_grad_norm = 0.0\nwarmup_steps = 0\n[lora]\ndropout = 0.0\n"), "");
  EXPECT_EQ(parse_error("[model]\ndevice = \"cuda:1\"\n"), "");
  EXPECT_EQ(parse_error("[model]\ndevice = \"cpu\"\n"), "");
}

TEST(Config, SyntaxErrorNamesFileAndLine) {
  const std::string e = parse_error("[optim]\nlr = = 3\n");
  EXPECT_CONTAINS(e, "config t.toml: TOML syntax error at line 2");
}

TEST(Config, LoadConfigNamesMissingFile) {
  try {
    load_config("/nonexistent/x.toml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_CONTAINS(e.what(), "config /nonexistent/x.toml: cannot open");
  }
}

TEST(Config, OverridesParseTomlValuesAndBareStrings) {
  RecipeConfig c;
  apply_override(c, "optim.lr=1e-5");
  apply_override(c, "optim.warmup_steps = 7");
  apply_override(c, "lora.alpha=8");  // integer text into a float key
  apply_override(c, "model.checkpoint_dir=/m/Llama-2-7b-hf");  // unquoted path
  apply_override(c, "data.path=\"/d/with space.json\"");
  apply_override(c, "data.template=chatml");  // unquoted enum
  apply_override(c, "checkpoint.resume=true");
  apply_override(c, "lora.targets=[\"q\",\"v\"]");
  apply_override(c, "optim.betas=[0.8, 0.9]");
  apply_override(c, "data.template_kwargs={enable_thinking=false}");
  apply_override(c, "data.add_bos=true");
  apply_override(c, "data.add_eos=\"auto\"");
  apply_override(c, "data.split=validation");
  EXPECT_EQ(c.data.split, "validation");
  RecipeConfig hub;  // a Hub id with a revision, unquoted: taken verbatim
  apply_override(hub, "model.checkpoint_dir=Qwen/Qwen2.5-7B-Instruct@refs/pr/3");
  EXPECT_EQ(hub.model.checkpoint_dir, "Qwen/Qwen2.5-7B-Instruct@refs/pr/3");
  EXPECT_EQ(c.data.template_kwargs, nlohmann::ordered_json({{"enable_thinking", false}}));
  EXPECT_EQ(c.data.add_bos, std::optional<bool>(true));
  EXPECT_FALSE(c.data.add_eos.has_value());
  EXPECT_CONTAINS(override_error(c, "data.add_bos=1"), "'data.add_bos' expects a boolean or \"auto\"");
  EXPECT_CONTAINS(override_error(c, "data.template_kwargs=3"), "'data.template_kwargs' expects a table");
  EXPECT_EQ(c.optim.lr, 1e-5);
  EXPECT_EQ(c.optim.warmup_steps, 7);
  EXPECT_EQ(c.lora.alpha, 8.0);
  EXPECT_EQ(c.model.checkpoint_dir, "/m/Llama-2-7b-hf");
  EXPECT_EQ(c.data.path, "/d/with space.json");
  EXPECT_EQ(c.data.template_, data::TemplateKind::kChatML);
  EXPECT_TRUE(c.checkpoint.resume);
  EXPECT_EQ(c.lora.targets, (std::vector<std::string>{"q", "v"}));
  EXPECT_EQ(c.optim.betas[0], 0.8);
}

TEST(Config, OverrideErrorsNameTheOverrideAndLeaveConfigUntouched) {
  RecipeConfig c;
  const RecipeConfig before = c;
  EXPECT_CONTAINS(override_error(c, "optim.lrr=1"), "override 'optim.lrr=1': unknown key 'optim.lrr'");
  EXPECT_CONTAINS(override_error(c, "optim.lrr=1"), "known keys in [optim]: lr,");
  EXPECT_CONTAINS(override_error(c, "optimizer.lr=1"), "unknown section 'optimizer'");
  EXPECT_CONTAINS(override_error(c, "optim.lr"), "expected section.key=value");
  EXPECT_CONTAINS(override_error(c, "lr=1"), "expected section.key=value");
  EXPECT_CONTAINS(override_error(c, "optim.lr=fast"), "override 'optim.lr=fast': value 'fast'");
  EXPECT_CONTAINS(override_error(c, "lora.rank=\"8\""), "'lora.rank' expects an integer, got a string");
  EXPECT_CONTAINS(override_error(c, "lora.rank=0"), "override 'lora.rank=0': 'lora.rank' must be >= 1");
  EXPECT_CONTAINS(override_error(c, "model.base=int4"), "allowed: nf4, bf16, fp32");
  EXPECT_CONTAINS(override_error(c, "model.untrained_tokens=Mean"), "'model.untrained_tokens'");
  EXPECT_CONTAINS(override_error(c, "model.untrained_tokens=Mean"), "allowed: error, mean");
  EXPECT_TRUE(c == before);
}

TEST(Config, ToTomlRoundTripsExactly) {
  RecipeConfig c;
  c.model.checkpoint_dir = "C:\\odd \"path\"\twith\ncontrol\x01";
  c.optim.lr = 0.1 + 0.2;  // needs 17 digits
  c.optim.eps = 1e-300;
  c.optim.max_grad_norm = -1.0;
  c.lora.alpha = 3.0;  // must stay a float in TOML
  c.lora.targets = {"gate", "output"};
  c.training.seed = 9007199254740993;  // > 2^53: integers stay exact
  c.data.template_ = std::nullopt;  // "none"
  // TOML tables are unordered: keys come back sorted (a template's keyword arguments have no order).
  c.data.template_kwargs = {{"enable_thinking", false}, {"f", 0.5}, {"list", {1, "a"}}, {"n", 2},
                            {"name", "x \"y\""}, {"nested", {{"k", true}}}};
  c.data.add_bos = false;  // add_eos stays "auto"
  const std::string text = to_toml(c);
  const RecipeConfig back = parse_config(text, "roundtrip");
  EXPECT_TRUE(back == c) << text;
  EXPECT_EQ(back.optim.lr, c.optim.lr);
  EXPECT_EQ(back.model.checkpoint_dir, c.model.checkpoint_dir);
  EXPECT_EQ(back.training.seed, c.training.seed);
  EXPECT_EQ(to_toml(back), text);
  EXPECT_CONTAINS(text, "\nalpha = 3.0\n");
  EXPECT_CONTAINS(text, "\nadd_bos = false\n");
  EXPECT_EQ(text.find("add_eos"), std::string::npos);  // "auto" (unset) is not written
  EXPECT_EQ(back.data.template_kwargs.dump(), c.data.template_kwargs.dump());
  EXPECT_CONTAINS(text, "\nlr = 0.30000000000000004\n");
  EXPECT_CONTAINS(text, "\ncheckpoint_dir = \"C:\\\\odd \\\"path\\\"\\twith\\ncontrol\\u0001\"\n");
}

// toml++ writes floats with 17 significant digits (0.00020000000000000001) or, relaxed, with 6
// (not always exact): a text takes the 6 where everything then reads back the same.
TEST(Config, FloatsAreWrittenAsShortAsReadsBackExactly) {
  RecipeConfig c;
  const std::string text = to_toml(c);
  EXPECT_CONTAINS(text, "\nlr = 0.0002\n");
  EXPECT_CONTAINS(text, "\neps = 1e-08\n");
  EXPECT_CONTAINS(text, "\nbetas = [ 0.9, 0.999 ]\n");
  EXPECT_CONTAINS(text, "\nalpha = 16.0\n");
  c.optim.lr = 1.0 / 3;  // needs 17 digits: the whole text takes them (and stays exact)
  const std::string exact = to_toml(c);
  EXPECT_CONTAINS(exact, "\nlr = 0.33333333333333331\n");
  EXPECT_CONTAINS(exact, "\nbetas = [ 0.90000000000000002, 0.999 ]\n");
  EXPECT_TRUE(parse_config(exact, "exact") == c);
  // One value at a time (`qlora config`, the resume check): each as short as it reads back.
  const auto values = key_values(c);
  const auto value_of = [&](const std::string& key) {
    for (const auto& [k, v] : values)
      if (k == key) return v;
    return std::string("?");
  };
  EXPECT_EQ(value_of("optim.lr"), "0.33333333333333331");
  EXPECT_EQ(value_of("optim.betas"), "[ 0.9, 0.999 ]");
  EXPECT_EQ(value_of("lora.targets"), "[ \"q\", \"k\", \"v\", \"o\" ]");
  EXPECT_EQ(value_of("data.add_eos"), "\"auto\"");
}

// A config as the hand-written TOML writer before toml++ put it in each resume checkpoint's
// meta.json (tests/data/legacy_resume/config_before_tomlpp.toml: keys in the key table's order,
// other spacing, every float kind, escapes, template_kwargs and grpo.rewards): it reads back as
// the same config, so those checkpoints resume. Only config_hash, a hash of the text, moved
// (meta.json records it; resume compares the keys themselves, never the hash).
TEST(Config, TextOfTheEarlierWriterReadsBackAsTheSameConfig) {
  RecipeConfig c = parse_config(
      "[grpo]\nreward_command = \"python3 score.py\"\n"
      "[[grpo.rewards]]\nkind = \"answer\"\nweight = 2\n"
      "[[grpo.rewards]]\nkind = \"regex\"\npattern = \"^<think>(?s).*</think>\"\nweight = 0.5\n",
      "t.toml");
  c.model.checkpoint_dir = "C:\\odd \"path\"\twith\ncontrol\x01 caf\xc3\xa9";
  c.optim.lr = 0.1 + 0.2;
  c.optim.eps = 1e-300;
  c.lora.alpha = 3.0;
  c.lora.targets = {"gate", "output"};
  c.training.seed = 9007199254740993;
  c.data.template_ = std::nullopt;
  c.data.template_kwargs = {{"enable_thinking", false}, {"f", 0.5}, {"list", {1, "a"}}, {"n", 2},
                            {"name", "x \"y\""}, {"nested", {{"k", true}}}};
  c.data.add_bos = false;
  const char* data = std::getenv("QLORA_TEST_DATA");
  ASSERT_NE(data, nullptr) << "set QLORA_TEST_DATA=<repo>/tests/data";
  const RecipeConfig old = load_config((fs::path(data) / "legacy_resume" / "config_before_tomlpp.toml").string());
  EXPECT_TRUE(old == c) << to_toml(old) << "\nvs\n" << to_toml(c);
  EXPECT_TRUE(exactness_breaking_differences(old, c).empty());
  EXPECT_EQ(old.optim.lr, c.optim.lr);
  EXPECT_EQ(old.model.checkpoint_dir, c.model.checkpoint_dir);
  EXPECT_EQ(old.data.template_kwargs.dump(), c.data.template_kwargs.dump());
  EXPECT_EQ(config_hash(c, HashScope::Full), config_hash(old, HashScope::Full));
  EXPECT_NE(config_hash(c, HashScope::Full), "e46e1cb6552dbae4");  // the earlier writer's text hashed so
}

// grpo.rewards: an array of tables, each with its kind's keys only; values refused naming the
// entry's key; written back and overridden like any key.
TEST(Config, GrpoRewards) {
  const RecipeConfig c = parse_config(
      "[grpo]\nreward_command = \"python3 score.py\"\nreward_timeout_s = 5\n"
      "[[grpo.rewards]]\nkind = \"answer\"\nweight = 2\n"
      "[[grpo.rewards]]\nkind = \"regex\"\npattern = \"^<think>(?s).*</think>\"\nweight = 0.5\n"
      "[[grpo.rewards]]\nkind = \"length\"\ntarget = 200\nmax = 256\n",
      "t.toml");
  ASSERT_EQ(c.grpo.rewards.size(), 3u);
  EXPECT_EQ(c.grpo.rewards[0].kind, train::RewardKind::kAnswer);
  EXPECT_EQ(c.grpo.rewards[0].weight, 2.0);
  EXPECT_EQ(c.grpo.rewards[0].field, "answer");
  EXPECT_EQ(c.grpo.rewards[1].pattern, "^<think>(?s).*</think>");
  EXPECT_EQ(c.grpo.rewards[2].target, 200);
  EXPECT_EQ(c.grpo.rewards[2].max, 256);
  EXPECT_EQ(c.grpo.reward_command, "python3 score.py");
  EXPECT_EQ(c.grpo.reward_timeout_s, 5);
  const std::string text = to_toml(c);
  // Each table with its kind's keys only; toml++ puts an array past 120 columns one element a line.
  EXPECT_CONTAINS(text, "\nrewards = [\n"
                        "    { field = \"answer\", kind = \"answer\", tolerance = 1e-06, weight = 2.0 },\n"
                        "    { kind = \"regex\", pattern = \"^<think>(?s).*</think>\", weight = 0.5 },\n"
                        "    { kind = \"length\", max = 256, target = 200, weight = 1.0 }\n"
                        "]\n");
  EXPECT_TRUE(parse_config(text, "back") == c);
  RecipeConfig o;
  apply_override(o, "grpo.rewards=[{kind=\"regex\", pattern=\"\\\\d\"}]");
  EXPECT_EQ(o.grpo.rewards.at(0).pattern, "\\d");
  EXPECT_EQ(exactness_breaking_differences(RecipeConfig{}, o), (std::vector<std::string>{"grpo.rewards"}));

  EXPECT_CONTAINS(parse_error("[[grpo.rewards]]\nkind = \"regex\"\npattern = \"(\"\n"),
                  "config t.toml: 'grpo.rewards[0].pattern' must be a valid PCRE2 pattern, got \"(\"");
  EXPECT_CONTAINS(parse_error("[[grpo.rewards]]\nkind = \"answer\"\n[[grpo.rewards]]\nkind = \"regex\"\ntarget = 3\n"),
                  "unknown key 'grpo.rewards[1].target' (line 5) for kind \"regex\"; its keys: kind, weight, pattern");
  EXPECT_CONTAINS(parse_error("[[grpo.rewards]]\nweight = 1\n"), "key 'grpo.rewards[0].kind' (line 1) is missing; one of answer, regex, length");
  EXPECT_CONTAINS(parse_error("[[grpo.rewards]]\nkind = \"exact\"\n"),
                  "invalid value 'exact' for 'grpo.rewards[0].kind' (line 2); allowed: answer, regex, length");
  EXPECT_CONTAINS(parse_error("[[grpo.rewards]]\nkind = \"length\"\ntarget = \"long\"\n"),
                  "key 'grpo.rewards[0].target' (line 3) expects an integer, got a string");
  EXPECT_CONTAINS(parse_error("[[grpo.rewards]]\nkind = \"length\"\ntarget = 10\n"),
                  "'grpo.rewards[0].max' must be above target = 10 (tokens), got 0");
  EXPECT_CONTAINS(parse_error("[grpo]\nrewards = [1]\n"), "key 'grpo.rewards[0]' (line 2) expects a table");
  EXPECT_CONTAINS(parse_error("[grpo]\nrewards = \"answer\"\n"), "key 'grpo.rewards' (line 2) expects an array of tables");
  EXPECT_CONTAINS(parse_error("[grpo]\nreward_timeout_s = 0\n"), "'grpo.reward_timeout_s' (line 2) must be >= 1 (seconds), got 0");
  EXPECT_CONTAINS(parse_error("[grpo]\nreward_command_weight = nan\n"), "'grpo.reward_command_weight' (line 2) must be a finite number");
}

// The rollout and objective keys: TRL's defaults, parsed, handed to the loss, refused naming the key.
TEST(Config, GrpoObjectiveKeys) {
  const RecipeConfig d;
  EXPECT_EQ(d.grpo.loss_type, train::GrpoLossType::kDapo);
  EXPECT_EQ(d.grpo.num_generations, 8);
  EXPECT_FALSE(d.grpo.options().epsilon_high.has_value());
  const RecipeConfig c = parse_config(
      "[grpo]\nloss_type = \"cispo\"\nimportance_sampling_level = \"sequence\"\nscale_rewards = \"none\"\n"
      "epsilon_high = 5.0\nbeta = 0.04\nnum_iterations = 2\ntemperature = 0.7\ntop_k = 20\n",
      "t.toml");
  const train::GrpoOptions o = c.grpo.options();
  EXPECT_EQ(o.loss_type, train::GrpoLossType::kCispo);
  EXPECT_EQ(o.importance_sampling_level, train::ImportanceSamplingLevel::kSequence);
  EXPECT_EQ(o.scale_rewards, train::RewardScaling::kNone);
  EXPECT_EQ(o.clip_high(), 5.0);
  EXPECT_EQ(o.beta, 0.04);
  EXPECT_EQ(o.num_iterations, 2);
  EXPECT_TRUE(parse_config(to_toml(c), "back") == c);
  EXPECT_CONTAINS(parse_error("[grpo]\nloss_type = \"ppo\"\n"),
                  "invalid value 'ppo' for 'grpo.loss_type' (line 2); allowed: grpo, dr_grpo, dapo, bnpo, cispo");
  EXPECT_CONTAINS(parse_error("[grpo]\ntop_p = 0\n"), "'grpo.top_p' (line 2) must be in (0, 1]");
  EXPECT_CONTAINS(parse_error("[grpo]\ntemperature = 0\n"), "'grpo.temperature' (line 2) must be > 0");
  EXPECT_CONTAINS(parse_error("[grpo]\nnum_generations = 1\n"), "'grpo.num_generations'");
}

// Found by fuzz_config: 300 dotted levels parse, but written back as nested inline tables they pass
// TOML's 256-level limit, so the config a resume checkpoint keeps would not parse again.
TEST(Config, DeeplyNestedTemplateKwargsAreRefusedByName) {
  std::string deep = "a";
  for (int i = 0; i < 300; ++i) deep += ".b";
  EXPECT_CONTAINS(parse_error("[data]\ntemplate_kwargs = { " + deep + " = 1 }\n"),
                  "nests tables or arrays more than 64 levels deep");
  std::string ok = "a";
  for (int i = 0; i < 60; ++i) ok += ".b";
  const RecipeConfig c = parse_config("[data]\ntemplate_kwargs = { " + ok + " = 1 }\n", "ok");
  EXPECT_TRUE(parse_config(to_toml(c), "written back") == c);
}

TEST(Config, HashIsStableAndScoped) {
  const RecipeConfig a;
  EXPECT_EQ(config_hash(a, HashScope::Full).size(), 16u);
  EXPECT_EQ(config_hash(a, HashScope::Full), config_hash(RecipeConfig{}, HashScope::Full));
  // Pinned: meta.json records it, so a change makes new checkpoints' hashes differ from older
  // ones' for the same run (resume compares the keys themselves, not the hash). New keys change
  // it (last: #26 lora.use_rslora and lora.use_dora, #27 logging.tensorboard, #37 model.untrained_tokens,
  // #38 data.split, #39 grpo.*, #52 lora.vision_targets and lora.train_projector), and so did the text's writer becoming toml++'s (#50: sorted keys,
  // its spacing; was b5f8e40528313d03 and c6ee2497b05c3864); restructuring must not.
  EXPECT_EQ(config_hash(a, HashScope::Full), "3a5b1b93d2f3dd82");
  EXPECT_EQ(config_hash(a, HashScope::Exactness), "26fdfc56df796477");
  EXPECT_EQ(config_hash(a, HashScope::Exactness), config_hash(parse_config(to_toml(a), "x"), HashScope::Exactness));
  RecipeConfig b = a;
  b.logging.log_every_steps = 10;
  b.checkpoint.resume = true;
  b.checkpoint.output_dir = "elsewhere";
  EXPECT_NE(config_hash(a, HashScope::Full), config_hash(b, HashScope::Full));
  EXPECT_EQ(config_hash(a, HashScope::Exactness), config_hash(b, HashScope::Exactness));
  b.optim.lr *= 2;
  EXPECT_NE(config_hash(a, HashScope::Exactness), config_hash(b, HashScope::Exactness));
}

// The embedded default (configs/tiny_qlora.toml): its resume checkpoints store the exactness hash,
// so the canonical text must not drift when the config code is restructured (new keys do move it;
// so did toml++ writing it, #50: was d0442749aee16735 and 276d8482e7f80a31; #52's lora.vision_targets and
// lora.train_projector: was 39754b9168ed381b and fec74012ffe3e5eb).
TEST(Config, EmbeddedDefaultHashIsPinned) {
  const RecipeConfig c = load_config((configs_dir() / "tiny_qlora.toml").string());
  EXPECT_EQ(config_hash(c, HashScope::Full), "38d4ef957f11865e");
  EXPECT_EQ(config_hash(c, HashScope::Exactness), "605c7a00d2c8629c");
}

TEST(Config, ExactnessBreakingDifferences) {
  const RecipeConfig a;
  RecipeConfig b = a;
  b.logging.progress = report::ProgressMode::Bar;
  b.checkpoint.keep_last_n = 5;
  b.checkpoint.save_every_steps = 100;
  b.checkpoint.resume = true;
  b.model.checkpoint_dir = "/moved/model";
  b.dist.collective_timeout_s = 900;
  EXPECT_TRUE(exactness_breaking_differences(a, b).empty());
  b.optim.lr = 1e-3;
  b.training.seed = 7;
  b.lora.targets.push_back("gate");
  EXPECT_EQ(exactness_breaking_differences(a, b),
            (std::vector<std::string>{"lora.targets", "optim.lr", "training.seed"}));
  // Every known key is classified, and the classification matches the hash scope.
  int exact = 0;
  for (const KeyInfo& k : known_keys()) exact += k.affects_exactness;
  EXPECT_GT(exact, 20);
  EXPECT_EQ(known_keys().size(), 89u);
}

// Every file in configs/ parses, and its first line is the command that runs it.
TEST(Config, ShippedConfigsParseAndNameTheirCommand) {
  const fs::path dir = configs_dir();
  ASSERT_TRUE(fs::is_directory(dir)) << dir << " (set QLORA_TEST_DATA=<repo>/tests/data)";
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".toml") continue;
    const std::string name = entry.path().filename().string();
    names.push_back(name);
    SCOPED_TRACE(name);
    RecipeConfig cfg;
    ASSERT_NO_THROW(cfg = load_config(entry.path().string()));

    std::ifstream in(entry.path());
    std::string first;
    std::getline(in, first);
    std::istringstream words(first);
    std::vector<std::string> argv;
    for (std::string w; words >> w;) argv.push_back(w);
    ASSERT_GE(argv.size(), 6u) << first;
    EXPECT_EQ(argv[0], "#");
    EXPECT_EQ(argv[1], "qlora");
    EXPECT_EQ(argv[2], "run");
    size_t i = 3;
    if (argv[i] == "--nproc-per-node") i += 2;  // the sharded recipe's launcher flag
    ASSERT_GT(argv.size(), i + 2) << first;
    // A DPO (GRPO) config names lora_dpo (lora_grpo) and says so in its name; every other config is
    // lora_finetune's.
    const bool dpo = name.find("_dpo") != std::string::npos, grpo = name.find("_grpo") != std::string::npos;
    EXPECT_EQ(argv[i], dpo ? "lora_dpo" : grpo ? "lora_grpo" : "lora_finetune") << first;
    if (argv[i] == "lora_dpo") EXPECT_EQ(cfg.data.format, data::DatasetKind::kPreference) << first;
    if (argv[i] == "lora_grpo") EXPECT_EQ(cfg.data.format, data::DatasetKind::kPrompt) << first;
    EXPECT_EQ(argv[i + 1], "--config") << first;
    EXPECT_EQ(argv[i + 2], "configs/" + name) << first;
    // What follows are overrides the CLI will apply: they must apply cleanly.
    for (size_t j = i + 3; j < argv.size(); ++j) EXPECT_NO_THROW(apply_override(cfg, argv[j])) << argv[j];
  }
  std::sort(names.begin(), names.end());
  for (const char* expected : {"tiny_qlora.toml", "llama2_7b_qlora_single_device.toml",
                               "llama2_7b_qlora.toml", "llama3_8b_qlora_single_device.toml",
                               "mistral_7b_qlora_single_device.toml", "tiny_qlora_dpo.toml",
                               "llama3_8b_qlora_dpo.toml", "qwen2_5_7b_qlora_dpo.toml", "tiny_qlora_grpo.toml"})
    EXPECT_TRUE(std::binary_search(names.begin(), names.end(), expected)) << expected;
}
