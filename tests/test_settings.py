"""settings.py: every E2E_* / AFD_E2E_* variable declared once, validated at start-up.

Table-driven over every bad input of issue 17: each one, given to the CLI (`python -m e2e_test
plan 1`) and to pytest (collection only), is one line, exit 2, naming the variable (or option),
what it got and what it accepts, before any process starts. Plus: docs/settings.md is up to date,
good values parse, `plan` shows what pytest would run, and the weights' config.json is parsed
before launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_test.infra import startup
from e2e_test.infra.errors import ConfigError
from e2e_test.infra.specs import settings

REPO = Path(__file__).resolve().parents[1]


def clean_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("E2E_", "AFD_")) and k != "PYTEST_ADDOPTS"}
    env["E2E_RESULTS_DIR"] = str(tmp_path / "results")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def broken_weights(tmp_path) -> str:
    d = tmp_path / "weights"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama",')   # cut short
    return str(d)


# (id, env, extra CLI args, pytest args, what the one line must contain)
BAD = [
    ("backend-option", {}, ["--backend", "gpu"], ["--backend", "gpu"],
     ["--backend='gpu'", "accepts cpu | cuda"]),
    ("backend-env", {"E2E_BACKEND": "gpu"}, [], [], ["E2E_BACKEND='gpu'", "accepts cpu | cuda"]),
    ("burst-n", {"E2E_BURST_N": "abc"}, [], [],
     ["E2E_BURST_N='abc'", "not an integer", "accepts an integer >= 1"]),
    ("watchdog", {"E2E_WATCHDOG_S": "soon"}, [], [],
     ["E2E_WATCHDOG_S='soon'", "not a number", "accepts a number > 0"]),
    ("gsm8k-n", {"E2E_GSM8K_N": "3.5"}, [], [], ["E2E_GSM8K_N='3.5'", "accepts an integer"]),
    ("mmlu-n-zero", {"E2E_MMLU_N": "0"}, [], [], ["E2E_MMLU_N='0'", "below 1"]),
    ("enforce-eager", {"E2E_ENFORCE_EAGER": "maybe"}, [], [],
     ["E2E_ENFORCE_EAGER='maybe'", "accepts true/false, 1/0 or yes/no"]),
    ("engine-args-quote", {"E2E_ENGINE_ARGS": '--chat-template "x'}, [], [],
     ["E2E_ENGINE_ARGS=", "no closing quotation", "accepts shell-quoted words"]),
    ("devices-option", {}, ["--devices", "99"], ["--devices", "99"],
     ["--devices='99'", "99 not in this process's CPU affinity", "accepts ids among"]),
    ("devices-env", {"E2E_DEVICES": "99"}, [], [], ["E2E_DEVICES='99'", "CPU affinity"]),
    ("cpu-core", {"E2E_CPU_CORES": "0,4096"}, [], [],
     ["E2E_CPU_CORES='0,4096'", "core(s) 4096", "accepts ids among"]),
    ("engines-sglang", {"E2E_ENGINES": "sglang"}, [], [],
     ["E2E_ENGINES='sglang'", "unknown 'sglang'", "accepts a comma list of vllm, tokenspeed"]),
    ("mooncake", {"E2E_MOONCAKE_TRANSPORT": "rdma"}, [], [],
     ["E2E_MOONCAKE_TRANSPORT='rdma'", "accepts nvlink | tcp"]),
    ("topologies", {"E2E_TOPOLOGIES": "1,3x"}, [], [], ["E2E_TOPOLOGIES='1,3x'", "bad topology"]),
    ("model", {"E2E_MODEL": "no/such-model"}, [], [], ["E2E_MODEL='no/such-model'",
                                                       "unknown model"]),
    ("opt-in-model", {"E2E_MODEL": "Qwen/Qwen3.5-122B-A10B"}, [], [],
     ["E2E_MODEL='Qwen/Qwen3.5-122B-A10B'", "AFD_E2E_LARGE_MODEL=1"]),
    ("large-model-flag", {"AFD_E2E_LARGE_MODEL": "on"}, [], [],
     ["AFD_E2E_LARGE_MODEL='on'", "accepts true/false"]),
    ("dataset-dir", {"E2E_DATASET_DIR": "/no/such/folder"}, [], [],
     ["E2E_DATASET_DIR='/no/such/folder'", "no such directory"]),
    # issue 28: start-up checks that passed what failed later
    ("topology-model", {"E2E_TOPOLOGIES": "1e1p1d"}, [], [],
     ["E2E_TOPOLOGIES='1e1p1d'", "runs on none of engine(s)", "SmolLM2-135M-Instruct"]),
    ("topology-option-bad", {"E2E_TOPOLOGIES": "p.tp=2,1p1d"}, [], [],
     ["E2E_TOPOLOGIES='p.tp=2,1p1d'", "follows no topology"]),
    ("model-path-config", {"E2E_MODEL_PATH": "<broken>"}, [], [],
     ["E2E_MODEL_PATH=", "config.json is not valid JSON"]),
    ("gpu-ids-cuda", {"E2E_BACKEND": "cuda"}, ["--devices", "0,99"], ["--devices", "0,99"],
     ["--devices='0,99'", "GPU"]),
]


def _bad_env(tmp_path, env: dict) -> dict:
    return {k: (broken_weights(tmp_path) if v == "<broken>" else v) for k, v in env.items()}


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_cli_is_one_line_exit_2(tmp_path, case):
    _, env, cli, _, want = case
    r = subprocess.run([sys.executable, "-m", "e2e_test", "plan", "1", *cli], cwd=REPO,
                       env=clean_env(tmp_path, **_bad_env(tmp_path, env)),
                       capture_output=True, text=True, timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2, r.stdout + r.stderr
    assert err.count("\n") == 0, err
    assert all(w in err for w in want), err
    assert "Traceback" not in r.stderr and "plan 1 on" not in r.stdout   # nothing planned


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_pytest_is_one_line_exit_2(tmp_path, case):
    _, env, _, args, want = case
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                        "--collect-only", "-q", "e2e_test/router/test_chat.py", *args],
                       cwd=REPO, env=clean_env(tmp_path, **_bad_env(tmp_path, env)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Exit: "), r.stderr
    assert all(w in lines[0] for w in want), lines[0]
    assert "::" not in r.stdout                                        # nothing collected


OFFLINE = {"HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9",
           "NO_PROXY": "", "no_proxy": ""}

# Other commands' bad input (issue 28): (id, argv after `python -m e2e_test`, env, wanted).
# "<empty>" is an empty folder, "<broken>" weights with a cut-short config.json.
BAD_COMMANDS = [
    ("report-missing", ["report", "/no/such/results"], {}, ["report: /no/such/results is not a folder"]),
    ("report-empty", ["report", "<empty>"], {}, ["holds no results"]),
    ("report-html-empty", ["report", "--html", "<empty>"], {}, ["holds no results"]),
    ("report-trend-missing", ["report", "--trend", "/no/such/results"], {}, ["is not a folder"]),
    ("settings-config-json", ["settings"], {"E2E_MODEL_PATH": "<broken>"},
     ["E2E_MODEL_PATH=", "config.json is not valid JSON"]),
    ("datasets-offline", ["datasets", "download"], {**OFFLINE, "E2E_CACHE_DIR": "<empty>"},
     ["datasets download: cannot fetch", "set E2E_DATASET_DIR"]),
    ("plan-engine-backend", ["plan", "1", "--engine", "tokenspeed", "--backend", "cpu"], {},
     ["engine 'tokenspeed' (tokenspeed) runs on cuda only; backend is cpu"]),
    ("plan-gpu-ids", ["plan", "1p1d", "--backend", "cuda", "--devices", "0,99"], {},
     ["--devices='0,99'", "GPU"]),
]


@pytest.mark.parametrize("case", BAD_COMMANDS, ids=[c[0] for c in BAD_COMMANDS])
def test_bad_command_input_is_one_line_exit_2(tmp_path, case):
    _, argv, env, want = case
    empty = tmp_path / "empty"
    empty.mkdir()

    def sub(v):
        return {"<empty>": str(empty), "<broken>": broken_weights(tmp_path)}.get(v, v)
    r = subprocess.run([sys.executable, "-m", "e2e_test", *map(sub, argv)], cwd=REPO,
                       env=clean_env(tmp_path, **{k: sub(v) for k, v in env.items()}),
                       capture_output=True, text=True, timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2, r.stdout + r.stderr
    assert err.count("\n") == 0 and err.startswith("error: "), err
    assert all(w in err for w in want), err
    assert "Traceback" not in r.stderr


def test_a_missing_optional_module_names_what_to_install():
    from e2e_test.__main__ import missing_module
    line = missing_module(ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib"),
                          "report")
    assert line == ("report needs the Python module 'matplotlib', which is not installed here: "
                    "pip install -e '.[dev]'")
    assert "'.[cpu]'" in missing_module(ModuleNotFoundError(name="torch.nn"), "models")


def test_broken_config_json_is_found_before_launch(tmp_path):
    """E2E_MODEL_PATH with a cut-short config.json: one line, exit 2, before any worker."""
    d = broken_weights(tmp_path)
    r = subprocess.run([sys.executable, "-m", "e2e_test", "plan", "1"], cwd=REPO,
                       env=clean_env(tmp_path, E2E_MODEL_PATH=d), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.count("\n") == 0 and f"{d}/config.json is not valid JSON" in err, err


def test_config_json_checks(tmp_path):
    from e2e_test.infra.specs.model_specs import get_spec
    from e2e_test.infra.specs.models import check_config_json
    spec = get_spec("SmolLM2-135M-Instruct")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert check_config_json(spec, tmp_path, str(tmp_path)) == {"model_type": "llama"}
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        check_config_json(spec, tmp_path, str(tmp_path))
    with pytest.raises(ConfigError, match="no config.json"):
        check_config_json(spec, tmp_path / "empty", "somewhere")


# -- good values ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [("1", True), ("true", True), ("TRUE", True),
                                       ("yes", True), ("0", False), ("false", False),
                                       ("no", False), ("", False)])
def test_enforce_eager_spellings(text, want):
    assert settings.get("E2E_ENFORCE_EAGER", {"E2E_ENFORCE_EAGER": text}) is want


def test_defaults_and_parsing():
    env = {"E2E_BURST_N": " 8 ", "E2E_WATCHDOG_S": "2.5", "E2E_ENGINE_ARGS": "--a 'b c'",
           "E2E_DEVICES": "1, 0", "E2E_ENGINES": "tokenspeed"}
    assert settings.get("E2E_BURST_N", env) == 8
    assert settings.get("E2E_WATCHDOG_S", env) == 2.5
    assert settings.get("E2E_ENGINE_ARGS", env) == ("--a", "b c")
    assert settings.get("E2E_DEVICES", env) == (1, 0)
    assert settings.get("E2E_ENGINES", env) == ("tokenspeed",)
    assert settings.get("E2E_BURST_N", {}) == 16 and settings.get("E2E_GSM8K_N", {}) is None
    assert settings.get("E2E_BURST_N", {"E2E_BURST_N": ""}) == 16    # empty = unset


def test_check_names_every_bad_variable_at_once():
    with pytest.raises(settings.SettingError) as ei:
        startup.check({"E2E_BURST_N": "x", "E2E_WATCHDOG_S": "y"})
    lines = str(ei.value).splitlines()
    assert [ln.split("=", 1)[0] for ln in lines] == ["E2E_WATCHDOG_S", "E2E_BURST_N"]


def test_device_ids_against_the_machine():
    with pytest.raises(settings.SettingError, match="GPU.s. 9 not present; accepts ids among 0-3"):
        startup.check_devices("0,9", "cuda", gpu_present=lambda: (0, 1, 2, 3))
    assert startup.check_devices("3,1", "cuda", gpu_present=lambda: (0, 1, 2, 3)) == (3, 1)
    with pytest.raises(settings.SettingError, match="NVML sees no GPU"):   # NVML absent:
        startup.check_devices("7", "cuda", gpu_present=lambda: ())        # never a pass
    with pytest.raises(settings.SettingError, match="core.s. 7 not in"):
        startup.check_devices("7", "cpu", cpu_present=lambda: (0, 1))
    assert startup.check_devices("1", "cpu", cpu_present=lambda: (0, 1)) == (1,)


def test_every_variable_the_code_reads_is_declared():
    """No E2E_*/AFD_E2E_* name in the code that the module does not declare (and none
    declared that nothing reads), so the table is the whole list."""
    import re
    names = set()
    for p in (list((REPO / "e2e_test").rglob("*.py")) + list((REPO / "scripts").glob("*.sh"))
              + [REPO / ".ci" / "run"]):
        if p.name == "settings.py":
            continue
        names |= set(re.findall(r"\b((?:AFD_(?:GPU_)?)?E2E_[A-Z0-9_]*[A-Z0-9])\b",
                                p.read_text()))
    names |= {"E2E_GSM8K_N", "E2E_MMLU_N"}           # read as f"E2E_{name.upper()}_N"
    assert names - set(settings.SETTINGS) == set()
    assert set(settings.SETTINGS) - names == set()


# -- plan shows what pytest would run -----------------------------------------------------------

def test_plan_honours_engine_args_and_eager(tmp_path):
    r = subprocess.run([sys.executable, "-m", "e2e_test", "plan", "1"], cwd=REPO,
                       env=clean_env(tmp_path, E2E_ENGINE_ARGS="--max-num-seqs 3",
                                     E2E_ENFORCE_EAGER="true"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    argv = lines[lines.index("# worker-0") + 1]
    assert "--max-num-seqs 3" in argv and "--enforce-eager" in argv, argv


def test_options_from_env_reads_mooncake_transport():
    from e2e_test.infra.specs.settings import options_from_env
    o = options_from_env({"E2E_MOONCAKE_TRANSPORT": "tcp", "E2E_ENGINE_ARGS": "--x 1"})
    assert (o.opt("mooncake_transport"), o.extra_args) == ("tcp", ("--x", "1"))


# -- docs/settings.md -----------------------------------------------------------------------------

def test_docs_settings_is_up_to_date():
    assert settings.docs_path().read_text() == settings.markdown(), (
        "docs/settings.md is stale: python -m e2e_test settings --markdown > docs/settings.md")


def test_settings_markdown_prints_the_page(tmp_path):
    r = subprocess.run([sys.executable, "-m", "e2e_test", "settings", "--markdown"], cwd=REPO,
                       env=clean_env(tmp_path), capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout == settings.markdown() and r.stdout.startswith("# Settings\n")
    assert "| `E2E_BURST_N` | int | 16 |" in r.stdout


def test_table_lists_every_variable_once():
    t = settings.table()
    for name in settings.SETTINGS:
        assert t.count(f"| `{name}` |") == 1


# -- the opt-in AFD large-model profile -----------------------------------------------------------

def test_large_model_weights_come_from_afd_gpu_e2e_model(tmp_path, monkeypatch):
    """AFD_GPU_E2E_MODEL is the opt-in model's weights path (E2E_MODEL_ROOT is not asked for)."""
    from e2e_test.infra.specs.model_specs import get_spec
    from e2e_test.infra.specs.models import weights_path
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_moe"}')
    monkeypatch.delenv("E2E_MODEL_ROOT", raising=False)
    monkeypatch.delenv("E2E_MODEL_PATH", raising=False)
    monkeypatch.setenv("AFD_GPU_E2E_MODEL", str(tmp_path))
    assert weights_path(get_spec("Qwen/Qwen3.5-122B-A10B")) == tmp_path
    # other models are not affected by it
    assert weights_path(get_spec("SmolLM2-135M-Instruct"), must_exist=False) != tmp_path


