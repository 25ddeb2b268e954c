"""The tiny random-weight MoE builder: config, tokenizer copy, marker, loadability, idempotence."""

import json

import pytest
from lazy_import import lazy

from e2e_test.infra.errors import ConfigError
from e2e_test.tools import tiny_models

# None in a `.[dev]` venv: the input checks still run
torch, transformers = lazy("torch"), lazy("transformers")

# Building and loading a model needs torch and transformers (the cpu extra).
needs_torch = pytest.mark.skipif(transformers is None,
                                 reason="needs torch and transformers: pip install -e '.[cpu]'")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small word-level tokenizer folder (no download, no model cache needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ("the of and to a in is you that it he was for on are as with his they at be "
             "this have from or one had by word but not what all were we when your can said "
             "there use an each which she do how their if will up other about out many then "
             "them these so some her would make like him into time has look two more write "
             "go see number no way could people my than first water been call who oil its "
             "now find long down day did get come made may part capital France").split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, " ": 3}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def built(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("m") / "tiny"
    logs = []
    path = tiny_models.build_tiny_moe("deepseek_v2", out, tokenizer_dir, seed=0, log=logs.append)
    return path, tokenizer_dir, logs


@needs_torch
def test_config_and_files(built):
    path, tok_dir, logs = built
    cfg = json.loads((path / "config.json").read_text())
    dims = tiny_models.DEEPSEEK_V2_TINY
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v2"
    for k in ("num_hidden_layers", "hidden_size", "n_routed_experts", "num_experts_per_tok",
              "moe_intermediate_size", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "n_group", "topk_group", "scoring_func", "first_k_dense_replace",
              "max_position_embeddings"):
        assert cfg[k] == dims[k], k
    assert cfg["q_lora_rank"] is None
    # Constraints of the AFD/EP path and vLLM kernels.
    assert cfg["hidden_size"] % 128 == 0
    assert cfg["n_routed_experts"] % 2 == 0 and cfg["moe_intermediate_size"] % 64 == 0
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64   # Lite's MLA shape
    assert cfg["max_position_embeddings"] >= 4096                        # registry max_model_len
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert cfg["vocab_size"] == len(tok)
    assert cfg["eos_token_id"] == tok.eos_token_id
    assert (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    marker = tiny_models.read_marker(path)
    assert marker["family"] == "deepseek_v2" and marker["seed"] == 0
    assert marker["vocab_size"] == len(tok) and marker["dtype"] == "bfloat16"
    assert marker["dims"] == dims
    assert logs and "tiny deepseek_v2 MoE" in logs[0]


@needs_torch
def test_checkpoint_layout_matches_deepseek(built):
    """Per-expert weight names, as vLLM's DeepSeek-V2 loader and the plugin's role filter
    (afd_plugin/model_executor/models/deepseek_v2.py _checkpoint_weight_roles) expect."""
    from safetensors import safe_open
    path = built[0]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert dtypes == {"BF16"}
    assert "model.layers.0.mlp.gate_proj.weight" in keys            # layer 0 dense
    assert "model.layers.1.mlp.gate.weight" in keys                 # router
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys  # per-expert tensors
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in keys
    assert "model.layers.3.self_attn.kv_b_proj.weight" in keys
    assert "lm_head.weight" in keys


@needs_torch
def test_loads_and_generates_with_transformers(built):
    path = built[0]
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    ids = tok("what is the capital of France", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits.float()).all()
    out = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    # Suppressed tokens: greedy never emits a special token, so it runs to max_new_tokens.
    assert len(out) == 6
    assert not set(out.tolist()) & set(tok.all_special_ids)


@needs_torch
def test_idempotent_and_deterministic(built, tmp_path):
    path, tok_dir, _ = built
    logs = []
    again = tiny_models.build_tiny_moe("deepseek_v2", path, tok_dir, seed=0, log=logs.append)
    assert again == path and logs == []        # reused: nothing rebuilt
    from safetensors.torch import load_file
    a = load_file(str(path / "model.safetensors"))
    other = tiny_models.build_tiny_moe("deepseek_v2", tmp_path / "t2", tok_dir, seed=0,
                                       log=lambda *_: None)
    b = load_file(str(other / "model.safetensors"))
    key = "model.layers.2.mlp.experts.3.up_proj.weight"
    assert torch.equal(a[key], b[key])


def test_bad_family_and_tokenizer(tmp_path):
    """Both refused before anything is built (no torch needed): a family other than
    DeepSeek-V2, and a tokenizer folder without tokenizer files."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="DeepSeek"):
        tiny_models.build_tiny_moe("qwen3_moe", tmp_path / "x", tok)
    with pytest.raises(ConfigError, match="tokenizer"):
        tiny_models.build_tiny_moe("deepseek_v2", tmp_path / "x", tmp_path)
