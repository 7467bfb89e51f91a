// grpo.reward_command: a user's program scores completions. It runs as `/bin/sh -c COMMAND` (so
// "python3 score.py --strict" works), once per batch of completions, and reads on stdin one JSON
// object a line per completion: the prompt record's fields ("prompt" and the others, e.g.
// "answer") with "completion" (the decoded text) and "completion_tokens" added. It writes one
// number per line on stdout, in the same order; other output belongs on stderr.
// A program that exits non-zero or dies by a signal (its stderr's end quoted), outlives
// grpo.reward_timeout_s (then killed with its process group), writes fewer or more lines than it
// got, or writes a line that is not a finite number is a std::runtime_error naming the command and
// what went wrong (the line number, from 1). The step that asked fails before it changes anything,
// so the last checkpoint stays as it was.
#pragma once

#include <string>
#include <vector>

#include "qlora/train/rewards.h"

namespace qlora::train {

// The stdin text: one line per input.
std::string reward_command_input(const std::vector<RewardInput>& inputs);

// Runs `command` on the inputs; one value per input.
std::vector<double> run_reward_command(const std::string& command, const std::vector<RewardInput>& inputs,
                                       double timeout_s);

}  // namespace qlora::train
