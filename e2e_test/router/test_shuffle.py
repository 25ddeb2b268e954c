"""The shuffle check: a part of the CPU lane's selection (chat, evals, the oracle's control arm
and negative control, the PD checks and comparisons against `1`, on `1` and `1p1d`, small
evals, eager boots) run by a nested pytest with the tests of every topology's group in a
seeded random order (`--e2e-shuffle`) must pass every test, as the lane itself does in the
collected order: no test leans on what another left. The order must differ from the collected
one (a nested `--collect-only`), or the check ran nothing new. One order, not two compared
with each other: the lane's own session is the other order, and two nested sessions cost four
eager boots (393 s on 2 cores). GSM8K only: each eval test runs the same code for MMLU with
other prompts (the same memos, evidence and verdicts, keyed by the eval's name), so MMLU's
cases would shuffle nothing new, and they cost `1` three more passes and a path arm."""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from e2e_test.infra.cluster.diagnostics import nested_failure
from e2e_test.infra.lifecycle.process import extend_pythonpath
from e2e_test.infra.specs.topology import parse
from e2e_test.infra.startup import child_env

pytestmark = [pytest.mark.e2e, pytest.mark.engines("vllm"), pytest.mark.backends("cpu")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ["e2e_test/router/test_chat.py", "e2e_test/router/test_evals.py",
         "e2e_test/router/test_oracle.py", "e2e_test/router/test_pd.py"]
SEED = 1


def _run(tmp_path, engine: str, backend: str, seed: int | None) -> tuple[dict, list[str]]:
    """The nested session's outcomes and the order it ran them in; `seed` None: collected
    only, in the order the plugin sets without a shuffle."""
    res = tmp_path / f"seed{seed}"
    env = {**child_env(parse("1"), backend), "E2E_TOPOLOGIES": "1,1p1d", "E2E_ENGINES": engine,
           "E2E_BACKEND": backend, "E2E_ENFORCE_EAGER": "1", "E2E_RESULTS_DIR": str(res),
           "E2E_GSM8K_N": "4", "PYTHONPATH": extend_pythonpath(ROOT)}
    junit = res / "junit.xml"
    how = ["--collect-only", "-q"] if seed is None else [
        "-v", "--e2e-shuffle", str(seed), "--junitxml", str(junit)]
    r = subprocess.run([sys.executable, "-m", "pytest", *FILES, "-p", "no:cacheprovider",
                        "-k", "not kv_recall and not mmlu", *how],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400,
                       check=False)
    out = r.stdout + r.stderr
    if seed is None:
        order = re.findall(r"^(\S+::\S+)$", out, re.MULTILINE)
        assert r.returncode == 0 and order, nested_failure(out, res, r.returncode, tail=3000)
        return {}, order
    assert junit.is_file(), nested_failure(out, res, r.returncode, tail=3000)
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        bad = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = bad or "passed"
    order = re.findall(r"^(\S+::\S+) (?:PASSED|FAILED|ERROR|SKIPPED)", out, re.MULTILINE)
    return outcomes, order


def test_a_shuffled_order_passes_every_test(engine_name, e2e_backend, tmp_path, record):
    _, collected = _run(tmp_path, engine_name, e2e_backend, None)
    outcomes, order = _run(tmp_path, engine_name, e2e_backend, SEED)
    record["shuffle"] = {"seed": SEED, "collected": collected, "order": order,
                         "outcomes": outcomes}
    print(f"collected: {collected}\nseed {SEED}: {order}")
    assert sorted(order) == sorted(collected), "the shuffled session ran other tests than " \
        f"it collects: {sorted(set(order) ^ set(collected))}"
    assert order != collected, f"seed {SEED} ran the tests in the collected order"
    bad = {t: o for t, o in outcomes.items() if o != "passed"}
    assert len(outcomes) >= 13 and not bad, bad or outcomes