def test_opt_in_model_needs_its_flag():
    env = {"E2E_MODEL": "Qwen/Qwen3.5-122B-A10B"}
    with pytest.raises(settings.SettingError, match="AFD_E2E_LARGE_MODEL=1"):
        startup.check(env)
    startup.check({**env, "AFD_E2E_LARGE_MODEL": "1"})   # the flag alone passes check()


# -- what `plan` and `settings` print is what a user would type (issue 28) ----------------------

def test_plan_prints_shell_quoted_argv(monkeypatch, capsys):
    """A worker's line of `plan` (after its `# role` comment) pasted into bash gives back the
    exact env and argv (no brace expansion of a JSON --kv-transfer-config)."""
    import shlex
    from types import SimpleNamespace

    from e2e_test import __main__ as cli
    argv = ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"kv_both"}', "--served-model-name", "a b"]
    worker = SimpleNamespace(name="prefill-0", command=SimpleNamespace(
        argv=argv, env={"UCX_TLS": "tcp,self", "X": "two words"}))
    fake = SimpleNamespace(plan=SimpleNamespace(describe=lambda: "plan 1p1d on cpu"),
                           workers=[worker])
    monkeypatch.setattr(cli, "cluster_from_args", lambda a, **kw: fake)
    assert cli.cmd_plan(SimpleNamespace(model="SmolLM2-135M-Instruct")) == 0
    out = capsys.readouterr().out.splitlines()
    line = out[out.index("# prefill-0") + 1]
    assert shlex.split(line) == ["env", "UCX_TLS=tcp,self", "X=two words", *argv]


