// The three recipes, each a readable file over the session they share (session.h): what `qlora run
// NAME` runs (cli/cli.cpp), in one process or as one of N ranks.
#pragma once

#include "recipes/recipe_config.h"

namespace qlora::recipes {

int lora_finetune_main(const ConfigArgs& a);  // lora_finetune.cpp
int lora_dpo_main(const ConfigArgs& a);       // lora_dpo.cpp: DPO, IPO, hinge, ORPO, SimPO
int lora_grpo_main(const ConfigArgs& a);      // lora_grpo.cpp: GRPO family

}  // namespace qlora::recipes
