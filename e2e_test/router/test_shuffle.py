"""The shuffle check: a part of the CPU lane's selection (chat, evals, the oracle's control arm
and negative control, the PD checks and comparisons against `1`, on `1` and `1p1d`, small
evals, eager boots) run by a nested pytest twice, each time with the tests of every topology's
group in another seeded random order (`--e2e-shuffle`), must give the same outcome for every
test: no test leans on what another left, in whatever order they run."""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from e2e_test.infra.lifecycle.process import extend_pythonpath

pytestmark = [pytest.mark.e2e, pytest.mark.engines("vllm"), pytest.mark.backends("cpu")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ["e2e_test/router/test_chat.py", "e2e_test/router/test_evals.py",
         "e2e_test/router/test_oracle.py", "e2e_test/router/test_pd.py"]
SEEDS = (1, 2)


def _run(tmp_path, engine: str, backend: str, seed: int) -> tuple[dict, list[str]]:
    res = tmp_path / f"seed{seed}"
    env = {**os.environ, "E2E_TOPOLOGIES": "1,1p1d", "E2E_ENGINES": engine,
           "E2E_BACKEND": backend, "E2E_ENFORCE_EAGER": "1", "E2E_RESULTS_DIR": str(res),
           "E2E_GSM8K_N": "4", "E2E_MMLU_N": "4", "PYTHONPATH": extend_pythonpath(ROOT)}
    junit = res / "junit.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", *FILES, "-v", "-p", "no:cacheprovider",
                        "-k", "not kv_recall", "--e2e-shuffle", str(seed),
                        "--junitxml", str(junit)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400,
                       check=False)
    out = r.stdout + r.stderr
    assert junit.is_file(), out[-3000:]
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        bad = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = bad or "passed"
    order = re.findall(r"^(\S+::\S+) (?:PASSED|FAILED|ERROR|SKIPPED)", out, re.MULTILINE)
    return outcomes, order


def test_two_shuffled_orders_give_the_same_outcomes(engine_name, e2e_backend, tmp_path, record):
    (a, order_a), (b, order_b) = (_run(tmp_path, engine_name, e2e_backend, s) for s in SEEDS)
    record["shuffle"] = {"seeds": list(SEEDS), "orders": [order_a, order_b], "outcomes": a}
    print(f"seed {SEEDS[0]}: {order_a}\nseed {SEEDS[1]}: {order_b}")
    assert order_a != order_b, "the two seeds ran the tests in the same order"
    assert a == b, {t: (a.get(t), b.get(t)) for t in set(a) | set(b) if a.get(t) != b.get(t)}
    assert len(a) >= 15 and "skipped" not in a.values(), a