def test_settings_prints_values_as_typed(tmp_path):
    r = subprocess.run([sys.executable, "-m", "e2e_test", "settings"], cwd=REPO,
                       env=clean_env(tmp_path, E2E_ENGINES="vllm", E2E_ENGINE_ARGS="--a 'b c'",
                                     E2E_TOPOLOGIES="1,1p1d,p.tp=2"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln.split(None, 1)[1] for ln in r.stdout.splitlines() if ln.strip()}
    assert lines["E2E_ENGINES"] == "vllm"
    assert lines["E2E_TOPOLOGIES"] == "1,1p1d,p.tp=2"
    assert lines["E2E_ENGINE_ARGS"] == "--a 'b c'"
    assert lines["E2E_CACHE_DIR"] == "~/.cache/e2e_test"
    assert lines["E2E_RESULTS_DIR"].startswith(str(tmp_path / "results"))
    assert lines["E2E_ENFORCE_EAGER"] == "false" and lines["E2E_GSM8K_N"] == "unset"
    assert "PosixPath" not in r.stdout and "('" not in r.stdout and "None" not in r.stdout


@pytest.mark.parametrize("value,expected", [("true", True), ("1", True), ("YES", True),
                                            (" True ", True), ("false", False), ("0", False),
                                            ("", False), (None, False), ("maybe", False)])
def test_ci_is_one_truth_set(value, expected, monkeypatch):
    """`CI` is read once (settings.ci), by the teardown verdict and the plugin's session end."""
    from e2e_test.infra.lifecycle import teardown
    assert settings.ci({} if value is None else {"CI": value}) is expected
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    report = teardown.TeardownReport(survivors=["pid 1"])
    if expected:
        with pytest.raises(teardown.TeardownError):
            teardown.enforce(report, "x")
    else:
        with pytest.warns(RuntimeWarning):
            teardown.enforce(report, "x")


def test_stage_env_defaults_are_the_engines_and_gpu_lane_sh_uses_them():
    """E2E_STAGE_ENV's doc names each engine's staging file (Engine.stage_env); the script's
    case picks the same file per engine."""
    from e2e_test.infra.engines import all_engines
    script = (Path(__file__).resolve().parents[1] / "scripts" / "gpu_lane.sh").read_text()
    staged = [e for e in all_engines() if e.stage_env]
    assert staged
    for e in staged:
        assert f"{e.name}) envf=${{E2E_STAGE_ENV:-{e.stage_env}}}" in script, e.name
        assert f"{e.stage_env} for {e.name}" in settings.SETTINGS["E2E_STAGE_ENV"].text
