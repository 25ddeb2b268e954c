"""The tiny random-weight Qwen3.5 VLM builder (TokenSpeed EPD plumbing): config, vision tokens,
chat template, suppressed rows, marker idempotence, the registry entry. CPU only, a few seconds.
"""

import json
import os
from pathlib import Path

import pytest
from lazy_import import lazy

from e2e_test.infra.specs.model_specs import get_spec
from e2e_test.tools import tiny_models

# None in a `.[dev]` venv: the registry and dimension tests still run
torch, transformers = lazy("torch"), lazy("transformers")

# Building and loading the model needs torch and a transformers with Qwen3.5 (the cpu extra);
# a string condition: read at the test's setup, so that collection imports neither.
needs_torch = pytest.mark.skipif(
    "not hasattr(transformers, 'Qwen3_5Config')",
    reason="needs torch and a transformers with Qwen3_5Config: pip install -e '.[cpu]'")

SMOL = Path(os.environ.get("E2E_CACHE_DIR") or Path.home() / ".cache" / "e2e_test") \
    / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not (SMOL / "tokenizer.json").is_file():
        pytest.skip(f"no prepared SmolLM2 tokenizer at {SMOL} (python -m e2e_test models prepare)")
    out = tmp_path_factory.mktemp("vlm") / "tiny-qwen3_5-vl"
    logs = []
    path = tiny_models.build_tiny_vlm(out, SMOL, seed=0, log=logs.append)
    return path, logs


@needs_torch
def test_config(built):
    path, logs = built
    cfg = json.loads((path / "config.json").read_text())
    dims = tiny_models.vlm_dims()
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_5"
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert vision["out_hidden_size"] == text["hidden_size"] == 256
    # Default "full": every text layer full attention, interval 1 (TokenSpeed reads only that).
    assert text["layer_types"] == ["full_attention"] * 4 and text["num_hidden_layers"] == 4
    assert text["full_attention_interval"] == 1
    assert vision["depth"] == dims["vision"]["depth"] and vision["patch_size"] == 16
    assert vision["spatial_merge_size"] == 2 and vision["temporal_patch_size"] == 2
    assert text["max_position_embeddings"] >= get_spec("tiny-random/Qwen3.5-VL").max_model_len
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert tok.convert_ids_to_tokens(cfg["image_token_id"]) == "<|image_pad|>"
    assert tok.encode("<|image_pad|>", add_special_tokens=False) == [cfg["image_token_id"]]
    for key, name in (("video_token_id", "<|video_pad|>"),
                      ("vision_start_token_id", "<|vision_start|>"),
                      ("vision_end_token_id", "<|vision_end|>")):
        assert tok.convert_ids_to_tokens(cfg[key]) == name, key
    assert text["vocab_size"] >= len(tok) and text["vocab_size"] % 64 == 0
    assert text["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    pre = json.loads((path / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (16, 2, 2)
    assert (path / "video_preprocessor_config.json").is_file()
    marker = tiny_models.read_marker(path, tiny_models.VLM_MARKER)
    assert marker["family"] == "qwen3_5_vl" and marker["seed"] == 0
    assert marker["dims"] == dims
    assert marker["vision_token_ids"]["<|image_pad|>"] == cfg["image_token_id"]
    assert set(marker["versions"]) == {"torch", "transformers"}
    assert logs and "tiny qwen3_5_vl VLM" in logs[0]


@needs_torch
def test_chat_template_renders_vision_triple(built):
    path = built[0]
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert (path / "chat_template.jinja").read_text() == tiny_models.VLM_CHAT_TEMPLATE
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "What is in the picture?"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                    "What is in the picture?<|im_end|>\n<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                    add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@needs_torch
def test_suppressed_rows(built):
    """Tied embedding: suppressed rows are scaled down (small logits, non-zero inputs), the
    padding rows are zero, ordinary rows untouched; greedy never emits a suppressed token."""
    from safetensors.torch import load_file
    path = built[0]
    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in w                           # tied
    emb = w["model.language_model.embed_tokens.weight"].float()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    suppressed = tiny_models.suppressed_ids(tok)
    norms = emb.norm(dim=1)
    ordinary = torch.ones(len(tok), dtype=torch.bool)
    ordinary[suppressed] = False
    typical = norms[:len(tok)][ordinary].median()
    for name in ("vision_start_token_id", "vision_end_token_id", "eos_token_id"):
        tid = cfg[name] if name in cfg else cfg["text_config"][name]
        assert tid in suppressed, name
        assert 0 < norms[tid] < typical / 4, name              # small, but a real input
    assert (norms[suppressed] < typical / 4).all()
    assert (norms[suppressed] > 0).all()
    assert torch.equal(emb[len(tok):], torch.zeros_like(emb[len(tok):]))
    assert (norms[:len(tok)][ordinary] > 0).all()

    model = transformers.AutoModelForImageTextToText.from_pretrained(str(path),
                                                                     dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "Say something"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
        assert torch.isfinite(logits).all()
        best = logits.max(dim=-1).values
        assert (logits[:, suppressed].max(dim=-1).values < best).all()
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert len(out) == 8 and not set(out.tolist()) & set(suppressed)
    assert max(out.tolist()) < len(tok)


@needs_torch
def test_idempotent_and_deterministic(built, tmp_path):
    path, _ = built
    logs = []
    again = tiny_models.build_tiny_vlm(path, SMOL, seed=0, log=logs.append)
    assert again == path and logs == []            # reused: nothing rebuilt
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    other = tiny_models.build_tiny_vlm(tmp_path / "t2", SMOL, seed=0, log=lambda *_: None)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    from safetensors.torch import load_file
    a, b = load_file(str(path / "model.safetensors")), load_file(str(other / "model.safetensors"))
    for key in ("model.visual.blocks.1.attn.qkv.weight",
                "model.language_model.layers.2.self_attn.q_proj.weight"):
        assert torch.equal(a[key], b[key]), key
    assert not list(tmp_path.glob("t2.tmp*"))      # the temporary folder was renamed


def test_registry_entry():
    spec = get_spec("tiny-random/Qwen3.5-VL")
    assert spec.engines == ("tokenspeed",)
    assert {"regular", "pd", "epd"} <= set(spec.topologies)
    assert "multimodal" in spec.features and not spec.accuracy
    assert spec.gpu_memory_fraction <= 0.2 and spec.max_model_len == 4096
    args = spec.engine_args("tokenspeed")
    assert args[args.index("--disaggregation-layerwise-interval") + 1] == "0"
    assert spec.weights.source == "path" and spec.weights.path.endswith("tiny-qwen3_5-vl")


def test_vlm_dims_attention_variants():
    hybrid = tiny_models.vlm_dims("hybrid")["text"]
    assert hybrid["layer_types"].count("linear_attention") == 3
    assert hybrid["full_attention_interval"] == 4
    full = tiny_models.vlm_dims()["text"]
    assert full["layer_types"] == ["full_attention"] * 4 and full["full_attention_interval"] == 1
    assert tiny_models.QWEN3_5_VL_TINY["text"]["full_attention_interval"] == 4   # not mutated
    import pytest as _pytest
    with _pytest.raises(tiny_models.ConfigError, match="attention 'gdn'"):
        tiny_models.vlm_dims("gdn")
