#!/usr/bin/env python3
"""Build carry-parts that put an LLM engine onto an offline device machine whose image already
holds torch & co. (but not the engine). What to carry is a profile (scripts/stage_profiles/*.yaml);
see docs/staging.md.

  1. resolve   the engine's full dependency closure for the *target* interpreter/platform with
               `uv pip compile --exclude-newer DATE` (versions as they were when the engine was
               released), unless a pinned lock is given with --lock;
  2. select    from that closure only the distributions of the profile's `keep` list (the set
               shown to be imported on the serving path), minus what the target image already
               has (--image-packages), plus `force` (carried even though the image has them);
  3. fetch     each wheel at its pinned version (pip download --no-deps, target tags), then
               check that every carried wheel's Requires-Dist (markers evaluated for the target)
               is carried, on the image, or named in the profile's `dropped`;
  4. slim      drop files the serving path never touches (profile `slim` globs) and re-zip the
               wheel uncompressed, so that the outer xz sees raw bytes (about 2x smaller than
               the wheels' own deflate);
  5. syslibs   optionally add shared libraries from Debian packages (`debs`) that a wheel's .so
               needs but the image may lack (setup.sh installs only those the device lacks);
  6. pack      tar -> xz -> parts (as large as fits a 64 MiB call beside the checkout's tracked
               files; --part-mb; --resplit re-cuts built parts) + manifest.json (sha256) + setup.sh.

Run on a machine with PyPI access; carry the parts one per device call, each with setup.sh and
manifest.json, and run `bash <out>/setup.sh` each time (it installs once all parts are there).
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import yaml
from packaging.markers import InvalidMarker, default_environment
from packaging.requirements import InvalidRequirement, Requirement  # packaging: a pytest dependency

REPO = Path(__file__).resolve().parents[1]
DEFAULT_IMAGE_PACKAGES = REPO.parent / "shared" / "device" / "image-packages.txt"
PART = 48_000_000  # the cut when the checkout's size is unknown (see part_size_for)
CARRY_LIMIT = 64 * 2**20   # what one device call carries: the checkout's tracked files + paths
CARRY_MARGIN = 2 * 2**20   # setup.sh, manifest.json and the small files a call carries beside
MIN_PART = 8_000_000
# Every tag a glibc 2.39 x86_64 target installs (PEP 600: manylinux_2_39 down to 2_5), newest
# first, the legacy names beside their glibc version: pip matches --platform exactly, and wheels
# such as nvidia-nccl-cu13 (manylinux_2_18) or nvidia-nvjitlink (manylinux2010) carry no other.
_LEGACY = {17: "manylinux2014_x86_64", 12: "manylinux2010_x86_64", 5: "manylinux1_x86_64"}
PIP_PLATFORMS = [tag for minor in range(39, 4, -1)
                 for tag in (f"manylinux_2_{minor}_x86_64", _LEGACY.get(minor)) if tag] + \
                ["linux_x86_64", "any"]
# Debian plugin directories (ibverbs providers, SASL/Kerberos modules): never carried as syslibs.
PLUGIN_DIRS = ("libibverbs", "sasl2", "krb5")


class StageError(Exception):
    """Bad input or a failed step; main() prints it as one line."""


# ------------------------------------------------------------------------------------ profile
_ABS = re.compile(r"^/[A-Za-z0-9_./+-]+$")
_REL = re.compile(r"^(?!/)(?!.*\.\.)[A-Za-z0-9_./+-]+$")
_TOKEN = re.compile(r"^[A-Za-z0-9_.+-]+$")
_ENVNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENVVAL = re.compile(r"^[A-Za-z0-9_./:,=+@-]*$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ][0-9:.]+(Z|[+-]\d{2}:?\d{2})?)?$")

# key: (type, required, default)
PROFILE_KEYS = {
    "engine": (str, True, None),         # name, printed by setup.sh
    "version": (str, True, None),        # engine version (fallback for the READY line)
    "roots": (list, True, None),         # requirements to resolve the closure from
    "exclude_newer": (str, True, None),  # resolve as of this date (uv --exclude-newer)
    "keep": (list, True, None),          # distributions on the serving path
    "stage": (str, True, None),          # device: where parts are collected
    "site": (str, True, None),           # device: pip install --target
    "env": (str, True, None),            # device: env file to source
    "import_check": (str, True, None),   # device: python run by setup.sh to prove the install
    "module": (str, False, ""),          # package dir that must exist in site (default: engine)
    "force": (list, False, []),          # carried even when the image has them (subset of keep)
    "dropped": (dict, False, {}),        # name -> why it is left out (must not overlap keep)
    "slim": (dict, False, {}),           # name -> globs of wheel members to drop
    "debs": (list, False, []),           # Debian packages whose shared libraries are carried
    "syslib_skip": (list, False, []),    # sonames never carried
    "ldd_check": (list, False, []),      # .so paths under site that setup.sh checks with ldd
    "pythonpath": (list, False, []),     # extra PYTHONPATH entries under site
    "env_vars": (dict, False, {}),       # exported by the env file unless already set
    "env_comment": (str, False, ""),     # first line of the env file (a comment)
    "python": (str, False, "3.12"),      # target interpreter (X.Y)
    "uv_platform": (str, False, "x86_64-manylinux_2_39"),  # uv --python-platform
    "pip_platforms": (list, False, PIP_PLATFORMS),  # pip download --platform tags
}


def cn(name: str) -> str:
    """Canonical distribution name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def validate_profile(data, source: str = "profile") -> dict:
    """Check a loaded profile and fill in defaults; raises StageError (one line) on bad input."""
    def bad(msg):
        raise StageError(f"{source}: {msg}")

    if not isinstance(data, dict):
        bad("not a mapping of keys")
    unknown = sorted(set(data) - set(PROFILE_KEYS))
    if unknown:
        bad(f"unknown key(s): {', '.join(map(str, unknown))} (known: {', '.join(PROFILE_KEYS)})")
    missing = [k for k, (_, req, _) in PROFILE_KEYS.items() if req and k not in data]
    if missing:
        bad(f"missing key(s): {', '.join(missing)}")
    prof = {}
    for key, (typ, _, default) in PROFILE_KEYS.items():
        val = data.get(key, default)
        if key == "exclude_newer" and isinstance(val, (datetime.date, datetime.datetime)):
            val = val.isoformat()  # an unquoted YAML date
        if not isinstance(val, typ) or isinstance(val, bool):
            bad(f"{key} must be a {typ.__name__}, got {type(val).__name__}"
                + (" (quote it)" if typ is str and isinstance(val, (int, float)) else ""))
        if typ is list and not all(isinstance(x, str) and x for x in val):
            bad(f"{key} must be a list of non-empty strings")
        if typ is str and key not in ("env_comment", "module") and not val.strip():
            bad(f"{key} must not be empty")
        prof[key] = list(val) if typ is list else dict(val) if typ is dict else val
    if not prof["roots"] or not prof["keep"]:
        bad("roots and keep must not be empty")
    for key in ("engine", "version"):
        if not _TOKEN.match(prof[key]):
            bad(f"{key} {prof[key]!r} may only hold letters, digits and _.+-")
    if not _DATE.match(prof["exclude_newer"]):
        bad(f"exclude_newer {prof['exclude_newer']!r} is not a date (YYYY-MM-DD)")
    if not re.match(r"^3\.\d+$", prof["python"]):
        bad(f"python {prof['python']!r} must be 3.X")
    prof["module"] = prof["module"] or prof["engine"].replace("-", "_")
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", prof["module"]):
        bad(f"module {prof['module']!r} is not a Python package name")
    for key in ("stage", "site", "env"):
        if not _ABS.match(prof[key]):
            bad(f"{key} {prof[key]!r} must be an absolute path of letters, digits and _./+-")
    for key in ("pythonpath", "ldd_check"):
        for p in prof[key]:
            if not _REL.match(p):
                bad(f"{key} entry {p!r} must be a relative path under site")
    if "'" in prof["import_check"] or "\n" in prof["import_check"]:
        bad("import_check must be one line without single quotes")
    if any(c in prof["env_comment"] for c in "$`\\\n"):
        bad("env_comment must be one line without $, ` or \\")
    for k, v in prof["env_vars"].items():
        if not isinstance(k, str) or not _ENVNAME.match(k):
            bad(f"env_vars: {k!r} is not a variable name")
        if isinstance(v, bool) or not isinstance(v, (str, int)) or not _ENVVAL.match(str(v)):
            bad(f"env_vars: {k} value {v!r} must be a plain string (letters, digits, _./:,=+@-)")
        prof["env_vars"][k] = str(v)
    for k, globs in prof["slim"].items():
        if not isinstance(globs, list) or not all(isinstance(g, str) and g for g in globs):
            bad(f"slim: {k} must map to a list of globs")
    prof["slim"] = {cn(k): list(v) for k, v in prof["slim"].items()}
    for k, why in prof["dropped"].items():
        if not isinstance(why, str):
            bad(f"dropped: {k} must map to a reason (a string)")
    keep = {cn(x) for x in prof["keep"]}
    for key, names in (("force", prof["force"]), ("slim", list(prof["slim"]))):
        stray = sorted(n for n in names if cn(n) not in keep)
        if stray:
            bad(f"{key} names not in keep: {', '.join(stray)}")
    both = sorted(n for n in prof["dropped"] if cn(n) in keep)
    if both:
        bad(f"names both kept and dropped: {', '.join(both)}")
    return prof


