"""scripts/stage_offline.py: profile validation, selection, slimming, packing, setup.sh.

No network: nothing here resolves or downloads (pip_download is made to fail where a test
would reach it)."""

import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "scripts" / "stage_profiles" / "tokenspeed-0.1.0.yaml"
LOCK = REPO / "scripts" / "stage_profiles" / "tokenspeed-0.1.0.lock"
PROFILE_011 = REPO / "scripts" / "stage_profiles" / "tokenspeed-0.1.1.yaml"
LOCK_011 = REPO / "scripts" / "stage_profiles" / "tokenspeed-0.1.1.lock"
# torch 2.14.0's pins that differ from torch 2.11.0's (the image's)
TORCH_214 = {"torch": "2.14.0", "triton": "3.8.0", "torchvision": "0.29.1",
             "nvidia-cublas": "13.1.1.3", "nvidia-cudnn-cu13": "9.24.0.43",
             "nvidia-cusparselt-cu13": "0.8.1", "nvidia-nccl-cu13": "2.30.7"}


def _load():
    spec = importlib.util.spec_from_file_location("stage_offline",
                                                  REPO / "scripts" / "stage_offline.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["stage_offline"] = mod
    spec.loader.exec_module(mod)
    return mod


so = _load()


def _minimal(**over):
    prof = {"engine": "fakeeng", "version": "0.1", "roots": ["fakeeng==0.1"],
            "exclude_newer": "2026-07-25", "keep": ["fakeeng", "dep-a"], "stage": "/tmp/s",
            "site": "/tmp/site", "env": "/tmp/env.sh", "import_check": "import fakeeng"}
    prof.update(over)
    return {k: v for k, v in prof.items() if v is not None}


def _raw_profile():
    return yaml.safe_load(PROFILE.read_text())


@pytest.fixture
def no_download(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a download was attempted")
    monkeypatch.setattr(so, "pip_download", boom)
    monkeypatch.setattr(so, "resolve", boom)
    monkeypatch.setattr(so, "syslibs", boom)


# ------------------------------------------------------------------------------ the profile
def test_tokenspeed_profile_loads():
    prof = so.load_profile(PROFILE)
    assert prof["engine"] == "tokenspeed" and prof["version"] == "0.1.0"
    assert prof["exclude_newer"] == "2026-07-25"
    assert prof["module"] == "tokenspeed"
    assert set(prof["force"]) == {"grpcio", "protobuf"}
    assert len(prof["keep"]) == 36
    assert "tokenspeed-smg" in prof["dropped"]
    assert "tokenspeed-triton" in prof["slim"]
    assert prof["env_vars"] == {"MC_FORCE_TCP": "1"}


def test_tokenspeed_lock_covers_keep():
    pins = so.read_lock(LOCK)
    prof = so.load_profile(PROFILE)
    assert {so.cn(k) for k in prof["keep"]} == set(pins)


def test_tokenspeed_011_profile_and_lock():
    prof = so.load_profile(PROFILE_011)
    assert prof["version"] == "0.1.1" and prof["exclude_newer"] == "2026-10-07"
    assert "tokenspeed==0.1.1" in prof["roots"] and "tokenspeed-kernel==0.1.4" in prof["roots"]
    pins = so.read_lock(LOCK_011)
    assert {so.cn(k) for k in prof["keep"]} == set(pins)
    assert pins["tokenspeed"] == "0.1.1" and pins["tokenspeed-kernel"] == "0.1.4"
    assert {k: pins[k] for k in TORCH_214} == TORCH_214
    assert "tokenspeed-triton-kernels" not in pins      # 0.1.0 kept it; 0.1.1's closure lacks it
    # tokenspeed-kernel 0.1.4 imports deep_ep and trtllm_kernel (`if is_nvidia`) and flash_mla
    # (`if is_hopper_plus`) at module level: carried, not dropped
    for name in ("tokenspeed-deepep", "tokenspeed-trtllm-kernel", "tokenspeed-flashmla"):
        assert name in pins and name not in prof["dropped"]
    # its own device folders: setup.sh skips the install where a site is already marked ready
    old = so.load_profile(PROFILE)
    assert all(prof[k] != old[k] for k in ("stage", "site", "env"))


def test_select_tokenspeed_011_carries_torch_over_the_image():
    """The image has torch 2.11 and its CUDA wheels: force carries torch 2.14's instead, and
    leaves the CUDA wheels whose pins are the same (nvjitlink, cudart, nvshmem) to the image."""
    prof = so.load_profile(PROFILE_011)
    pins = so.read_lock(LOCK_011)
    image = {"torch", "triton", "torchvision", "grpcio", "protobuf", "numpy", "transformers",
             "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-cusparselt-cu13", "nvidia-nccl-cu13",
             "nvidia-nvjitlink", "nvidia-cuda-runtime", "nvidia-nvshmem-cu13"}
    chosen = so.select(pins, prof["keep"], image, prof["force"])
    assert set(TORCH_214) <= set(chosen) and len(chosen) == len(pins)
    unforced = [x for x in prof["force"] if x not in ("torch", "triton", "torchvision")]
    chosen = so.select(pins, prof["keep"], image, unforced)
    assert not {"torch", "triton", "torchvision"} & set(chosen)   # without force: the image's


def test_minimal_profile_gets_defaults():
    prof = so.validate_profile(_minimal())
    assert prof["module"] == "fakeeng"
    assert prof["python"] == "3.12" and prof["force"] == [] and prof["slim"] == {}
    assert prof["pip_platforms"] == so.PIP_PLATFORMS


@pytest.mark.parametrize("data, needle", [
    (_minimal(keep=None), "missing key(s): keep"),
    (_minimal(site=None, env=None), "missing key(s): site, env"),
    (_minimal(colour="blue"), "unknown key(s): colour"),
    (_minimal(keep="fakeeng"), "keep must be a list"),
    (_minimal(keep=[]), "must not be empty"),
    (_minimal(version=1.0), "version must be a str, got float (quote it)"),
    (_minimal(exclude_newer="last tuesday"), "is not a date"),
    (_minimal(force=["grpcio"]), "force names not in keep: grpcio"),
    (_minimal(slim={"other": ["x/*"]}), "slim names not in keep: other"),
    (_minimal(slim={"dep-a": "x/*"}), "slim: dep-a must map to a list of globs"),
    (_minimal(dropped={"dep_a": "why"}), "names both kept and dropped: dep_a"),
    (_minimal(site="relative/site"), "site 'relative/site' must be an absolute path"),
    (_minimal(import_check="import 'x'"), "without single quotes"),
    (_minimal(env_vars={"A B": "1"}), "is not a variable name"),
    (_minimal(env_vars={"A": "$(rm -rf /)"}), "must be a plain string"),
    (_minimal(pythonpath=["../up"]), "relative path under site"),
    (_minimal(python="3"), "must be 3.X"),
    (["not", "a", "mapping"], "not a mapping"),
])
def test_profile_validation_errors(data, needle):
    with pytest.raises(so.StageError) as e:
        so.validate_profile(data, "p.yaml")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("p.yaml: ")


def test_unquoted_yaml_date_is_accepted(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(_minimal()).replace("'2026-07-25'", "2026-07-25"))
    assert "exclude_newer: 2026-07-25\n" in p.read_text()
    assert so.load_profile(p)["exclude_newer"] == "2026-07-25"


def test_bad_yaml_and_missing_profile(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("engine: [unclosed\n")
    with pytest.raises(so.StageError, match="not valid YAML"):
        so.load_profile(p)
    with pytest.raises(so.StageError, match="profile not found"):
        so.load_profile(tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------- the CLI errors
def _cli(capsys, *args):
    rc = so.main(list(args))
    err = capsys.readouterr().err
    return rc, err


def test_cli_missing_profile_is_one_line(tmp_path, capsys, no_download):
    rc, err = _cli(capsys, "--profile", str(tmp_path / "x.yaml"), "--out", str(tmp_path / "o"))
    assert rc == 2 and err.count("\n") == 1 and "profile not found" in err


def test_cli_unknown_key_is_one_line(tmp_path, capsys, no_download):
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(_minimal(extra=1)))
    rc, err = _cli(capsys, "--profile", str(p), "--out", str(tmp_path / "o"),
                   "--image-packages", str(p))
    assert rc == 2 and err.count("\n") == 1 and "unknown key(s): extra" in err


def test_cli_missing_files_fail_before_any_download(tmp_path, capsys, no_download):
    img = tmp_path / "img.txt"
    img.write_text("torch numpy\n")
    base = ["--profile", str(PROFILE), "--out", str(tmp_path / "o"), "--cache", str(tmp_path / "c")]
    rc, err = _cli(capsys, *base, "--image-packages", str(tmp_path / "none.txt"))
    assert rc == 2 and "image packages file not found" in err and err.count("\n") == 1
    rc, err = _cli(capsys, *base, "--image-packages", str(img), "--lock", str(tmp_path / "no.lock"))
    assert rc == 2 and "lock file not found" in err and err.count("\n") == 1
    short = tmp_path / "short.lock"
    short.write_text("tokenspeed==0.1.0\n")
    rc, err = _cli(capsys, *base, "--image-packages", str(img), "--lock", str(short))
    assert rc == 2 and "keep names not in the resolved closure" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_cli_image_packages_default(tmp_path, capsys, monkeypatch, no_download):
    monkeypatch.setattr(so, "DEFAULT_IMAGE_PACKAGES", tmp_path / "absent.txt")
    rc, err = _cli(capsys, "--profile", str(PROFILE), "--out", str(tmp_path / "o"),
                   "--lock", str(LOCK))
    assert rc == 2 and err.count("\n") == 1
    assert "--image-packages FILE is required" in err and "absent.txt" in err


def test_cli_setup_only_needs_no_image_packages(tmp_path, capsys, monkeypatch, no_download):
    monkeypatch.setattr(so, "DEFAULT_IMAGE_PACKAGES", tmp_path / "absent.txt")
    assert so.main(["--profile", str(PROFILE), "--out", str(tmp_path / "o"), "--setup-only"]) == 0
    assert (tmp_path / "o" / "setup.sh").is_file()


# --------------------------------------------------------------------------------- selection
def test_read_lock_and_image_packages(tmp_path):
    lock = tmp_path / "l"
    lock.write_text("# comment\nFoo_Bar==1.0 ; python_version >= '3'\n"
                    "    # via x\nbaz.qux==2.0.post1\n-e ./local\n")
    assert so.read_lock(lock) == {"foo-bar": "1.0", "baz-qux": "2.0.post1"}
    img = tmp_path / "i"
    img.write_text("torch numpy Jinja2\ngrpcio==1.70 # pinned\n# all\n")
    assert so.read_image_packages(img) == {"torch", "numpy", "jinja2", "grpcio"}


def test_select_closure_keep_image_force():
    pins = {"eng": "1", "dep-a": "1", "dep-b": "1", "grpcio": "1", "numpy": "1", "notkept": "1"}
    image = {"dep-b", "grpcio", "numpy", "torch"}
    chosen = so.select(pins, ["Eng", "dep_a", "dep-b", "grpcio", "numpy"], image, ["grpcio"])
    # kept and in the closure, minus the image (dep-b, numpy), plus forced grpcio; never notkept
    assert chosen == ["dep-a", "eng", "grpcio"]


def test_select_full_and_errors():
    pins = {"eng": "1", "dep-a": "1", "numpy": "1"}
    assert so.select(pins, ["eng"], {"numpy"}, [], full=True) == ["dep-a", "eng"]
    with pytest.raises(so.StageError, match="keep names not in the resolved closure: typo"):
        so.select(pins, ["eng", "typo"], set(), [])
    with pytest.raises(so.StageError, match="nothing to carry"):
        so.select(pins, ["numpy"], {"numpy"}, [])


def test_select_tokenspeed_lock_against_an_image():
    prof = so.load_profile(PROFILE)
    pins = so.read_lock(LOCK)
    image = {"grpcio", "protobuf", "pydantic", "fastapi", "torch"}
    chosen = so.select(pins, prof["keep"], image, prof["force"])
    assert "grpcio" in chosen and "protobuf" in chosen  # forced
    assert "pydantic" not in chosen and "fastapi" not in chosen
    assert len(chosen) == 34


# ----------------------------------------------------------------------- Requires-Dist check
FAKE_REQUIRES = {
    "eng": ["dep-a>=1", "NumPy", "opt-thing==2; python_version >= '3.8'",
            "dev-tool; extra == 'dev'", "win-only; sys_platform == 'win32'",
            "old-py; python_version < '3.10'", "dep-b[extra1]"],
    "dep-a": ["dep_b"],
    "dep-b": [],
}


def _check(carried, image=frozenset({"numpy"}), dropped=None):
    prof = so.validate_profile(_minimal(keep=list(carried),
                                        dropped=dropped if dropped is not None
                                        else {"opt-thing": "lazy import"}))
    requires = {n: FAKE_REQUIRES[n] for n in carried}
    so.check_requirements(requires, carried, set(image), prof)


def test_requirements_complete_closure_passes():
    """Carried (dep-a, dep-b[extra1] by name), on the image (NumPy), dropped (opt-thing); the
    markers of the target drop dev-tool (an extra), win-only and old-py."""
    _check(["eng", "dep-a", "dep-b"])


def test_requirements_missing_one_is_named():
    with pytest.raises(so.StageError) as e:
        _check(["eng", "dep-b"])
    msg = str(e.value)
    assert "\n" not in msg and "dep-a (by eng)" in msg and "opt-thing" not in msg
    with pytest.raises(so.StageError, match=r": numpy \(by eng\)$"):
        _check(["eng", "dep-a", "dep-b"], image=set())
    with pytest.raises(so.StageError, match=r": opt-thing \(by eng\)$"):
        _check(["eng", "dep-a", "dep-b"], dropped={})
    with pytest.raises(so.StageError, match=r"dep-b \(by dep-a, eng\)"):
        _check(["eng", "dep-a"])


def test_requirements_markers_follow_the_profile_python():
    prof = so.validate_profile(_minimal(python="3.9"))
    with pytest.raises(so.StageError, match=r": old-py \(by eng\)$"):
        so.check_requirements({"eng": FAKE_REQUIRES["eng"]}, ["eng", "dep-a", "dep-b"],
                              {"numpy", "opt-thing"}, prof)


def test_requirements_unreadable_line_is_one_line_error():
    prof = so.validate_profile(_minimal())
    with pytest.raises(so.StageError, match="eng: unreadable Requires-Dist 'not a req !!'"):
        so.check_requirements({"eng": ["not a req !!"]}, ["eng"], set(), prof)


def _meta_wheel(path, name, requires):
    meta = (f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires)
            + "\nRequires-Dist: in-the-description\n")
    return _wheel(path, {f"{name.replace('-', '_')}/__init__.py": "",
                         f"{name.replace('-', '_')}-0.1.dist-info/METADATA": meta})


def test_wheel_requires_reads_the_headers_only(tmp_path):
    w = _meta_wheel(tmp_path / "eng-0.1-py3-none-any.whl", "eng", ["dep-a>=1", "x; extra == 'dev'"])
    assert so.wheel_requires(w) == ["dep-a>=1", "x; extra == 'dev'"]


def test_build_checks_requirements_before_packing(tmp_path, monkeypatch):
    """The wheels in the cache (no download): build stops before packing, naming what the
    carried wheels require and nobody provides; complete, --check-only builds nothing."""
    monkeypatch.setattr(so, "syslibs", lambda *a, **k: pytest.fail("packing began"))
    raw = tmp_path / "cache" / "raw"
    raw.mkdir(parents=True)
    for n in ("eng", "dep-a", "dep-b"):
        _meta_wheel(raw / f"{n.replace('-', '_')}-0.1-py3-none-any.whl", n, FAKE_REQUIRES[n])
    pins = {"eng": "0.1", "dep-a": "0.1", "dep-b": "0.1", "opt-thing": "2"}
    out = tmp_path / "out"
    prof = so.validate_profile(_minimal(keep=["eng", "dep-b"], dropped={"opt-thing": "lazy"}))
    with pytest.raises(so.StageError, match=r"dropped \(add to keep.*\): dep-a \(by eng\)$"):
        so.build(prof, pins, {"numpy"}, out, tmp_path / "cache")
    assert not out.exists() and not (tmp_path / "cache" / "pack").exists()
    prof = so.validate_profile(_minimal(keep=["eng", "dep-a", "dep-b"],
                                        dropped={"opt-thing": "lazy"}))
    assert so.build(prof, pins, {"numpy"}, out, tmp_path / "cache", check_only=True) == {}
    assert not out.exists()


def test_two_builds_in_one_cache_keep_their_own_trees(tmp_path, monkeypatch):
    """Each bundle packs in its own work folder of the shared cache: a second version built
    into the same cache (also while the first still runs) leaves the first's tree alone, so
    the first bundle holds none of the second's wheels."""
    monkeypatch.setattr(so, "syslibs", lambda *a, **k: [])
    monkeypatch.setattr(so, "write_setup", lambda *a, **k: None)
    raw = tmp_path / "cache" / "raw"
    raw.mkdir(parents=True)
    for n in ("eng", "dep-a", "dep-b"):
        _meta_wheel(raw / f"{n.replace('-', '_')}-0.1-py3-none-any.whl", n, FAKE_REQUIRES[n])
    pins = {"eng": "0.1", "dep-a": "0.1", "dep-b": "0.1", "opt-thing": "2"}
    kw = dict(keep=["eng", "dep-a", "dep-b"], dropped={"opt-thing": "lazy"})
    one = so.validate_profile(_minimal(version="0.1", **kw))
    two = so.validate_profile(_minimal(version="0.2", **{**kw, "keep": ["eng", "dep-b"],
                                                         "dropped": {"opt-thing": "lazy",
                                                                     "dep-a": "x"}}))
    cache = tmp_path / "cache"
    m1 = so.build(one, pins, {"numpy"}, tmp_path / "o1", cache, xz_preset=0)
    so.build(two, pins, {"numpy"}, tmp_path / "o2", cache, xz_preset=0)
    trees = sorted(p.name for p in (cache / "pack").iterdir())
    assert trees == ["fakeeng-0.1", "fakeeng-0.2"]
    held = sorted(p.name for p in (cache / "pack" / "fakeeng-0.1" / "tree" / "whl").iterdir())
    assert held == ["dep_a-0.1-py3-none-any.whl", "dep_b-0.1-py3-none-any.whl",
                    "eng-0.1-py3-none-any.whl"]
    # the first bundle's xz is still the one its manifest names
    import hashlib
    got = hashlib.sha256((cache / "pack" / "fakeeng-0.1" / "bundle.tar.xz").read_bytes())
    assert got.hexdigest() == m1["sha256"]


def test_cli_check_only_names_the_missing_requirement(tmp_path, capsys, monkeypatch):
    raw = tmp_path / "cache" / "raw"
    raw.mkdir(parents=True)
    for n in ("eng", "dep-a", "dep-b"):
        _meta_wheel(raw / f"{n.replace('-', '_')}-0.1-py3-none-any.whl", n, FAKE_REQUIRES[n])
    lock = tmp_path / "l.lock"
    lock.write_text("eng==0.1\ndep-a==0.1\ndep-b==0.1\n")
    img = tmp_path / "img.txt"
    img.write_text("numpy\n")
    prof = tmp_path / "p.yaml"
    base = ["--profile", str(prof), "--out", str(tmp_path / "o"), "--lock", str(lock),
            "--image-packages", str(img), "--cache", str(tmp_path / "cache"), "--check-only"]
    prof.write_text(yaml.safe_dump(_minimal(keep=["eng", "dep-a", "dep-b"])))
    rc, err = _cli(capsys, *base)
    assert rc == 2 and err.count("\n") == 1 and err.rstrip().endswith(": opt-thing (by eng)")
    prof.write_text(yaml.safe_dump(_minimal(keep=["eng", "dep-a", "dep-b"],
                                            dropped={"opt-thing": "lazy"})))
    rc, err = _cli(capsys, *base)
    assert rc == 0 and err == "" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name, ok", [
    ("a-1.0-py3-none-any.whl", True),
    ("a-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
    ("a-1.0-cp39-abi3-manylinux2014_x86_64.whl", True),
    ("a-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", False),
    ("a-1.0-cp313-abi3-manylinux_2_17_x86_64.whl", False),
    ("a-1.0-cp312-cp312-manylinux_2_28_aarch64.whl", False),
    ("a-1.0-cp312-cp312-win_amd64.whl", False),
    ("a-1.0-py2.py3-none-manylinux_2_5_x86_64.manylinux1_x86_64.whl", True),
    ("nvidia_nccl_cu13-2.30.7-py3-none-manylinux_2_18_x86_64.whl", True),
    ("nvidia_nvjitlink-13.4.92-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl", True),
    ("a-1.0-cp312-cp312-manylinux_2_40_x86_64.whl", False),
])
def test_wheel_fits(name, ok):
    assert so.wheel_fits(name, "3.12", so.PIP_PLATFORMS) is ok


def test_pip_platforms_are_every_glibc_up_to_the_target():
    """pip matches --platform tags exactly: a manylinux_2_X missing from the list (2_18:
    nvidia-nccl-cu13) makes `pip download` find no wheel although the target installs it."""
    tags = so.PIP_PLATFORMS
    glibc = [int(t.split("_")[2]) for t in tags if t.startswith("manylinux_2_")]
    assert glibc == list(range(39, 4, -1))                       # newest first, none skipped
    for legacy, twin in (("manylinux2014", 17), ("manylinux2010", 12), ("manylinux1", 5)):
        assert tags.index(f"{legacy}_x86_64") == tags.index(f"manylinux_2_{twin}_x86_64") + 1
    assert tags[-2:] == ["linux_x86_64", "any"]
    without = [t for t in tags if t != "manylinux_2_18_x86_64"]  # a list that skips 2_18
    assert not so.wheel_fits("nvidia_nccl_cu13-2.30.7-py3-none-manylinux_2_18_x86_64.whl",
                             "3.12", without)


# ----------------------------------------------------------------------------- slim and pack
def _wheel(path, files):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_slim_store_drops_and_stores_uncompressed(tmp_path):
    files = {"pkg/__init__.py": b"x = 1\n" * 100, "pkg/web_dist/index.html": b"<html>" * 500,
             "pkg/web_dist/app.js": b"js" * 300, "pkg/bin/ptxas-blackwell": b"\0" * 1000,
             "pkg/bin/ptxas": b"\1" * 700, "pkg-1.0.dist-info/RECORD": b"r\n"}
    src = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", files)
    dst = tmp_path / "out.whl"
    dropped = so.slim_store(src, dst, ["pkg/web_dist/*", "pkg/bin/ptxas-blackwell"])
    assert dropped == 3000 + 600 + 1000
    with zipfile.ZipFile(dst) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py",
                                        "pkg/bin/ptxas"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert z.read("pkg/bin/ptxas") == files["pkg/bin/ptxas"]
    assert so.slim_store(src, tmp_path / "same.whl", []) == 0


def _fake_pack_dir(root):
    (root / "whl").mkdir(parents=True)
    (root / "syslibs").mkdir()
    noise = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(200))  # 6.4 kB
    (root / "whl" / "a.whl").write_bytes(noise)
    (root / "syslibs" / "libx.so.1").write_bytes(b"\x7fELF" + b"\3" * 5000)
    (root / "wheels.lock").write_text("a==1\n")
    return root


