"""The pytest plugin leaves a result record even when a fixture before `record` fails
(a topology that never started), so such failures reach the result files."""

import json

pytest_plugins = ["pytester"]

CONFTEST = 'pytest_plugins = ["e2e_test.pytest_plugin"]\n'
TESTS = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("worker-0 exited while starting: flat GDN layout")

def test_needs_broken(broken, record):
    record["x"] = 1

def test_fine(record):
    record["y"] = 2
'''


def test_setup_error_before_record_is_recorded(pytester, monkeypatch):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(pytester.path / "res"))
    monkeypatch.setenv("E2E_BACKEND", "cpu")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    recs = {}
    for f in (pytester.path / "res" / "tests").glob("*.json"):
        r = json.loads(f.read_text())
        recs[r["test"].split("::")[-1]] = r
    assert recs["test_fine"]["outcome"] == "passed" and recs["test_fine"]["y"] == 2
    err = recs["test_needs_broken"]
    assert err["outcome"] == "error"
    assert "flat GDN layout" in err["error"]
