"""scripts/gpu_lane.sh's two other modes, on this machine (no GPU needed: nothing reaches an
engine): sourced, it sets a runner's environment up and stops; `bench` hands its arguments to
`python -m e2e_test bench` with the engine, after the same setup."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_lane.sh"


def _env(tmp_path):
    stage = tmp_path / "env.sh"
    stage.write_text("export STAGED_MARK=1\n")
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")     # what the settings check asks
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2E_")}
    return {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
            "E2E_STAGE_ENV": str(stage), "E2E_MODEL_PATH": str(tmp_path / "model"),
            "E2E_DATASET_DIR": str(tmp_path), "E2E_BYTECODE": "0", "OUT": str(tmp_path)}


def test_sourced_it_sets_the_environment_and_runs_nothing(tmp_path):
    r = subprocess.run(["bash", "-c", f"source {SCRIPT} vllm e2e-1gpu-pd; echo \"SRC rc=$? "
                        "$STAGED_MARK $E2E_BACKEND $E2E_RESULTS_DIR $E2E_ENFORCE_EAGER\""],
                       cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SRC rc=0 1 cuda /tmp/res/e2e-1gpu-pd-vllm-20" in r.stdout, r.stdout + r.stderr
    assert "gpu_lane: vllm e2e-1gpu-pd" not in r.stdout      # the lane did not start
    assert not list(tmp_path.glob("lane-*.log*"))


def test_bench_mode_runs_the_bench_with_the_engine(tmp_path):
    """A and B the same topology and shape: bench's own one-line refusal, before any process
    starts, in the bench's log (not a pytest run)."""
    r = subprocess.run(["bash", str(SCRIPT), "vllm", "bench", "--", "--a", "1", "--b", "1"],
                       cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "gpu_lane: vllm bench" in r.stdout, r.stdout
    log = subprocess.run(["xz", "-dc", str(tmp_path / "lane-bench-vllm.log.xz")],
                         capture_output=True, text=True).stdout
    assert "A and B are both 1 asked as completions: nothing to compare" in log, log
    assert "pytest" not in log


def test_a_lane_needs_two_arguments(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "vllm"], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "usage: scripts/gpu_lane.sh ENGINE LANE|bench" in r.stderr


def test_tokenspeed_runs_with_graphs_except_on_the_epd_lane(tmp_path):
    """TokenSpeed's lanes default to CUDA graphs (the builder's sampler and capture sizes),
    e2e-1gpu-epd stays eager as measured; vLLM stays eager; a given value wins."""
    def eager(eng, lane, **env):
        r = subprocess.run(["bash", "-c", f"source {SCRIPT} {eng} {lane}; "
                            "echo \"EAGER=$E2E_ENFORCE_EAGER ARGS=${E2E_ENGINE_ARGS:-}\""],
                           cwd=tmp_path, env={**_env(tmp_path), **env}, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout.strip().splitlines()[-1]
    assert eager("tokenspeed", "e2e-1gpu-pd") == "EAGER=0 ARGS="
    assert eager("tokenspeed", "e2e-1gpu-epd") == "EAGER=1 ARGS="
    assert eager("vllm", "e2e-1gpu-pd") == "EAGER=1 ARGS="
    assert eager("tokenspeed", "e2e-1gpu-pd", E2E_ENFORCE_EAGER="1") == "EAGER=1 ARGS="