def test_pack_split_manifest_round_trip(tmp_path):
    src = _fake_pack_dir(tmp_path / "pack")
    out = tmp_path / "out"
    out.mkdir()
    (out / "p9").write_bytes(b"stale part")
    packed = so.pack(src, tmp_path / "work", out, part_size=1000, xz_preset=0)
    n = -(-packed["xz_bytes"] // 1000)
    assert n >= 2 and packed["parts"] == [f"p{i}" for i in range(n)]
    assert sorted(p.name for p in out.glob("p*")) == sorted(packed["parts"])  # stale p9 gone
    assert all((out / p).stat().st_size == 1000 for p in packed["parts"][:-1])
    data = b"".join((out / p).read_bytes() for p in packed["parts"])
    assert len(data) == packed["xz_bytes"]
    assert hashlib.sha256(data).hexdigest() == packed["sha256"]
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as t:
        names = {m.name.lstrip("./") for m in t.getmembers() if m.isfile()}
        assert names == {"whl/a.whl", "syslibs/libx.so.1", "wheels.lock"}
        assert t.extractfile("./whl/a.whl").read() == (src / "whl" / "a.whl").read_bytes()
    again = so.pack(src, tmp_path / "work2", tmp_path / "out2", part_size=1000, xz_preset=0)
    assert again["sha256"] == packed["sha256"]  # deterministic tar: same inputs, same bundle


def test_split_exact_multiple(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"z" * 3000)
    parts, sha = so.split(f, tmp_path, part_size=1000)
    assert parts == ["p0", "p1", "p2"] and sha == hashlib.sha256(b"z" * 3000).hexdigest()


# ---------------------------------------------------------------------------------- setup.sh
def test_setup_sh_passes_bash_n(tmp_path):
    for prof in (so.load_profile(PROFILE), so.load_profile(PROFILE_011),
                 so.validate_profile(_minimal())):
        path = so.write_setup(prof, tmp_path / f"{prof['engine']}-{prof['version']}")
        r = subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        assert "@" not in path.read_text().replace("$@", "")  # every placeholder filled


def test_setup_sh_tokenspeed_content():
    text = so.render_setup(so.load_profile(PROFILE))
    assert "S=/root/stage/ts; T=/tmp/ts-site;" in text
    assert "cat > /root/stage/ts-env.sh <<ENV" in text
    assert "export PYTHONPATH=$T:$T/nvidia_cutlass_dsl/dsl_packages\n" in text
    assert "export MC_FORCE_TCP=\\${MC_FORCE_TCP:-1}\n" in text
    assert "ldd $T/mooncake/engine.so" in text and "[ -d $T/tokenspeed ]" in text
    assert "READY tokenspeed" in text


def test_setup_sh_matches_the_one_used_on_the_h200():
    """tests/data/ts-stage-setup.sh is the script that installed TokenSpeed on the H200 (the
    git-ignored .ts-stage/setup.sh of those runs, copied); a checkout that has
    its own .ts-stage/setup.sh is held to it too."""
    rendered = so.render_setup(so.load_profile(PROFILE))
    assert rendered == (REPO / "tests" / "data" / "ts-stage-setup.sh").read_text()
    used = REPO / ".ts-stage" / "setup.sh"
    if used.is_file():
        assert rendered == used.read_text()


def test_setup_sh_minimal_profile_drops_optional_lines():
    text = so.render_setup(so.validate_profile(_minimal()))
    assert "ldd " not in text and "export PYTHONPATH=$T\n" in text
    assert "cat > /tmp/env.sh <<ENV\nexport PYTHONPATH" in text
    assert "export CUDA_HOME=/usr/local/cuda\nENV\n. /tmp/env.sh\nout=$(" in text


def _fake_engine_wheel(path):
    files = {"fakeeng/__init__.py": "", "fakeeng/version.py": "__version__ = '0.1'\n",
             "fakeeng-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakeeng\nVersion: 0.1\n",
             "fakeeng-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
                                            "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    files["fakeeng-0.1.dist-info/RECORD"] = "".join(f"{n},,\n" for n in files) + \
        "fakeeng-0.1.dist-info/RECORD,,\n"
    return _wheel(path, files)


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs sha256sum")
def test_setup_sh_assembles_parts_carried_one_at_a_time(tmp_path):
    """The device flow on this machine: each call brings one part; the last one installs."""
    r = subprocess.run(["python3", "-m", "pip", "--version"], check=False, capture_output=True)
    if r.returncode != 0:
        pytest.skip("python3 has no pip")
    prof = so.validate_profile(_minimal(stage=str(tmp_path / "stage"), site=str(tmp_path / "site"),
                                        env=str(tmp_path / "env.sh"), env_vars={"MC_FORCE_TCP": "1"},
                                        keep=["fakeeng"]))
    src = tmp_path / "pack"
    (src / "whl").mkdir(parents=True)
    _fake_engine_wheel(src / "whl" / "fakeeng-0.1-py3-none-any.whl")
    built = tmp_path / "built"
    packed = so.pack(src, tmp_path / "work", built, part_size=300, xz_preset=0)
    assert len(packed["parts"]) >= 2
    (built / "manifest.json").write_text(json.dumps(packed))
    so.write_setup(prof, built)
    outs = []
    for p in packed["parts"]:  # a fresh checkout per call, carrying one part
        call = tmp_path / f"call-{p}" / ".stage"
        call.mkdir(parents=True)
        for f in (p, "setup.sh", "manifest.json"):
            shutil.copy(built / f, call / f)
        r = subprocess.run(["bash", str(call / "setup.sh")], check=False, capture_output=True,
                           text=True, cwd=call.parent)
        outs.append((r.returncode, r.stdout + r.stderr))
    for rc, out in outs[:-1]:
        assert rc == 0 and "missing:" in out, out
    rc, out = outs[-1]
    assert (tmp_path / "site" / ".stage-ready").is_file(), out
    assert (tmp_path / "site" / "fakeeng" / "version.py").is_file()
    env = (tmp_path / "env.sh").read_text()
    assert f"export PYTHONPATH={tmp_path / 'site'}\n" in env
    assert "export MC_FORCE_TCP=${MC_FORCE_TCP:-1}\n" in env
    # the READY check imports torch: passes where torch is installed, exit 6 otherwise
    assert (rc == 0 and "READY fakeeng 0.1" in out) or (rc == 6 and "IMPORT CHECK FAILED" in out)


# ------------------------------------------------------------------------- part size, resplit
def test_part_size_leaves_room_for_the_checkout():
    """20.6 MiB of tracked files on disk (with the published runs): a 48 MB part does not
    fit a 64 MiB call beside them; the cut is what does, in whole MB."""
    tracked = int(20.59 * 2**20)
    size = so.part_size_for(tracked)
    assert size % 1_000_000 == 0
    assert tracked + size + so.CARRY_MARGIN <= so.CARRY_LIMIT
    assert tracked + size + 1_000_000 + so.CARRY_MARGIN > so.CARRY_LIMIT   # the largest
    assert tracked + so.PART + so.CARRY_MARGIN > so.CARRY_LIMIT            # the fixed cut: too big
    assert so.part_size_for(None) == so.PART


def test_part_size_refuses_a_checkout_that_leaves_no_room():
    with pytest.raises(so.StageError, match=r"tracked files \(60\.0 MiB\) leave .* no room"):
        so.part_size_for(60 * 2**20)


def test_tracked_bytes_counts_this_checkout():
    n = so.tracked_bytes()
    assert n is not None and n > (so.REPO / "scripts" / "stage_offline.py").stat().st_size
    assert n % 4096 == 0


def test_resplit_keeps_the_bundle(tmp_path):
    blob = bytes(range(256)) * 40                      # 10240 bytes
    (tmp_path / "whole").write_bytes(blob)
    parts, sha = so.split(tmp_path / "whole", tmp_path, part_size=4000)
    (tmp_path / "whole").unlink()
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": parts, "sha256": sha}))
    m = so.resplit(tmp_path, 3000)
    assert m["parts"] == ["p0", "p1", "p2", "p3"] and m["sha256"] == sha
    assert b"".join((tmp_path / p).read_bytes() for p in m["parts"]) == blob
    assert json.loads((tmp_path / "manifest.json").read_text())["parts"] == m["parts"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "p0", "p1", "p2", "p3"]


def test_resplit_refuses_parts_that_are_not_the_manifests(tmp_path):
    (tmp_path / "whole").write_bytes(b"x" * 5000)
    parts, sha = so.split(tmp_path / "whole", tmp_path, part_size=2000)
    (tmp_path / "whole").unlink()
    (tmp_path / "manifest.json").write_text(json.dumps({"parts": parts, "sha256": sha}))
    (tmp_path / "p1").write_bytes(b"y" * 2000)          # a stale part from another build
    with pytest.raises(so.StageError, match="sha256 is not manifest.json's"):
        so.resplit(tmp_path, 1000)
    assert (tmp_path / "p0").read_bytes() == b"x" * 2000      # nothing was cut
    assert not (tmp_path / "bundle.tmp").exists()
