// The families qlora loads, in one table: a family is its file in this folder and its line here.
// The order is the order of messages ("supported: llama, mistral, qwen2, ...").
#include <vector>

#include "qlora/models/family.h"

namespace qlora::models {

const Family& llama_family();
const Family& qwen2_family();
const Family& qwen3_family();
const Family& gemma2_family();
const Family& gemma3_family();
const Family& phi3_family();
const Family& smollm3_family();
const Family& olmo2_family();
const Family& olmo3_family();
const Family& qwen3_5_family();
const Family& gemma4_family();
const Family& qwen3_moe_family();
const Family& mixtral_family();
const Family& qwen3_5_moe_family();
const Family& gpt_oss_family();

const std::vector<const Family*>& all_families() {
  static const std::vector<const Family*> families = {
      &llama_family(),   &qwen2_family(),   &qwen3_family(), &gemma2_family(),  &gemma3_family(), &phi3_family(),
      &smollm3_family(), &olmo2_family(),   &olmo3_family(), &qwen3_5_family(), &gemma4_family(), &qwen3_moe_family(), &mixtral_family(),
      &qwen3_5_moe_family(),
      &gpt_oss_family(),
  };
  return families;
}

const Family& default_family() { return llama_family(); }

}  // namespace qlora::models
