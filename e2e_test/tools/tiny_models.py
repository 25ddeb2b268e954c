"""Tiny random-weight MoE checkpoints for serving tests that need a MoE architecture (AFD).

`build_tiny_moe("deepseek_v2", out, tokenizer_dir)` writes a Hugging Face folder with a
DeepseekV2ForCausalLM of 4 layers and random weights (deterministic for a seed), bfloat16
safetensors, the tokenizer files of `tokenizer_dir` (SmolLM2's here) and a marker JSON.

Why DeepSeek-V2: the vLLM afd-plugin adapts only the DeepSeek family (afd_plugin/__init__.py
_DEEPSEEK_MODEL_REGISTRATIONS: DeepseekForCausalLM, DeepseekV2/V3/V32ForCausalLM,
GlmMoeDsaForCausalLM -> afd_plugin/model_executor/models/deepseek_v2.py); Qwen3-MoE has no AFD
wrapper. Among those, DeepSeek-V2 (the Lite shape) is what the plugin's GPU recipes and e2e
tests run (recipe/gpu/P2pNcclAFDConnector/deepseek_v2_lite) and what the harness registry
allows for AFD (deepseek-ai/DeepSeek-V2-Lite), and transformers has it natively (no remote
code).

Dimensions: everything the attention kernels see is DeepSeek-V2-Lite's (16 heads, MLA with
kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, no q LoRA), so
whatever MLA backend vLLM picks for Lite on the GPU (FlashMLA / FA3-MLA) takes this model too.
Only what the MLA kernels do not constrain is shrunk: 4 layers (layer 0 dense, like Lite's
first_k_dense_replace 1, so the FFN role runs both a dense MLP and MoE layers), hidden 1024
(a multiple of 128), 8 routed experts (divisible by expert-parallel sizes 1, 2, 4, 8), top-2,
1 shared expert, moe_intermediate_size 256 (a multiple of 64), dense intermediate 2048,
greedy softmax routing with n_group = topk_group = 1 written explicitly (vLLM reads
getattr(config, "n_group", 1) and transformers stores None), 4096 positions (the registry's
max_model_len for DeepSeek-V2-Lite), plain RoPE.

Random weights make greedy text meaningless; two deliberate edits keep it usable for serving
tests: the lm_head rows of special tokens (EOS included) and of whitespace-only tokens are
zero, so their logit is 0 while the best random logit over ~49k tokens is positive: greedy
decoding never stops early and never returns empty or whitespace-only text, and every request
runs to max_tokens (a predictable number of engine steps).

Tiny vision-language model (`build_tiny_vlm(out, tokenizer_dir)`, family "qwen3_5_vl"): a
Qwen3_5ForConditionalGeneration (model_type "qwen3_5") with random bfloat16 weights, for the
TokenSpeed EPD plumbing tests (encode / prefill / decode disaggregation behind smg).

Why Qwen3.5: it is TokenSpeed 0.1.0's smallest vision architecture. Its model registry has
Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration, KimiK25 and the Qwen3
omni/audio/ASR models, but no Qwen2-VL or Qwen3-VL; and smg's multimodal registry matches
model_type "qwen3_5" (and "qwen3_5_moe") to its Qwen3-VL preprocessing (patch 16, spatial merge
2, temporal patch 2), reading image_token_id / video_token_id / vision_start_token_id /
vision_end_token_id from config.json and mapping them back to strings through the tokenizer.
transformers has the architecture natively (no remote code; 5.x).

Dimensions (QWEN3_5_VL_TINY): text model of 4 layers, by default all full attention
(`attention="full"`, see vlm_dims: TokenSpeed's PyPI scheduler refuses PD/EPD with GDN state
layers); `attention="hybrid"` gives 3 Gated-DeltaNet linear-attention layers and 1
full-attention layer (the real 3:1 interleave, full_attention_interval 4); hidden 256,
MLP 512; the per-head geometry the kernels see is the real model's: full attention head_dim 256
with the output gate and partial rotary 0.25 (rotary dim 64 = 2 * sum(mrope_section
[11, 11, 10]), interleaved M-RoPE), 2 query heads / 1 KV head; GDN key/value head dims 128 with
2 key / 4 value heads, conv kernel 4; 32768 positions. Vision tower of depth 2, width 128,
2 heads (head_dim 64), patch 16, merge 2, temporal patch 2, the real 48x48 learned
position-embedding grid, no deepstack, out_hidden_size = the text hidden size (256). The
vocabulary is SmolLM2's (~49k) plus the five Qwen vision tokens <|vision_start|>
<|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> (single added special tokens),
padded to a multiple of 64. The chat template is ChatML (SmolLM2's), rendering an image part
(OpenAI image_url or HF image) as <|vision_start|><|image_pad|><|vision_end|>; smg / the HF
processor expand the one <|image_pad|> to grid_t*grid_h*grid_w/merge^2 copies.
preprocessor_config.json / video_preprocessor_config.json carry Qwen3-VL's processing with
longest_edge lowered to 512x512 pixels (at most 256 image tokens per image). About 17M
parameters, ~37 MB on disk with the tokenizer (the tied 49k x 256 embedding is 25 MB of it).

Random weights: greedy text is meaningless, and the same suppression as the MoE builder keeps
requests running to max_tokens, with one difference. The word embedding is tied
(tie_word_embeddings true, like the small released Qwen3.5 checkpoints; an untied lm_head
would add 25 MB), so an lm_head row IS the input embedding of that token, and the suppressed
tokens include ones every prompt contains (<|im_start|>, <|im_end|>, newline,
<|vision_start|>, <|vision_end|>). Zeroing them would zero those inputs; instead their rows
are scaled by SUPPRESS_SCALE (1/8): as inputs they are still non-zero random vectors (the first
RMSNorm restores their scale), while as outputs their logit is at most |h| * |row| ~ 0.6
(h: the final RMSNorm's output, RMS 1) against a best random logit over ~49k rows of about
1.4, so greedy decoding never emits them: no EOS, no empty or whitespace-only text. The
padding rows past the tokenizer's vocabulary are zero (they are never inputs, and must never be
emitted). <|image_pad|> positions are replaced by the vision tower's embeddings anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from ..infra.errors import ConfigError

MARKER = ".e2e_tiny_moe.json"
VLM_MARKER = ".e2e_tiny_vlm.json"
FAMILIES = ("deepseek_v2",)
VLM_FAMILY = "qwen3_5_vl"
# Files of a tokenizer folder (never the model's own config/weights).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "chat_template.jinja", "chat_template.json")

DEEPSEEK_V2_TINY = {
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def tiny_dims(family: str) -> dict:
    if family not in FAMILIES:
        raise ConfigError(f"tiny MoE family {family!r}: only {', '.join(FAMILIES)} (the vLLM "
                          "afd-plugin adapts the DeepSeek family only)")
    return dict(DEEPSEEK_V2_TINY)


def _tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    return [tokenizer_dir / n for n in _TOKENIZER_FILES if (tokenizer_dir / n).is_file()]


def _tokenizer_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def suppressed_ids(tok) -> list[int]:
    """Special/added tokens and tokens that decode to whitespace only."""
    ids = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    vocab = len(tok)
    texts = tok.batch_decode([[i] for i in range(vocab)])
    ids |= {i for i, t in enumerate(texts) if not t.strip()}
    return sorted(i for i in ids if 0 <= i < vocab)


def read_marker(out_dir: Path | str, marker: str = MARKER) -> dict | None:
    try:
        return json.loads((Path(out_dir) / marker).read_text())
    except (OSError, ValueError):
        return None


def _checked_tokenizer(tok_dir: Path) -> list[Path]:
    tok_files = _tokenizer_files(tok_dir)
    if not tok_dir.is_dir() or not any(f.name in ("tokenizer.json", "tokenizer_config.json",
                                                  "vocab.json") for f in tok_files):
        raise ConfigError(f"tokenizer folder {tok_dir}: no tokenizer files (tokenizer.json / "
                          "tokenizer_config.json)")
    return tok_files


def _versions() -> dict:
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _save_bf16(model, out: Path) -> tuple[Path, int]:
    """Save `model` in bfloat16 safetensors to a fresh temporary sibling of `out`."""
    import torch
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    n_params = sum(p.numel() for p in model.parameters())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    return tmp, n_params


def _publish(tmp: Path, out: Path, marker_name: str, marker: dict) -> None:
    """Write the marker into the finished temporary folder, then put it in place of `out`."""
    (tmp / marker_name).write_text(json.dumps(marker, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)


def build_tiny_moe(family: str, out_dir: Path | str, tokenizer_dir: Path | str,
                   seed: int = 0, force: bool = False, log=print) -> Path:
    """Build (or reuse) the tiny MoE checkpoint at `out_dir`; returns the folder.

    Idempotent: a folder whose marker records the same family, dimensions, seed and tokenizer
    is returned as is unless `force`. Written to a sibling temporary folder, then renamed.
    """
    dims = tiny_dims(family)
    out, tok_dir = Path(out_dir), Path(tokenizer_dir)
    tok_files = _checked_tokenizer(tok_dir)
    digest = _tokenizer_digest(tok_files)
    want = {"family": family, "dims": dims, "seed": seed, "tokenizer_sha256_16": digest}
    old = read_marker(out)
    if not force and old and all(old.get(k) == v for k, v in want.items()) \
            and (out / "config.json").is_file():
        return out

    t0 = time.monotonic()
    import torch  # heavy imports only when work is needed
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    vocab = len(tok)
    special = {k: getattr(tok, f"{k}_id", None) for k in ("bos_token", "eos_token", "pad_token")}
    config = DeepseekV2Config(vocab_size=vocab, bos_token_id=special["bos_token"],
                              eos_token_id=special["eos_token"],
                              pad_token_id=special["pad_token"], **dims)
    # Extra attributes DeepseekV2Config does not declare are kept on the config (and written):
    # make sure the routing keys vLLM reads are there with the intended values.
    for k in ("n_group", "topk_group", "scoring_func", "moe_layer_freq", "topk_method"):
        setattr(config, k, dims[k])
    config.architectures = ["DeepseekV2ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    suppressed = suppressed_ids(tok)
    with torch.no_grad():
        model.get_output_embeddings().weight[suppressed] = 0.0
    tmp, n_params = _save_bf16(model, out)
    for f in tok_files:
        shutil.copy2(f, tmp / f.name)
    # vLLM's DeepSeek loader (and the plugin's per-role weight filter) read the checkpoint
    # layout of the released models: one tensor per expert and projection.
    from safetensors import safe_open
    keys = set()
    for f in tmp.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    per_expert = f"model.layers.{dims['first_k_dense_replace']}.mlp.experts.0.gate_proj.weight"
    if per_expert not in keys:
        raise ConfigError(f"tiny MoE: transformers {__import__('transformers').__version__} "
                          f"saved no {per_expert} (fused expert tensors?); vLLM expects the "
                          "per-expert DeepSeek checkpoint layout")
    written = json.loads((tmp / "config.json").read_text())
    for k in ("n_group", "topk_group", "scoring_func", "vocab_size", "architectures"):
        if k not in written:
            raise ConfigError(f"tiny MoE: config.json lost {k!r} on save (transformers "
                              f"{__import__('transformers').__version__})")
    marker = {
        **want,
        "architecture": "DeepseekV2ForCausalLM",
        "model_type": written.get("model_type"),
        "vocab_size": vocab,
        "parameters": n_params,
        "dtype": "bfloat16",
        "suppressed_token_ids": len(suppressed),
        "suppressed_note": "lm_head rows of special and whitespace-only tokens are zero: "
                           "greedy decoding never emits EOS, runs to max_tokens",
        "tokenizer_dir": str(tok_dir.resolve()),
        "tokenizer_files": [f.name for f in tok_files],
        "versions": {"torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "seconds": round(time.monotonic() - t0, 2),
    }
    _publish(tmp, out, MARKER, marker)
    log(f"tiny {family} MoE ({n_params / 1e6:.1f}M parameters, vocab {vocab}) at {out} "
        f"in {marker['seconds']:.1f} s")
    return out


# -- tiny Qwen3.5 vision-language model (TokenSpeed EPD plumbing) -----------------------------

# Qwen vision special tokens. smg reads image_token_id / video_token_id / vision_start_token_id
# / vision_end_token_id from config.json and maps them back with the tokenizer: each must be
# one added token.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>")
SUPPRESS_SCALE = 0.125   # see the module docstring: tied rows of suppressed tokens

QWEN3_5_VL_TINY = {
    "text": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                        "full_attention"],
        "full_attention_interval": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "attn_output_gate": True,
        "attention_bias": False,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [11, 11, 10]},
    },
    "vision": {
        "depth": 2,
        "hidden_size": 128,
        "num_heads": 2,
        "intermediate_size": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 256,           # must equal the text hidden_size
        "num_position_embeddings": 2304,  # the real 48x48 learned grid
        "deepstack_visual_indexes": [],
        "initializer_range": 0.02,
    },
    "init_std": 0.02,
    "vocab_multiple": 64,
}

# ChatML (SmolLM2's format) without tools/thinking; image parts (OpenAI "image_url" or HF
# "image") render as the Qwen vision triple, video parts likewise with <|video_pad|>.
VLM_CHAT_TEMPLATE = r"""{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' -}}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{%- for content in message['content'] -%}
{%- if content['type'] in ['image', 'image_url'] or 'image' in content or 'image_url' in content -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif content['type'] == 'video' or 'video' in content -%}
{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif 'text' in content -%}
{{- content['text'] -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}"""

# Qwen3.5 / Qwen3-VL image processing (patch 16, merge 2, temporal 2, mean/std 0.5);
# longest_edge lowered from 16777216 to 262144 pixels (512x512: at most 256 merged tokens).
_VLM_PIXELS = {   # shared by the image and the video processor
    "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "rescale_factor": 1.0 / 255.0,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
}
VLM_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", **_VLM_PIXELS,
                    "resample": 3, "size": {"shortest_edge": 65536, "longest_edge": 262144}}
VLM_VIDEO_PREPROCESSOR = {"video_processor_type": "Qwen3VLVideoProcessor", **_VLM_PIXELS,
                          "size": {"shortest_edge": 4096, "longest_edge": 262144},
                          "fps": 2, "do_sample_frames": True}


def _files_digest() -> str:
    """Digest of what the VLM builder writes besides weights (template, processor configs)."""
    blob = json.dumps([VLM_CHAT_TEMPLATE, VLM_PREPROCESSOR, VLM_VIDEO_PREPROCESSOR,
                       VISION_TOKENS, SUPPRESS_SCALE], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


VLM_ATTENTION = ("full", "hybrid")


def vlm_dims(attention: str = "full") -> dict:
    """QWEN3_5_VL_TINY with the text layers' attention pattern chosen.

    "hybrid": the released 3:1 Gated-DeltaNet / full-attention interleave. "full": every text
    layer full attention (layer_types and full_attention_interval 1; TokenSpeed derives its
    layer pattern from full_attention_interval alone, configs/qwen3_5_text_base_config.py
    layers_block_type). The default is "full" because TokenSpeed 0.1.0's PyPI scheduler (flat
    build) refuses PD/EPD for a model with GDN state layers ("flat GDN layout has no per-layer
    KV on state layers"), as the hybrid model shows on an H200; the full variant has not run
    on an engine.
    """
    if attention not in VLM_ATTENTION:
        raise ConfigError(f"tiny VLM attention {attention!r}: use one of "
                          f"{', '.join(VLM_ATTENTION)}")
    dims = json.loads(json.dumps(QWEN3_5_VL_TINY))     # a deep copy, JSON-shaped like the marker
    if attention == "full":
        n = dims["text"]["num_hidden_layers"]
        dims["text"]["layer_types"] = ["full_attention"] * n
        dims["text"]["full_attention_interval"] = 1
    return dims


def build_tiny_vlm(out_dir: Path | str, tokenizer_dir: Path | str, seed: int = 0,
                   force: bool = False, log=print, attention: str = "full") -> Path:
    """Build (or reuse) the tiny Qwen3.5 vision-language checkpoint at `out_dir`.

    Idempotent like build_tiny_moe: a folder whose marker (.e2e_tiny_vlm.json) records the same
    family, dimensions (incl. the attention pattern, see vlm_dims), seed, tokenizer and
    template/processor files is returned as is unless `force`. Written to a sibling temporary
    folder, then renamed.
    """
    dims = vlm_dims(attention)
    out, tok_dir = Path(out_dir), Path(tokenizer_dir)
    tok_files = _checked_tokenizer(tok_dir)
    want = {"family": VLM_FAMILY, "dims": dims, "seed": seed,
            "tokenizer_sha256_16": _tokenizer_digest(tok_files),
            "files_sha256_16": _files_digest()}
    old = read_marker(out, VLM_MARKER)
    if not force and old and all(old.get(k) == v for k, v in want.items()) \
            and (out / "config.json").is_file():
        return out

    t0 = time.monotonic()
    import torch  # heavy imports only when work is needed
    import transformers
    try:
        from transformers import (
            AutoTokenizer,
            GenerationConfig,
            Qwen3_5Config,
            Qwen3_5ForConditionalGeneration,
        )
    except ImportError:
        raise ConfigError(f"tiny VLM: transformers {transformers.__version__} has no Qwen3.5 "
                          "(Qwen3_5Config); it needs transformers >= 5") from None
    from tokenizers import AddedToken

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS],
                   special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    for t, i in ids.items():
        if tok.encode(t, add_special_tokens=False) != [i]:
            raise ConfigError(f"tiny VLM: {t} is not one token of {tok_dir} after adding it")
    tok.chat_template = VLM_CHAT_TEMPLATE
    n_tok = len(tok)
    m = dims["vocab_multiple"]
    vocab = (n_tok + m - 1) // m * m
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(eos, int) or eos == tok.unk_token_id:
        eos = tok.eos_token_id
    text = {**dims["text"], "model_type": "qwen3_5_text", "vocab_size": vocab,
            "eos_token_id": eos, "bos_token_id": None, "pad_token_id": tok.pad_token_id,
            "initializer_range": dims["init_std"], "dtype": "bfloat16"}
    vision = {**dims["vision"], "model_type": "qwen3_5"}
    config = Qwen3_5Config(text_config=text, vision_config=vision,
                           image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"],
                           tie_word_embeddings=dims["text"]["tie_word_embeddings"])
    config.architectures = ["Qwen3_5ForConditionalGeneration"]

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    suppressed = suppressed_ids(tok)
    with torch.no_grad():
        # A small std keeps random activations tame in bfloat16; 1-d parameters (norms,
        # A_log, dt_bias, biases) keep the architecture's own initialisation.
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, dims["init_std"])
        emb = model.get_input_embeddings().weight
        if model.get_output_embeddings().weight.data_ptr() != emb.data_ptr():
            raise ConfigError("tiny VLM: lm_head is not tied to the input embedding")
        emb[suppressed] *= SUPPRESS_SCALE
        emb[n_tok:] = 0.0
    tmp, n_params = _save_bf16(model, out)
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id,
                     do_sample=False).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "chat_template.jinja").write_text(VLM_CHAT_TEMPLATE)   # smg reads this file
    (tmp / "preprocessor_config.json").write_text(json.dumps(VLM_PREPROCESSOR, indent=2) + "\n")
    (tmp / "video_preprocessor_config.json").write_text(
        json.dumps(VLM_VIDEO_PREPROCESSOR, indent=2) + "\n")
    # TokenSpeed's loader maps the released checkpoints' names (model.language_model.*,
    # model.visual.*): make sure this transformers wrote the same layout.
    from safetensors import safe_open
    keys = set()
    for f in tmp.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    first = ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
             if dims["text"]["layer_types"][0] == "linear_attention"
             else "model.language_model.layers.0.self_attn.q_proj.weight")
    for k in ("model.language_model.embed_tokens.weight", first,
              "model.language_model.layers.3.self_attn.q_proj.weight",
              "model.visual.patch_embed.proj.weight", "model.visual.merger.linear_fc2.weight"):
        if k not in keys:
            raise ConfigError(f"tiny VLM: transformers {transformers.__version__} saved no {k}; "
                              "TokenSpeed expects the released Qwen3.5 checkpoint layout")
    written = json.loads((tmp / "config.json").read_text())
    if (written.get("model_type"), written.get("image_token_id")) != ("qwen3_5",
                                                                     ids["<|image_pad|>"]):
        raise ConfigError(f"tiny VLM: config.json as written by transformers "
                          f"{transformers.__version__} lost model_type/image_token_id")
    marker = {
        **want,
        "architecture": "Qwen3_5ForConditionalGeneration",
        "model_type": written["model_type"],
        "vocab_size": vocab,
        "tokenizer_size": n_tok,
        "vision_token_ids": ids,
        "eos_token_id": eos,
        "parameters": n_params,
        "dtype": "bfloat16",
        "suppressed_token_ids": len(suppressed),
        "suppressed_note": f"tied embedding rows of special and whitespace-only tokens scaled "
                           f"by {SUPPRESS_SCALE} (non-zero inputs, logits far below the best "
                           "random logit), padding rows zero: greedy decoding never emits "
                           "EOS, runs to max_tokens",
        "tokenizer_dir": str(tok_dir.resolve()),
        "versions": _versions(),
        "seconds": round(time.monotonic() - t0, 2),
    }
    _publish(tmp, out, VLM_MARKER, marker)
    log(f"tiny {VLM_FAMILY} VLM ({n_params / 1e6:.1f}M parameters, vocab {vocab}) at {out} "
        f"in {marker['seconds']:.1f} s")
    return out
