"""Tiny random models of each family issue #11 adds, as transformers builds them.

Every case: vocab 128, fp32, random norm weights and biases (_common.randomize_norms). Dimensions make
every decoder projection's numel a multiple of 64 * 256 (torchao's to_nf4). Sliding windows are 8 and
the test sequences 20 long, so each windowed layer drops keys that full causal attention would keep.

A case's `ablations` are variants of the same weights with one feature switched off (config
overrides, or an edit of the parameters); the tests check that each one moves the reference
logits by far more than the tolerance, so the case really exercises that feature and a forward that
skips it cannot pass.
"""
import os

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                          Gemma3ForConditionalGeneration, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                          Olmo3Config, Olmo3ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                          Qwen3_5TextConfig, SmolLM3Config, SmolLM3ForCausalLM, Gemma4TextConfig, Gemma4ForCausalLM,
                          Gemma4Config, Gemma4ForConditionalGeneration, MixtralConfig, MixtralForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, GptOssConfig, GptOssForCausalLM)

from _common import randomize_norms

WINDOW = 8
SEQ = 20  # > WINDOW
COMMON = dict(vocab_size=128, max_position_embeddings=128, initializer_range=0.1, num_hidden_layers=2,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
# q [256, 256] or [512, 256], k/v [128, 256] or [64, 256], MLP [512, 256]: all multiples of 16384.
GQA = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # as peft names Phi-3's modules
# Gemma: head_dim 64 with 4 heads, query_pre_attn_scalar 32 != head_dim (scale 32^-0.5, not 64^-0.5).
GEMMA = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             query_pre_attn_scalar=32, sliding_window=WINDOW)
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
GEMMA3_ROPE_LINEAR = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                      "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
# OLMo 3: YaRN on the full layers (factor 4 over an original context of 32: at the test's 20
# positions the blend moves the low frequencies and the attention factor 1 + 0.1 ln 4 scales q.k),
# the base RoPE on the sliding ones.
OLMO3_ROPE = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                 "rope_theta": 10000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
OLMO3_PLAIN_ROPE = {k: {"rope_type": "default", "rope_theta": 10000.0} for k in OLMO3_ROPE}
# Qwen3.5: layers 0-2 Gated DeltaNet, layer 3 full attention (the class's every-fourth rule). 64 value
# heads of 8 (each of the 4 key heads of 32 serves 16) make in_proj_b/a [64, 256] whole NF4 blocks;
# in_proj_qkv [768, 256], in_proj_z [512, 256], out_proj [256, 512]; q_proj [512, 256] holds each
# head's query and gate; rotary on 16 of head_dim 64.
QWEN35 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              num_hidden_layers=4, linear_num_key_heads=4, linear_key_head_dim=32, linear_num_value_heads=64,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False)
# The Hub's form: Qwen3_5ForConditionalGeneration, the same language model beside a tiny vision tower
# (its weights are only copied; the text logits must be the language model's).
QWEN35_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256,
                     patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


def qwen35_multimodal_config(**kw):
    tie = kw.pop("tie_word_embeddings", False)
    return Qwen3_5Config(text_config=kw, vision_config=QWEN35_VISION, tie_word_embeddings=tie)


def qwen35_moe_multimodal_config(**kw):
    tie = kw.pop("tie_word_embeddings", False)
    return Qwen3_5MoeConfig(text_config=kw, vision_config=QWEN35_VISION, tie_word_embeddings=tie)


# Gemma 4: sliding layers head_dim 64 with 2 kv heads, full layers global_head_dim 128 with 1 kv head
# whose values are its keys (attention_k_eq_v) and proportional RoPE on a quarter of it; the last two
# layers (3 sliding, 4 full: the class makes the last layer full) reuse the K/V of layers 2 and 1 and
# have double-wide MLPs [1024, 256]; per-layer inputs of 64 a layer (gate [64, 256], projection
# [256, 64]); a final soft-cap. Every projection's numel is a multiple of 16384.
GEMMA4 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                           "full_attention"],
              sliding_window=WINDOW, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=64,
              vocab_size_per_layer_input=128, final_logit_softcapping=3.0, tie_word_embeddings=False)
