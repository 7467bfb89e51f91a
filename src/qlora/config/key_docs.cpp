// One line per config key of what it does, for `qlora config`. The types, defaults and longer
// notes live with the structs (config.h); the cli.help test fails on a key without a line here.
#include <string_view>
#include <utility>

#include "qlora/config/config.h"

namespace qlora::config {
namespace {

constexpr std::pair<std::string_view, std::string_view> kKeyDocs[] = {
    {"model.checkpoint_dir", "HF checkpoint directory or Hub id (org/name[@revision], from the local Hugging Face cache) of the base; empty: the embedded tiny default model"},
    {"model.name", "base_model_name_or_path the adapter records (a Hub id); empty: checkpoint_dir"},
    {"model.tokenizer", "tokenizer file; empty: the checkpoint's tokenizer.model or tokenizer.json"},
    {"model.device", "auto | cpu | cuda | cuda:N (auto: the first CUDA device, else the CPU)"},
    {"model.dtype", "compute dtype: bf16 | fp32 | auto (bf16 where the device multiplies it natively)"},
    {"model.base", "storage of the frozen projections: nf4 | bf16 | fp32"},
    {"model.activation_checkpointing", "recompute each layer's activations in backward to save memory"},
    {"model.untrained_tokens", "tokens whose embedding the base never trained: error | mean"},
    {"lora.rank", "rank of each LoRA adapter"},
    {"lora.alpha", "LoRA scale numerator (scale alpha / rank)"},
    {"lora.dropout", "dropout on the adapters' input"},
    {"lora.targets", "projections that get adapters: q, k, v, o, gate, up, down, output (qkv, gate_up); experts (a MoE layer's routed experts); shared_expert (Qwen3.5-MoE's shared expert: shared_gate, shared_up, shared_down)"},
    {"lora.use_rslora", "rank-stabilised LoRA: scale alpha / sqrt(rank)"},
    {"lora.use_dora", "DoRA: a trainable magnitude per output row of each adapted projection"},
    {"lora.vision_targets", "a vision-language checkpoint's tower linears that get adapters (short names of its encoder's: Qwen3.5 qkv, proj, linear_fc1, linear_fc2; Gemma q_proj, k_proj, v_proj, out_proj / o_proj, fc1, fc2 / gate_proj, up_proj, down_proj); empty: the tower stays frozen"},
    {"lora.train_projector", "train the multimodal projector (Qwen3.5's merger, Gemma's multi_modal_projector / embed_vision) in full, fp32, as peft's modules_to_save"},
    {"data.path", "training data: a file, a directory of split files, or a Hub data set id in the local cache; empty: the embedded tiny default data set"},
    {"data.split", "the split read from a directory or Hub data set (its files named as the Hub names splits)"},
    {"data.val_path", "validation data file of the same format"},
    {"data.val_fraction", "without val_path: this seeded fraction of path held out for validation"},
    {"data.format", "record format: instruct | chat | text | preference"},
    {"data.template", "prompt template: auto (the model's own), a named template, or none"},
    {"data.template_kwargs", "keyword arguments of the model's own template (e.g. enable_thinking)"},
    {"data.add_bos", "BOS before each sample: true | false | unset (as the tokenizer/template does)"},
    {"data.add_eos", "EOS after each sample: true | false | unset (after hand-written templates)"},
    {"data.max_seq_len", "tokens per sample (longer samples are truncated)"},
    {"data.train_on_input", "train on the prompt tokens too, not only the response"},
    {"data.packing", "pack several samples into each max_seq_len row"},
    {"data.shuffle", "shuffle samples each epoch (seeded by training.seed)"},
    {"data.instruction_field", "record field of the instruction; empty: instruction"},
    {"data.input_field", "record field of the input; empty: input"},
    {"data.output_field", "record field of the output; empty: output"},
    {"data.messages_field", "record field of the conversation; empty: messages or conversations"},
    {"data.text_field", "record field of plain text; empty: text"},
    {"optim.lr", "peak learning rate (AdamW)"},
    {"optim.weight_decay", "AdamW decoupled weight decay"},
    {"optim.betas", "AdamW betas [beta1, beta2]"},
    {"optim.eps", "AdamW epsilon"},
    {"optim.warmup_steps", "optimizer steps of linear warmup"},
    {"optim.schedule", "learning-rate schedule after warmup: cosine | constant"},
    {"optim.min_lr_ratio", "cosine floor as a fraction of lr"},
    {"optim.max_grad_norm", "clip the global gradient norm to this; <= 0: no clipping"},
    {"training.epochs", "passes over the training data"},
    {"training.batch_size", "samples per micro-batch per rank"},
    {"training.grad_accum", "micro-batches per optimizer step"},
    {"training.max_steps_per_epoch", "cap on optimizer steps per epoch; 0: no cap"},
    {"training.seed", "seed of shuffling, dropout and adapter initialisation"},
    {"training.eval_every_steps", "validation loss every N steps; 0: at each epoch end only"},
    {"training.on_nonfinite", "a step with a non-finite loss or gradient: stop | skip"},
    {"training.max_consecutive_skips", "with skip: stop after this many non-finite steps in a row"},
    {"checkpoint.output_dir", "where checkpoints, exports and metrics.jsonl go"},
    {"checkpoint.save_every_steps", "resume checkpoint every N steps; 0: at each epoch end only"},
    {"checkpoint.keep_last_n", "resume checkpoints kept"},
    {"checkpoint.adapter_only", "export only the PEFT adapter, not the merged model"},
    {"checkpoint.merge_from", "weights the merged export starts from: nf4 (what trained) | original (full precision)"},
    {"checkpoint.resume", "continue from the latest resume checkpoint in output_dir"},
    {"checkpoint.gguf", "GGUF types written beside each epoch's merged export, e.g. [\"q4_k_m\"]"},
    {"logging.log_every_steps", "a metrics line every N steps"},
    {"logging.progress", "progress display: auto | bar | plain"},
    {"logging.tensorboard", "TensorBoard event files in output_dir/tb"},
    {"dist.shard_size", "ranks the base is sharded over; 0: the world size"},
    {"dist.collective_timeout_s", "seconds a collective waits for its peers before failing"},
    {"dist.reshard_after_forward", "free each layer's gathered NF4 after forward, gather again for backward"},
    {"dist.prefetch", "gather the next layer while this one computes"},
    {"dist.reduce_scatter_every_micro_batch", "reduce-scatter gradients after every micro-batch"},
    {"dpo.loss", "preference loss (lora_dpo): sigmoid | ipo | hinge | orpo | simpo"},
    {"dpo.beta", "preference loss temperature"},
    {"dpo.label_smoothing", "sigmoid, simpo: label smoothing in [0, 0.5)"},
    {"dpo.simpo_gamma", "SimPO target reward margin"},
    {"dpo.precompute_reference", "reference log-probabilities computed once before training"},
    {"dpo.max_prompt_len", "prompt tokens kept of an over-long pair; 0: half of data.max_seq_len"},
    {"grpo.rewards", "built-in rewards (lora_grpo), summed with weights: answer | regex | length"},
    {"grpo.reward_command", "a program (run by /bin/sh) reading JSONL completions, writing one reward per line"},
    {"grpo.reward_command_weight", "weight of reward_command's reward in the sum"},
    {"grpo.reward_timeout_s", "seconds reward_command may take per batch before it is killed"},
    {"grpo.num_generations", "completions sampled per prompt (the group its advantages compare)"},
    {"grpo.max_completion_length", "new tokens per completion at most (then truncated)"},
    {"grpo.temperature", "sampling temperature of the rollouts"},
    {"grpo.top_p", "nucleus sampling: the smallest set of tokens with this much probability"},
    {"grpo.top_k", "sample among the k likeliest tokens; 0: all"},
    {"grpo.loss_type", "objective normalisation as TRL names it: grpo | dr_grpo | dapo | bnpo | cispo"},
    {"grpo.importance_sampling_level", "importance ratio per token, or per sequence (GSPO): token | sequence"},
    {"grpo.scale_rewards", "advantages divided by the reward std of the group | batch | none"},
    {"grpo.epsilon", "lower clip of the importance ratio (1 - epsilon)"},
    {"grpo.epsilon_high", "upper clip (1 + epsilon_high; cispo: its cap); 0: epsilon"},
    {"grpo.beta", "weight of the KL to the reference (adapters off); 0: no reference pass"},
    {"grpo.num_iterations", "policy updates per batch of rollouts (> 1: against the old policy's log-probs)"},
    {"grpo.mask_truncated_completions", "leave completions cut by max_completion_length out of the loss"},
    {"grpo.use_bias_correction_kl", "weight the KL term by the importance ratio (TRL 1.16's default)"},
};

}  // namespace

std::string_view key_description(std::string_view key) {
  for (const auto& [k, doc] : kKeyDocs)
    if (k == key) return doc;
  return {};
}

}  // namespace qlora::config
