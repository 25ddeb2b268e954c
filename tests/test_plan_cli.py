"""`python -m e2e_test plan`: it starts nothing and plans from the model registry, so it needs
no prepared weights (nor torch); where a worker's command does need them, the error names the
command that prepares them. Its output pastes into bash: comments, then `env K=V ... argv`."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_test.__main__ import main

REPO = Path(__file__).resolve().parents[1]


def run_cli(tmp_path, *argv, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("E2E_", "AFD_"))}
    e.update(E2E_RESULTS_DIR=str(tmp_path / "results"), E2E_CACHE_DIR=str(tmp_path / "cache"),
             **env)
    return subprocess.run([sys.executable, "-m", "e2e_test", *argv], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=120, check=False)


def test_plan_needs_no_prepared_model(tmp_path):
    r = run_cli(tmp_path, "plan", "1p1d", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    assert "# weights not there yet" in r.stdout
    assert "python -m e2e_test models prepare --model SmolLM2-135M-Instruct" in r.stdout
    assert f"--model {tmp_path}/cache/models/SmolLM2-135M-Instruct" in r.stdout


def test_plan_output_pastes_into_bash(tmp_path):
    r = run_cli(tmp_path, "plan", "1p1d", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for role in ("prefill-0", "decode-0"):
        cmd = shlex.split(lines[lines.index(f"# {role}") + 1])
        assert cmd[0] == "env" and "vllm.entrypoints.openai.api_server" in cmd
        assert all("=" in w for w in cmd[1:cmd.index(sys.executable)])
    for ln in lines:
        assert ln.startswith(("# ", "env ")), ln
    # bash parses the whole output as it is (-n: reads, runs nothing)
    sh = subprocess.run(["bash", "-n"], input=r.stdout, capture_output=True, text=True,
                        check=False)
    assert sh.returncode == 0, sh.stderr


def test_plan_that_needs_the_weights_names_the_prepare_command(tmp_path, monkeypatch,
                                                                 fake_gpus, capsys):
    """A GPU worker's KV budget reads config.json: without prepared weights the one-line
    error says how to prepare them. The control: with a config.json in place it plans."""
    monkeypatch.setenv("E2E_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("E2E_RESULTS_DIR", str(tmp_path / "results"))
    assert main(["plan", "1", "--backend", "cuda", "--devices", "0"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and err.count("\n") == 1, err
    assert "python -m e2e_test models prepare --model SmolLM2-135M-Instruct" in err
    weights = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text(
        '{"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, '
        '"hidden_size": 576, "torch_dtype": "bfloat16"}')
    assert main(["plan", "1", "--backend", "cuda", "--devices", "0"]) == 0, \
        capsys.readouterr().err
    assert "--kv-cache-memory-bytes" in capsys.readouterr().out


@pytest.mark.parametrize("action", ["tiny-vlm", "tiny-moe"])
def test_tiny_models_without_a_prepared_tokenizer_name_the_prepare_command(tmp_path, action):
    r = run_cli(tmp_path, "models", action, "--out", str(tmp_path / "out"))
    assert r.returncode == 2
    err = r.stderr.strip()
    assert err.count("\n") == 0 and "no tokenizer files" in err, err
    assert "python -m e2e_test models prepare" in err and "--tokenizer DIR" in err


@pytest.mark.parametrize("n", ["0", "-3"])
def test_cycles_needs_at_least_one_cycle(tmp_path, n):
    r = run_cli(tmp_path, "cycles", "-n", n, "--backend", "cpu")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == f"error: cycles -n {n}: needs at least 1 cycle"
    assert r.stdout == ""                                   # nothing started