GEMMA4_TARGETS = LLAMA_TARGETS + ["per_layer_input_gate", "per_layer_projection"]
GEMMA4_PLAIN_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
# The Hub's form: Gemma4ForConditionalGeneration with a tiny vision tower (copied, never computed).
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)


def gemma4_multimodal_config(**kw):
    tie = kw.pop("tie_word_embeddings", True)
    return Gemma4Config(text_config=kw, vision_config=GEMMA4_VISION, audio_config=None, tie_word_embeddings=tie)


# The Hub's Gemma 3 (4B and up): Gemma3ForConditionalGeneration, a SigLIP tower of 8 x 8 patches (image_size
# 32, patch 4) whose projector average-pools them to mm_tokens_per_image 16 (4 x 4, kernel 2).
GEMMA3_VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, image_size=32, patch_size=4, vision_use_head=False)
GEMMA3_MM_TOKENS = 16


def gemma3_multimodal_config(**kw):
    tie = kw.pop("tie_word_embeddings", True)
    return Gemma3Config(text_config=kw, vision_config=GEMMA3_VISION, mm_tokens_per_image=GEMMA3_MM_TOKENS,
                        tie_word_embeddings=tie)


def _layer_scalar_one(model):
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.fill_(1.0)


# Mixture of Experts: 8 experts of width 64, 2 a token (each expert's gate_up [128, 256] and down
# [256, 64] are whole NF4 scaler groups). Qwen3-MoE: 3 layers, layer 1 dense (mlp_only_layers, an MLP of
# 512), top-k not renormalised (the class default); Mixtral: every layer MoE, renormalised, fp32 weights,
# a sliding window. transformers writes one tensor per expert; FUSED_CASES also run from the fused form.
MOE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_experts_per_tok=2)
QWEN3_MOE = dict(**MOE, head_dim=32, intermediate_size=512, num_experts=8, moe_intermediate_size=64,
                 num_hidden_layers=3, mlp_only_layers=[1], tie_word_embeddings=False)
MIXTRAL = dict(**MOE, intermediate_size=64, num_local_experts=8, sliding_window=WINDOW, tie_word_embeddings=False)
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
# Qwen3.5-MoE: Qwen3.5's tiny hybrid cut to 2 layers (layer 0 Gated DeltaNet, layer 1 full attention),
# every layer MoE (always renormalised) beside a shared expert of 128 ([128, 256], [256, 128]) scaled by
# sigmoid(shared_expert_gate [1, 256]).
QWEN35_MOE = dict({k: v for k, v in QWEN35.items() if k != "intermediate_size"}, num_hidden_layers=2,
                  layer_types=["linear_attention", "full_attention"], num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=64, shared_expert_intermediate_size=128)
FUSED_CASES = ["qwen3_moe", "mixtral", "qwen3_5_moe", "qwen3_5_moe_vision"]
# Gemma 4's MoE form (26B-A4B, enable_moe_block): GEMMA4's attention (sliding head_dim 64, full layers of
# global_head_dim 128 under attention_k_eq_v) in 3 layers, the last full, without per-layer inputs or KV
# sharing (the 26B has neither), and in every layer beside the MLP of 512 a router over 8 experts of
# width 64, top-2, gelu-tanh experts; the router's scale and per_expert_scale and the MoE norms random
# (randomize_norms). transformers writes the experts fused (no conversion mapping for gemma4).
GEMMA4_MOE = {**GEMMA4, "num_hidden_layers": 3, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
              "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
              "moe_intermediate_size": 64}
GEMMA4_MOE_TARGETS = LLAMA_TARGETS + ["experts"]


def _experts_silu(model):
    """Gemma 4's experts with SiLU instead of the model's gelu-tanh (its MLP keeps gelu-tanh)."""
    for m in model.modules():
        if type(m).__name__ == "Gemma4TextExperts":
            m.act_fn = torch.nn.SiLU()


