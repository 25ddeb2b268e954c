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
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from .errors import ConfigError

MARKER = ".e2e_tiny_moe.json"
FAMILIES = ("deepseek_v2",)
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


def _suppressed_ids(tok) -> list[int]:
    """Special/added tokens and tokens that decode to whitespace only."""
    ids = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    vocab = len(tok)
    texts = tok.batch_decode([[i] for i in range(vocab)])
    ids |= {i for i, t in enumerate(texts) if not t.strip()}
    return sorted(i for i in ids if 0 <= i < vocab)


def read_marker(out_dir: Path | str) -> dict | None:
    try:
        return json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def build_tiny_moe(family: str, out_dir: Path | str, tokenizer_dir: Path | str,
                   seed: int = 0, force: bool = False, log=print) -> Path:
    """Build (or reuse) the tiny MoE checkpoint at `out_dir`; returns the folder.

    Idempotent: a folder whose marker records the same family, dimensions, seed and tokenizer
    is returned as is unless `force`. Written to a sibling temporary folder, then renamed.
    """
    dims = tiny_dims(family)
    out, tok_dir = Path(out_dir), Path(tokenizer_dir)
    tok_files = _tokenizer_files(tok_dir)
    if not tok_dir.is_dir() or not any(f.name in ("tokenizer.json", "tokenizer_config.json",
                                                  "vocab.json") for f in tok_files):
        raise ConfigError(f"tokenizer folder {tok_dir}: no tokenizer files (tokenizer.json / "
                          "tokenizer_config.json)")
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
    suppressed = _suppressed_ids(tok)
    with torch.no_grad():
        model.get_output_embeddings().weight[suppressed] = 0.0
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    n_params = sum(p.numel() for p in model.parameters())

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
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
    (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    log(f"tiny {family} MoE ({n_params / 1e6:.1f}M parameters, vocab {vocab}) at {out} "
        f"in {marker['seconds']:.1f} s")
    return out