def load_profile(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise StageError(f"profile not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise StageError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    return validate_profile(data, str(path))


# ------------------------------------------------------------------------------------- inputs
def read_lock(path) -> dict:
    """name==version lines (uv/pip-compile output or a plain lock) -> {canonical name: version}."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip())
        if m:
            pins[cn(m.group(1))] = m.group(2)
    return pins


def read_image_packages(path) -> set:
    """Package names on the target image: whitespace-separated, '#' comments, pins allowed."""
    names = set()
    for line in Path(path).read_text().splitlines():
        for tok in line.split("#", 1)[0].split():
            m = re.match(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*", tok)
            if m:
                names.add(cn(m.group(0)))
    return names


def select(pins: dict, keep, image: set, force, full: bool = False) -> list:
    """Names to carry: (closure ∩ keep) − image + force (force only where in the closure).

    With full=True keep is the whole closure. Raises StageError when keep names are missing
    from the closure (a typo, or a closure resolved for another engine version)."""
    force = {cn(x) for x in force}
    keep = set(pins) if full else {cn(x) for x in keep}
    missing = sorted(k for k in keep if k not in pins)
    if missing:
        raise StageError(f"keep names not in the resolved closure: {', '.join(missing)}")
    chosen = sorted(n for n in pins if n in keep and (n not in image or n in force))
    if not chosen:
        raise StageError("nothing to carry: every kept name is on the image")
    return chosen


def target_environment(prof: dict) -> dict:
    """PEP 508 marker environment of the profile's target (CPython X.Y on x86_64 Linux)."""
    env = default_environment()
    env.update(python_version=prof["python"], python_full_version=prof["python"] + ".0",
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", os_name="posix",
               platform_machine="x86_64", extra="")
    return env


def wheel_requires(path) -> list:
    """Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if n.count("/") == 1
                and n.endswith(".dist-info/METADATA")]
        if not meta:
            raise StageError(f"{Path(path).name}: no .dist-info/METADATA")
        text = z.read(meta[0]).decode("utf-8", "replace")
    head = text.split("\n\n", 1)[0]  # the headers; the description follows the blank line
    return [line.split(":", 1)[1].strip() for line in head.splitlines()
            if line.lower().startswith("requires-dist:")]


def unmet_requirements(requires: dict, carried, image: set, dropped, env: dict) -> dict:
    """{missing name: [carried names that require it]}: requirements (extras ignored, markers
    evaluated in env, so `extra == "dev"` ones fall away) that are neither carried, nor on the
    image, nor dropped with a reason. requires: carried name -> its Requires-Dist strings."""
    have = {cn(x) for x in carried} | image | {cn(x) for x in dropped}
    missing = {}
    for name in sorted(requires):
        for line in requires[name]:
            try:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate(env):
                    continue
            except (InvalidRequirement, InvalidMarker) as e:
                raise StageError(f"{name}: unreadable Requires-Dist {line!r}: {e}") from None
            if cn(req.name) not in have:
                missing.setdefault(cn(req.name), []).append(name)
    return missing


def check_requirements(requires: dict, carried, image: set, prof: dict) -> None:
    """Raise StageError (one line) naming what carried wheels require and nobody provides."""
    missing = unmet_requirements(requires, carried, image, prof["dropped"],
                                 target_environment(prof))
    if missing:
        raise StageError("required by carried wheels but neither carried, on the image, nor "
                         "dropped (add to keep, or to dropped with a reason): " + ", ".join(
                             f"{m} (by {', '.join(by)})" for m, by in sorted(missing.items())))


# -------------------------------------------------------------------------------------- steps
def run(cmd, **kw):
    try:
        return subprocess.run(cmd, check=True, **kw)
    except FileNotFoundError as e:
        raise StageError(f"command not found: {cmd[0]} ({e})") from None
    except subprocess.CalledProcessError as e:
        raise StageError(f"failed (rc={e.returncode}): {' '.join(map(str, cmd))[:300]}") from None


def uv_cmd(cache: Path) -> list:
    if shutil.which("uv"):
        return ["uv"]
    venv = cache / "uv-venv"
    if not (venv / "bin" / "uv").exists():
        run([sys.executable, "-m", "venv", str(venv)])
        run([str(venv / "bin" / "pip"), "install", "-q", "uv"])
    return [str(venv / "bin" / "uv")]


def resolve(prof: dict, cache: Path, lock_out: Path) -> dict:
    """Full closure, pinned, as of exclude_newer, for the profile's Python and platform."""
    req = cache / "roots.in"
    req.write_text("\n".join(prof["roots"]) + "\n")
    run([*uv_cmd(cache), "pip", "compile", str(req), "--python-version", prof["python"],
         "--python-platform", prof["uv_platform"], "--exclude-newer", prof["exclude_newer"],
         "--index-url", "https://pypi.org/simple", "--no-header", "--no-annotate", "-q",
         "-o", str(lock_out)])
    return read_lock(lock_out)


def wheel_fits(filename: str, python: str, platforms) -> bool:
    """Whether a wheel file's tags install on CPython `python` (X.Y) on one of `platforms`."""
    parts = filename[:-4].split("-")
    if not filename.endswith(".whl") or len(parts) < 5:
        return False
    pyt, abi, plat = (set(x.split(".")) for x in parts[-3:])
    minor = int(python.split(".")[1])
    cp = f"cp3{minor}"
    abi3 = "abi3" in abi
    py_ok = any(t in ("py3", cp) or (t.startswith("py3") and t[3:].isdigit() and int(t[3:]) <= minor)
                or (abi3 and t.startswith("cp3") and t[3:].isdigit() and int(t[3:]) <= minor)
                for t in pyt)
    abi_ok = bool(abi & {"none", "abi3", cp})
    return py_ok and abi_ok and bool(plat & set(platforms))


def _cached(name, version, dest, prof):
    return sorted(p for p in dest.glob("*.whl")
                  if cn(p.name.split("-")[0]) == cn(name) and p.name.split("-")[1] == version
                  and wheel_fits(p.name, prof["python"], prof["pip_platforms"]))


def pip_download(name: str, version: str, dest: Path, prof: dict) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    hits = _cached(name, version, dest, prof)
    if hits:
        return hits[0]
    cp = "cp" + prof["python"].replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
           f"{name}=={version}", "--only-binary=:all:", "--python-version", prof["python"],
           "--implementation", "cp", "--abi", cp, "--abi", "abi3", "--abi", "none"]
    for p in prof["pip_platforms"]:
        cmd += ["--platform", p]
    run(cmd, stdout=subprocess.DEVNULL)
    hits = _cached(name, version, dest, prof)
    if not hits:
        raise StageError(f"pip download gave no fitting wheel for {name}=={version}")
    return hits[0]


def slim_store(src, dst, drop_globs) -> int:
    """Copy a wheel, dropping members that match drop_globs, stored uncompressed (xz does it
    better). Returns the uncompressed bytes dropped."""
    dropped = 0
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zo:
        for i in zi.infolist():
            if any(fnmatch.fnmatch(i.filename, g) for g in drop_globs):
                dropped += i.file_size
                continue
            zo.writestr(i, zi.read(i.filename), compress_type=zipfile.ZIP_STORED)
    return dropped


def syslibs(prof: dict, cache: Path, dest: Path) -> list:
    """Shared libraries (by soname) from the profile's Debian packages."""
    if not prof["debs"]:
        return []
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)

    def have(pkg):
        return sorted(debs.glob(f"{pkg}_*.deb"))

    need = [d for d in prof["debs"] if not have(d)]
    if need:
        run(["apt-get", "download", *need], cwd=debs, stdout=subprocess.DEVNULL)
    x = cache / "debs-x"
    shutil.rmtree(x, ignore_errors=True)
    x.mkdir()
    for pkg in prof["debs"]:
        if not have(pkg):
            raise StageError(f"apt-get download gave no .deb for {pkg}")
        run(["dpkg-deb", "-x", str(have(pkg)[-1]), str(x)])
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for f in sorted(x.rglob("lib*.so.*")):
        if f.is_symlink() or not f.is_file() or any(s in f.parts for s in PLUGIN_DIRS):
            continue
        out = subprocess.run(["readelf", "-d", str(f)], check=False, capture_output=True,
                             text=True).stdout
        m = re.search(r"SONAME\)\s+Library soname: \[([^\]]+)\]", out)
        if m and m.group(1) not in prof["syslib_skip"]:
            shutil.copy(f, dest / m.group(1))
            names.append(m.group(1))
    return sorted(names)