# gpt-oss: 2 layers (sliding, then full), q/k/v/o biases, a sink per head, the router's and the experts'
# biases (randomize_norms draws them all), YaRN over a short original context (factor 4 over 32, truncate
# false as gpt-oss has it, so the ramp's ends are fractional), the clamp at 1 (at the class's 7 random
# activations of O(1) would never reach it). transformers holds and writes the experts fused, transposed,
# gate and up interleaved.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}
GPT_OSS = dict(**MOE, head_dim=32, intermediate_size=64, num_local_experts=8, sliding_window=WINDOW,
               rope_parameters=GPT_OSS_ROPE, swiglu_limit=1.0, tie_word_embeddings=False)


def _router_uniform(model):
    """Every router row equal: each token's top-k are experts 0..k-1 with equal weights."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.copy_(p[:1].expand_as(p))


def _gate_up_halves(model):
    """gpt-oss's experts read as if gate and up were halves, not interleaved (a loader that forgot it)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("experts.gate_up_proj") or n.endswith("experts.gate_up_proj_bias"):
                p.copy_(torch.cat([p[..., ::2], p[..., 1::2]], -1))


# OCP Microscaling MXFP4, as gpt-oss's Hub checkpoints store their experts: E2M1 elements (a nibble each, the
# low one first) in groups of 32 sharing an E8M0 scale 2^(s - 127).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_pack(w):
    """w [..., out, in] -> (blocks [..., out, in / 32, 16], scales [..., out, in / 32]) uint8, as the OCP spec
    quantizes: the shared exponent floor(log2 amax) - 2 (E2M1's largest exponent), each element the nearest
    E2M1 value of w / 2^e (saturating at 6)."""
    g = w.detach().reshape(*w.shape[:-1], -1, 32).double()
    e = torch.floor(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126))) - 2
    x = g / torch.exp2(e)
    code = (x.abs().unsqueeze(-1) - E2M1[:8].double()).abs().argmin(-1) + 8 * (x < 0).long()
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), (e.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_unpack(blocks, scales):
    """The OCP decode of mxfp4_pack's output: [..., out, in] float32."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-2).long()  # [..., groups, 32]
    w = E2M1[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return w.flatten(-2)


def save_mxfp4(model, directory):
    """A gpt-oss checkpoint as the Hub ships one: the experts' gate_up_proj / down_proj as MXFP4 *_blocks /
    *_scales of their [E, out, in] matrices (transformers' [E, in, out] transposed), a quantization_config."""
    from safetensors.torch import load_file, save_file
    import json
    model.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    sd = load_file(path)
    for k in [k for k in sd if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")]:
        sd[k + "_blocks"], sd[k + "_scales"] = mxfp4_pack(sd.pop(k).transpose(1, 2))
    save_file(sd, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def load_mxfp4(directory):
    """transformers' own reading of save_mxfp4's checkpoint: dequantized on the CPU (Mxfp4Config(dequantize=True))."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=Mxfp4Config(dequantize=True),
                                                dtype=torch.float32, attn_implementation="eager").eval()


QWEN35_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                  "out_proj", "gate_proj", "up_proj", "down_proj"]
QWEN35_MOE_TARGETS = QWEN35_TARGETS[:-3] + ["experts", "shared_expert.gate_proj", "shared_expert.up_proj",
                                            "shared_expert.down_proj"]


def _set(suffix, value):
    """A parameter edit for an ablation: every parameter whose name ends with suffix := value."""
    def edit(model):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(suffix):
                    p.fill_(value)
    return edit


def _case(cfg_cls, model_cls, kw, targets=LLAMA_TARGETS, attn="sdpa", ablations=()):
    return dict(cfg_cls=cfg_cls, model_cls=model_cls, kw=kw, targets=targets, attn=attn, ablations=list(ablations))


CASES = {
    # The control: a family that loads today, so the packed, KV-cache and generate paths of the tools
    # are known to pass where the forward is right.
    "llama": _case(LlamaConfig, LlamaForCausalLM, dict(**GQA, tie_word_embeddings=False)),
    "qwen2_untied": _case(Qwen2Config, Qwen2ForCausalLM, dict(**GQA, tie_word_embeddings=False),
                          ablations=[("no q/k/v bias", {}, _set("_proj.bias", 0.0))]),
    "qwen2_tied": _case(Qwen2Config, Qwen2ForCausalLM, dict(**GQA, tie_word_embeddings=True),
                        ablations=[("no q/k/v bias", {}, _set("_proj.bias", 0.0))]),
    # head_dim 64 with 8 heads: q is [512, 256], wider than hidden.
    "qwen3": _case(Qwen3Config, Qwen3ForCausalLM, dict(**GQA, head_dim=64, tie_word_embeddings=False),
                   ablations=[("q/k norm weights 1", {}, lambda m: (_set("q_norm.weight", 1.0)(m),
                                                                    _set("k_norm.weight", 1.0)(m)))]),
    # Caps small enough to bend random logits of O(1..10); eager: transformers' SDPA path has no
    # attention soft-capping, eager is the definition.
    "gemma2": _case(Gemma2Config, Gemma2ForCausalLM,
                    dict(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0), attn="eager",
                    ablations=[("no attention softcap", {"attn_logit_softcapping": None}, None),
                               ("no final softcap", {"final_logit_softcapping": None}, None),
                               ("no sliding window", {"sliding_window": 4 * SEQ}, None),
                               ("query_pre_attn_scalar = head_dim", {"query_pre_attn_scalar": 64}, None)]),
    "gemma3": _case(Gemma3TextConfig, Gemma3ForCausalLM,
                    dict(**GEMMA, num_hidden_layers=3, layer_types=GEMMA3_LAYERS, rope_parameters=GEMMA3_ROPE),
                    attn="eager",
                    ablations=[("no sliding window", {"sliding_window": 4 * SEQ}, None),
                               ("one RoPE base", {"rope_parameters": {
                                   k: {"rope_type": "default", "rope_theta": 10000.0} for k in GEMMA3_ROPE}}, None),
                               ("q/k norm weights 0 (scale 1)", {}, lambda m: (_set("q_norm.weight", 0.0)(m),
                                                                               _set("k_norm.weight", 0.0)(m)))]),
    "gemma3_linear": _case(Gemma3TextConfig, Gemma3ForCausalLM,
                           dict(**GEMMA, num_hidden_layers=3, layer_types=GEMMA3_LAYERS,
                                rope_parameters=GEMMA3_ROPE_LINEAR),
                           attn="eager",
                           ablations=[("no linear scaling", {"rope_parameters": GEMMA3_ROPE}, None)]),
    "mistral_sliding": _case(MistralConfig, MistralForCausalLM,
                             dict(**GQA, sliding_window=WINDOW, tie_word_embeddings=False),
                             ablations=[("no sliding window", {"sliding_window": None}, None)]),
    # qkv_proj [384, 256], gate_up_proj [1024, 256].
    "phi3": _case(Phi3Config, Phi3ForCausalLM, dict(**GQA, sliding_window=WINDOW, tie_word_embeddings=False),
                  targets=PHI3_TARGETS,
                  ablations=[("no sliding window", {"sliding_window": None}, None)]),
    # 4 layers: the class's default NoPE pattern leaves RoPE out of layer 3 (every fourth), as
    # SmolLM3-3B does and llama.cpp's smollm3 assumes; save_pretrained writes it as no_rope_layers.
    "smollm3": _case(SmolLM3Config, SmolLM3ForCausalLM, dict(**GQA, num_hidden_layers=4, tie_word_embeddings=False),
                     ablations=[("RoPE on every layer", {"no_rope_layer_interval": 1000}, None)]),
    # No input norms: post-norms close each branch; q/k norms over all heads.
    "olmo2": _case(Olmo2Config, Olmo2ForCausalLM, dict(**GQA, tie_word_embeddings=False),
                   ablations=[("q/k norm weights 1", {}, lambda m: (_set("q_norm.weight", 1.0)(m),
                                                                    _set("k_norm.weight", 1.0)(m)))]),
    # 4 layers: the class's default layer types slide on layers 0-2, layer 3 is full.
    "olmo3": _case(Olmo3Config, Olmo3ForCausalLM,
                   dict(**GQA, num_hidden_layers=4, sliding_window=WINDOW, rope_parameters=OLMO3_ROPE,
                        tie_word_embeddings=False),
                   ablations=[("no sliding window", {"sliding_window": 4 * SEQ}, None),
                              ("no YaRN", {"rope_parameters": OLMO3_PLAIN_ROPE}, None)]),
    "qwen3_5": _case(Qwen3_5TextConfig, Qwen3_5ForCausalLM, QWEN35, targets=QWEN35_TARGETS,
                     ablations=[("no decay (A_log -30)", {}, _set("A_log", -30.0)),
                                ("dt_bias 0", {}, _set("dt_bias", 0.0)),
                                ("conv taps 1/4", {}, _set("conv1d.weight", 0.25)),
                                ("rotary over all of head_dim", {"partial_rotary_factor": 1.0}, None)]),
    "qwen3_5_vision": _case(qwen35_multimodal_config, Qwen3_5ForConditionalGeneration, QWEN35, targets=QWEN35_TARGETS,
                            ablations=[("no decay (A_log -30)", {}, _set("A_log", -30.0))]),
    "gemma4": _case(Gemma4TextConfig, Gemma4ForCausalLM, GEMMA4, targets=GEMMA4_TARGETS, attn="eager",
                    ablations=[("no sliding window", {"sliding_window": 4 * SEQ}, None),
                               ("default RoPE on full layers", {"rope_parameters": GEMMA4_PLAIN_ROPE}, None),
                               ("per-layer projection 0", {}, _set("per_layer_projection.weight", 0.0)),
                               ("per-layer table 0", {}, _set("embed_tokens_per_layer.weight", 0.0)),
                               ("layer_scalar 1", {}, _layer_scalar_one),
                               ("q norm weights 1", {}, _set("q_norm.weight", 1.0)),
                               ("no final softcap", {"final_logit_softcapping": None}, None)]),
    "gemma4_vision": _case(gemma4_multimodal_config, Gemma4ForConditionalGeneration,
                           {**GEMMA4, "tie_word_embeddings": True}, targets=GEMMA4_TARGETS, attn="eager",
                           ablations=[("per-layer projection 0", {}, _set("per_layer_projection.weight", 0.0))]),
    "qwen3_moe": _case(Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_MOE, targets=MOE_TARGETS,
                       ablations=[("top-k renormalised", {"norm_topk_prob": True}, None),
                                  ("router rows equal", {}, _router_uniform),
                                  ("q/k norm weights 1", {}, lambda m: (_set("q_norm.weight", 1.0)(m),
                                                                        _set("k_norm.weight", 1.0)(m)))]),
    "mixtral": _case(MixtralConfig, MixtralForCausalLM, MIXTRAL, targets=MOE_TARGETS,
                     ablations=[("one expert a token", {"num_experts_per_tok": 1}, None),
                                ("router rows equal", {}, _router_uniform),
                                ("no sliding window", {"sliding_window": None}, None)]),
    "qwen3_5_moe": _case(Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, QWEN35_MOE, targets=QWEN35_MOE_TARGETS,
                         ablations=[("no shared expert (its down_proj 0)", {}, _set("shared_expert.down_proj.weight", 0.0)),
                                    ("shared expert gate 0 (sigmoid 1/2)", {}, _set("shared_expert_gate.weight", 0.0)),
                                    ("router rows equal", {}, _router_uniform),
                                    ("one expert a token", {"num_experts_per_tok": 1}, None),
                                    ("no decay (A_log -30)", {}, _set("A_log", -30.0))]),
    # The Hub's form: Qwen3_5MoeForConditionalGeneration (model.language_model.*, the tower copied).
    "qwen3_5_moe_vision": _case(qwen35_moe_multimodal_config, Qwen3_5MoeForConditionalGeneration, QWEN35_MOE,
                                targets=QWEN35_MOE_TARGETS,
                                ablations=[("shared expert gate 0 (sigmoid 1/2)", {}, _set("shared_expert_gate.weight", 0.0))]),
    "gemma4_moe": _case(Gemma4TextConfig, Gemma4ForCausalLM, GEMMA4_MOE, targets=GEMMA4_MOE_TARGETS, attn="eager",
                        ablations=[("router scale 1", {}, _set("router.scale", 1.0)),
                                   ("per_expert_scale 1", {}, _set("router.per_expert_scale", 1.0)),
                                   ("pre_feedforward_layernorm_2 weights 1", {},
                                    _set("pre_feedforward_layernorm_2.weight", 1.0)),
                                   ("post_feedforward_layernorm_1 weights 1", {},
                                    _set("post_feedforward_layernorm_1.weight", 1.0)),
                                   ("post_feedforward_layernorm_2 weights 1", {},
                                    _set("post_feedforward_layernorm_2.weight", 1.0)),
                                   ("experts' activation SiLU", {}, _experts_silu),
                                   ("one expert a token", {"top_k_experts": 1}, None)]),
    "gpt_oss": _case(GptOssConfig, GptOssForCausalLM, GPT_OSS, targets=MOE_TARGETS, attn="eager",
                     ablations=[("no sinks (-30)", {}, _set("self_attn.sinks", -30.0)),
                                ("no attention biases", {}, _set("_proj.bias", 0.0)),
                                ("no router bias", {}, _set("router.bias", 0.0)),
                                ("no expert biases", {}, lambda m: (_set("gate_up_proj_bias", 0.0)(m),
                                                                    _set("down_proj_bias", 0.0)(m))),
                                ("no clamp (limit 1e4)", {"swiglu_limit": 1e4}, None),
                                ("gate/up as halves, not interleaved", {}, _gate_up_halves),
                                ("no sliding window", {"sliding_window": 4 * SEQ}, None),
                                ("no YaRN", {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}, None),
                                ("YaRN truncated", {"rope_parameters": {**GPT_OSS_ROPE, "truncate": True}}, None)]),
}


# The MoE cases whose transformers save holds fused 3-D experts (no conversion mapping): they also run
# from a checkpoint with one tensor per expert and projection (save_split_experts), the other layout.
SPLIT_CASES = ["gemma4_moe"]


def save_split_experts(model, directory):
    """save_pretrained with each layer's fused experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I]
    written as experts.<e>.gate_proj / up_proj / down_proj.weight ([I, H], [I, H], [H, I]); returns the
    number of per-expert tensors."""
    import os
    from safetensors.torch import load_file, save_file
    model.save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    tensors, split = load_file(path), {}
    for k, v in tensors.items():
        for param, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            if k.endswith(".experts." + param):
                stem = k[: -len(param)]
                for e in range(v.shape[0]):
                    for part, w in zip(parts, v[e].chunk(len(parts))):
                        split[f"{stem}{e}.{part}.weight"] = w.contiguous()
                break
        else:
            split[k] = v
    save_file(split, path, metadata={"format": "pt"})
    return sum(1 for k in split if ".experts." in k)


def config(name, **overrides):
    c = CASES[name]
    kw = {**COMMON, **c["kw"], **overrides}
    return c["cfg_cls"](**kw)


def build(name, seed, **overrides):
    """The case's model (fp32, eval) with seeded weights, random norms and biases."""
    c = CASES[name]
    torch.manual_seed(seed)
    cfg = config(name, **overrides)
    cfg._attn_implementation = c["attn"]
    model = c["model_cls"](cfg).to(torch.float32).eval()
    randomize_norms(model, seed)
    return model


def ablated(name, model, overrides, edit):
    """The same weights as `model` with the ablation's config overrides and parameter edit."""
    c = CASES[name]
    cfg = config(name, **overrides)
    cfg._attn_implementation = c["attn"]
    other = c["model_cls"](cfg).to(torch.float32).eval()
    other.load_state_dict(model.state_dict())
    if edit is not None:
        edit(other)
    return other
