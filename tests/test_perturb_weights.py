"""models.perturb_weights: a copy of a model folder whose every floating-point weight is
multiplied by (1 + eps * z), the same-path rank test's negative control on a real engine
(e2e_test/router/test_perturbed.py). Pure over a folder; no engine."""

from __future__ import annotations

import json

import pytest
from lazy_import import lazy

from e2e_test.infra.errors import ConfigError
from e2e_test.infra.specs import models

torch = lazy("torch")
pytestmark = pytest.mark.skipif(torch is None, reason="could not import 'torch'")


def load_file(path):
    from safetensors.torch import load_file
    return load_file(path)


def save_file(tensors, path):
    from safetensors.torch import save_file
    save_file(tensors, path)


def _model(folder, dtype=None):
    dtype = dtype or torch.float32
    folder.mkdir()
    gen = torch.Generator().manual_seed(1)
    save_file({"a.weight": torch.randn(64, 32, generator=gen).to(dtype),
               "a.bias": torch.zeros(64, dtype=dtype),
               "a.index": torch.arange(5)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_eps_zero_is_the_same_weights_and_every_other_file_is_copied(tmp_path):
    src = _model(tmp_path / "src", torch.bfloat16)
    s = models.perturb_weights(src, tmp_path / "dst", 0.0, 7)
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "dst" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert b["a.weight"].dtype == torch.bfloat16 and b["a.index"].dtype == torch.int64
    assert (s["tensors"], s["elements"], s["changed"], s["max_relative_change"]) == (
        2, 64 * 32 + 64, 0, 0.0)
    for f in ("config.json", "tokenizer.json"):
        assert (tmp_path / "dst" / f).read_bytes() == (src / f).read_bytes()
    assert not list(tmp_path.glob("dst.tmp*"))


def test_each_weight_moves_by_eps_times_a_fixed_normal_draw(tmp_path):
    """In float32 the relative change of each weight is eps * z exactly, z standard normal
    (mean 0, spread 1); the same seed gives the same copy, another seed another; zeros and
    integer tensors stay as they are."""
    src = _model(tmp_path / "src")
    eps = 0.01
    s = models.perturb_weights(src, tmp_path / "one", eps, 3)
    models.perturb_weights(src, tmp_path / "two", eps, 3)
    models.perturb_weights(src, tmp_path / "other", eps, 4)
    a = load_file(src / "model.safetensors")
    one, two, other = (load_file(tmp_path / d / "model.safetensors")
                       for d in ("one", "two", "other"))
    z = (one["a.weight"] / a["a.weight"] - 1) / eps
    assert abs(z.mean().item()) < 0.1 and 0.9 < z.std().item() < 1.1
    assert torch.equal(one["a.weight"], two["a.weight"])
    assert not torch.equal(one["a.weight"], other["a.weight"])
    assert torch.equal(one["a.bias"], a["a.bias"]) and torch.equal(one["a.index"], a["a.index"])
    assert s["changed"] == 64 * 32 and s["max_relative_change"] == pytest.approx(
        (eps * z).abs().max().item(), rel=1e-3)


def test_in_bfloat16_a_small_eps_moves_a_share_of_the_weights_by_one_step(tmp_path):
    """eps below a bfloat16 step (2^-8 of a value) moves only the weights whose eps * |z|
    crosses half a step, each by one step; a larger eps moves nearly all (the summary says how
    many)."""
    src = _model(tmp_path / "src", torch.bfloat16)
    small = models.perturb_weights(src, tmp_path / "small", 0.001, 0)
    large = models.perturb_weights(src, tmp_path / "large", 0.05, 0)
    assert 0 < small["changed"] < 0.5 * small["elements"] < large["changed"]
    assert small["max_relative_change"] <= 2 ** -7


@pytest.mark.parametrize("eps, seed, what", [
    (-0.1, 0, "eps -0.1 is not a finite number >= 0"),
    (float("nan"), 0, "eps nan is not a finite number >= 0"),
    ("0.1", 0, "eps '0.1' is not a finite number >= 0"),
    (0.1, -1, "seed -1 is not an integer in [0, 2^32)"),
    (0.1, 2**32, "seed 4294967296 is not an integer in [0, 2^32)")])
def test_bad_input_is_one_line_before_any_work(tmp_path, eps, seed, what):
    src = _model(tmp_path / "src")
    with pytest.raises(ConfigError, match=f"^perturbed weights: {__import__('re').escape(what)}$"):
        models.perturb_weights(src, tmp_path / "dst", eps, seed)
    assert not (tmp_path / "dst").exists()


def test_a_folder_without_safetensors_is_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(ConfigError, match="^perturbed weights: no \\*.safetensors in "):
        models.perturb_weights(tmp_path / "src", tmp_path / "dst", 0.1, 0)


def test_perturbed_prepares_once_under_the_cache(tmp_path, monkeypatch):
    src = _model(tmp_path / "src", torch.bfloat16)
    monkeypatch.setenv("E2E_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "weights_path", lambda spec: src)
    spec = type("Spec", (), {"id": "org/toy"})()
    logs: list = []
    dst = models.perturbed(spec, 0.01, 5, log=logs.append)
    assert dst == tmp_path / "cache" / "models" / "org--toy--perturbed-0.01-5"
    assert len(logs) == 1 and "weights changed" in logs[0]
    before = (dst / "model.safetensors").stat().st_mtime_ns
    assert models.perturbed(spec, 0.01, 5, log=logs.append) == dst and len(logs) == 1
    assert (dst / "model.safetensors").stat().st_mtime_ns == before
    assert models.perturbed(spec, 0.02, 5, log=logs.append) != dst and len(logs) == 2