def _tar_member(ti: tarfile.TarInfo) -> tarfile.TarInfo:
    # fixed owner and mtime: the same inputs give the same bundle (and sha256)
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    ti.mtime = 0
    return ti


def tracked_bytes(repo: Path = REPO) -> int | None:
    """What travels with every device call: the checkout's tracked files and the untracked
    ones git does not ignore, each rounded up to a 4 KiB block as on disk (the device tool
    refused 45.8 MiB beside 17.3 MiB of file sizes, 20.6 MiB on disk in 1565 files), or None
    outside a git checkout. scripts/device_session.py counts with it too."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                "--exclude-standard"], cwd=repo, capture_output=True,
                               check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(-(-(repo / n.decode()).stat().st_size // 4096) * 4096 for n in set(names)
               if n and (repo / n.decode()).is_file())


def part_size_for(tracked: int | None, limit: int = CARRY_LIMIT,
                  margin: int = CARRY_MARGIN) -> int:
    """The largest part (whole MB) that fits one call beside the tracked files: with the
    published runs the checkout takes about 20 MiB on disk, and a fixed 48 MB part does not
    fit beside it."""
    if tracked is None:
        return PART
    room = (limit - tracked - margin) // 1_000_000 * 1_000_000
    if room < MIN_PART:
        raise StageError(f"the checkout's tracked files ({tracked / 2**20:.1f} MiB) leave "
                         f"{max(room, 0) / 1e6:.0f} MB of a {limit / 2**20:.0f} MiB call: "
                         "no room for a part (give --part-mb)")
    return room


def resplit(out: Path, part_size: int) -> dict:
    """Cut an existing bundle in `out` (its parts, by manifest.json) again at part_size, the
    sha256 checked before and kept: the parts must shrink when the checkout grew."""
    mf = out / "manifest.json"
    if not mf.is_file():
        raise StageError(f"{mf} not found: nothing to re-cut (build the parts first)")
    manifest = json.loads(mf.read_text())
    missing = [p for p in manifest["parts"] if not (out / p).is_file()]
    if missing:
        raise StageError(f"{out}: parts missing: {', '.join(missing)}")
    whole = out / "bundle.tmp"
    sha = hashlib.sha256()
    with open(whole, "wb") as f:
        for p in manifest["parts"]:
            data = (out / p).read_bytes()
            sha.update(data)
            f.write(data)
    if sha.hexdigest() != manifest["sha256"]:
        whole.unlink()
        raise StageError(f"{out}: the parts' sha256 is not manifest.json's: rebuild them")
    try:
        parts, _ = split(whole, out, part_size)
    finally:
        whole.unlink()
    manifest["parts"] = parts
    mf.write_text(json.dumps(manifest, indent=1))
    return manifest


def split(path: Path, out: Path, part_size: int = PART) -> tuple:
    """Cut `path` into out/p0, p1, ... of part_size bytes; returns (part names, sha256)."""
    for old in out.glob("p[0-9]*"):
        old.unlink()
    sha, parts = hashlib.sha256(), []
    with open(path, "rb") as f:
        while True:
            chunk = f.read(part_size)
            if not chunk:
                break
            sha.update(chunk)
            name = f"p{len(parts)}"
            (out / name).write_bytes(chunk)
            parts.append(name)
    return parts, sha.hexdigest()


def pack(src: Path, work: Path, out: Path, part_size: int = PART, xz_preset: int = 6) -> dict:
    """tar (deterministic) -> xz -> parts in `out`. Returns the manifest fields it knows."""
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    tar = work / "bundle.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname=".", filter=_tar_member)
    xz = work / "bundle.tar.xz"
    if shutil.which("xz"):
        with open(xz, "wb") as f:
            run(["xz", f"-{xz_preset}", "-T0", "-c", str(tar)], stdout=f)
    else:
        with open(tar, "rb") as fi, lzma.open(xz, "wb", preset=xz_preset) as fo:
            shutil.copyfileobj(fi, fo, 1 << 24)
    parts, sha = split(xz, out, part_size)
    return {"parts": parts, "sha256": sha, "tar_bytes": tar.stat().st_size,
            "xz_bytes": xz.stat().st_size}


# ----------------------------------------------------------------------------------- setup.sh
SETUP = r'''#!/bin/bash
# Runs on the device machine, from the checkout root, once per carried part (idempotent).
# Copies the part to @STAGE@; when all parts of manifest.json are there it assembles them,
# checks the sha256, installs the wheels into @SITE@ (--no-index --no-deps --target), adds the
# shared libraries the device lacks, and writes @ENV@. Then: `source @ENV@`.
set -u
here=$(cd "$(dirname "$0")" && pwd)
S=@STAGE@; T=@SITE@; mkdir -p $S
cp "$here"/p[0-9]* $S/ 2>/dev/null
cp "$here/manifest.json" $S/ 2>/dev/null
if [ ! -f $T/.stage-ready ]; then
  parts=$(python3 -c "import json;print(' '.join(json.load(open('$S/manifest.json'))['parts']))")
  missing=""; for p in $parts; do [ -f $S/$p ] || missing="$missing $p"; done
  if [ -n "$missing" ]; then echo "have: $(cd $S && ls p[0-9]* 2>/dev/null | tr '\n' ' ') missing:$missing"; exit 0; fi
  want=$(python3 -c "import json;print(json.load(open('$S/manifest.json'))['sha256'])")
  (cd $S && for p in $parts; do cat $p; done) > $S/bundle.tar.xz
  got=$(sha256sum $S/bundle.tar.xz | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "CHECKSUM MISMATCH: re-carry the parts"; rm -f $S/p[0-9]* $S/bundle.tar.xz; exit 3; }
  rm -rf $S/x && mkdir -p $S/x
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1],'r:xz').extractall(sys.argv[2])" $S/bundle.tar.xz $S/x || { echo "EXTRACT FAILED"; exit 4; }
  rm -f $S/bundle.tar.xz $S/p[0-9]*
  rm -rf $T && mkdir -p $T
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $T $S/x/whl/*.whl 2>&1 | grep -v -i "already exists\|warning" | tail -5
  mkdir -p $T/_syslibs
  for f in $S/x/syslibs/*; do [ -e "$f" ] || continue; n=$(basename $f)
    ldconfig -p 2>/dev/null | grep -q "^\s*$n " || cp $f $T/_syslibs/; done
  rm -rf $S/x
  [ -d $T/@MODULE@ ] && touch $T/.stage-ready || { echo "INSTALL FAILED"; exit 5; }
fi
cu13=$(python3 -c "import os,nvidia; [print(os.path.join(p,'cu13','lib')) for p in nvidia.__path__ if os.path.isdir(os.path.join(p,'cu13','lib'))]" 2>/dev/null | head -1)
cat > @ENV@ <<ENV
@ENVCOMMENT@
export PYTHONPATH=$T@PYTHONPATH@
export PATH=$T/bin:\$PATH
export LD_LIBRARY_PATH=$T/_syslibs${cu13:+:$cu13}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
[ -z "\${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
@ENVVARS@
ENV
. @ENV@
@LDD@
out=$(python3 -c '@CHECK@; import torch, @MODULE@.version as v; print("READY @ENGINE@", getattr(v, "__version__", "@VERSION@"), "torch", torch.__version__, "gpus", torch.cuda.device_count(), "site @SITE@ env @ENV@")' 2>&1); rc=$?
echo "$out" | grep -v -i "warn" | tail -3
[ $rc = 0 ] || { echo "IMPORT CHECK FAILED (rc=$rc)"; exit 6; }
'''


def render_setup(prof: dict) -> str:
    """setup.sh for a validated profile (placeholders that expand to nothing drop their line)."""
    lines = {
        "@ENVCOMMENT@": f"# {prof['env_comment']}" if prof["env_comment"] else "",
        "@ENVVARS@": "\n".join(f"export {k}=\\${{{k}:-{v}}}" for k, v in prof["env_vars"].items()),
        "@LDD@": "\n".join(f'ldd $T/{p} 2>/dev/null | grep "not found" | sed \'s/^/{p.split("/")[0]} '
                           f'missing lib: /\'' for p in prof["ldd_check"]),
    }
    setup = SETUP
    for k, v in lines.items():
        setup = setup.replace(f"{k}\n", f"{v}\n" if v else "")
    for k, v in {"@STAGE@": prof["stage"], "@SITE@": prof["site"], "@ENV@": prof["env"],
                 "@PYTHONPATH@": "".join(f":$T/{p}" for p in prof["pythonpath"]),
                 "@CHECK@": prof["import_check"], "@MODULE@": prof["module"],
                 "@ENGINE@": prof["engine"], "@VERSION@": prof["version"]}.items():
        setup = setup.replace(k, v)
    return setup


def write_setup(prof: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "setup.sh"
    path.write_text(render_setup(prof))
    path.chmod(0o755)
    return path


# --------------------------------------------------------------------------------------- main
def build(prof: dict, pins: dict, image: set, out: Path, cache: Path, full: bool = False,
          xz_preset: int = 6, part_size: int = PART, check_only: bool = False) -> dict:
    chosen = select(pins, prof["keep"], image, prof["force"], full=full)
    wheels = {n: pip_download(n, pins[n], cache / "raw", prof) for n in chosen}
    check_requirements({n: wheel_requires(w) for n, w in wheels.items()}, chosen, image, prof)
    if check_only:
        print(f"{len(chosen)} wheels: every Requires-Dist is carried, on the image, or dropped")
        return {}
    # A work folder per bundle: two builds at once (0.1.0 and 0.1.1) share raw/ and debs/ but
    # never each other's tar.
    work = cache / "pack" / f"{prof['engine']}-{prof['version']}"
    shutil.rmtree(work, ignore_errors=True)
    tree = work / "tree"                                  # what the tar holds
    (tree / "whl").mkdir(parents=True)
    rows = []
    for n, w in wheels.items():
        dst = tree / "whl" / w.name
        dropped = slim_store(w, dst, prof["slim"].get(n, []))
        rows.append((w.name, w.stat().st_size, dst.stat().st_size, dropped))
    libs = syslibs(prof, cache, tree / "syslibs")
    lock_txt = "".join(f"{n}=={pins[n]}\n" for n in chosen)
    (tree / "wheels.lock").write_text(lock_txt)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wheels.lock").write_text(lock_txt)
    packed = pack(tree, work, out, part_size=part_size, xz_preset=xz_preset)
    write_setup(prof, out)
    manifest = {"parts": packed["parts"], "sha256": packed["sha256"], "engine": prof["engine"],
                "version": prof["version"], "exclude_newer": prof["exclude_newer"],
                "wheels": lock_txt.split(), "syslibs": libs, "tar_bytes": packed["tar_bytes"],
                "xz_bytes": packed["xz_bytes"]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{'wheel':<95} {'pypi MB':>8} {'stored MB':>9} {'slimmed MB':>10}")
    for name, s0, s1, d in rows:
        print(f"{name:<95} {s0 / 1e6:8.1f} {s1 / 1e6:9.1f} {d / 1e6:10.1f}")
    print(f"{len(rows)} wheels: {sum(r[1] for r in rows) / 1e6:.0f} MB as on PyPI; tar "
          f"{packed['tar_bytes'] / 1e6:.0f} MB -> xz {packed['xz_bytes'] / 1e6:.0f} MB in "
          f"{len(packed['parts'])} parts under {out}/; syslibs: {len(libs)}")
    for p in packed["parts"]:
        print(f"  run: carry [\"{out}/{p}\", \"{out}/setup.sh\", \"{out}/manifest.json\"]  "
              f"command: bash {out}/setup.sh")
    return manifest


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="scripts/stage_profiles/<engine>-<ver>.yaml")
    ap.add_argument("--out", required=True, help="folder for the parts (keep it git-ignored)")
    ap.add_argument("--image-packages", default=None,
                    help="names of the packages already on the target image (whitespace-"
                         f"separated); default {DEFAULT_IMAGE_PACKAGES} if it exists")
    ap.add_argument("--lock", help="use this pinned closure (name==version lines) instead of "
                                   "resolving (needs no uv, no index for resolution)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/stage-offline"),
                    help="downloads (raw/, debs/) and work files (default %(default)s)")
    ap.add_argument("--exclude-newer", help="override the profile's resolution date (YYYY-MM-DD)")
    ap.add_argument("--full", action="store_true",
                    help="carry the whole closure minus the image, not just keep")
    ap.add_argument("--xz-preset", type=int, default=6, choices=range(10), metavar="0-9")
    ap.add_argument("--setup-only", action="store_true", help="only (re)write setup.sh in --out")
    ap.add_argument("--check-only", action="store_true",
                    help="only fetch the wheels and check their Requires-Dist; build nothing")
    ap.add_argument("--part-mb", type=int, default=None,
                    help="part size in MB (default: what fits a 64 MiB call beside the "
                         "checkout's tracked files)")
    ap.add_argument("--resplit", action="store_true",
                    help="only cut the parts already in --out again at the part size")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        prof = load_profile(a.profile)
        out = Path(a.out)
        if a.part_mb is not None and a.part_mb * 1_000_000 < MIN_PART:
            raise StageError(f"--part-mb {a.part_mb}: below {MIN_PART // 1_000_000} MB")
        part_size = (a.part_mb * 1_000_000 if a.part_mb is not None
                     else part_size_for(tracked_bytes()))
        if a.resplit:
            m = resplit(out, part_size)
            print(f"{len(m['parts'])} parts of at most {part_size / 1e6:.0f} MB in {out}/ "
                  f"(sha256 {m['sha256'][:12]}, unchanged)")
            return 0
        if a.setup_only:
            print(write_setup(prof, out))
            return 0
        if a.exclude_newer:
            if not _DATE.match(a.exclude_newer):
                raise StageError(f"--exclude-newer {a.exclude_newer!r} is not a date (YYYY-MM-DD)")
            prof["exclude_newer"] = a.exclude_newer
        if a.image_packages is None:
            if not DEFAULT_IMAGE_PACKAGES.is_file():
                raise StageError(f"--image-packages FILE is required ({DEFAULT_IMAGE_PACKAGES} "
                                 "does not exist)")
            a.image_packages = str(DEFAULT_IMAGE_PACKAGES)
        if not Path(a.image_packages).is_file():
            raise StageError(f"image packages file not found: {a.image_packages}")
        image = read_image_packages(a.image_packages)
        if a.lock and not Path(a.lock).is_file():
            raise StageError(f"lock file not found: {a.lock}")
        cache = Path(a.cache)
        cache.mkdir(parents=True, exist_ok=True)
        if a.lock:
            pins = read_lock(a.lock)
            if not pins:
                raise StageError(f"{a.lock}: no name==version lines")
        else:
            pins = resolve(prof, cache, cache / "closure.lock")
        select(pins, prof["keep"], image, prof["force"], full=a.full)  # fail before downloads
        build(prof, pins, image, out, cache, full=a.full, xz_preset=a.xz_preset,
              part_size=part_size, check_only=a.check_only)
        return 0
    except StageError as e:
        print(f"stage_offline: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
