"""Root conftest: the harness's pytest plugin (options, fixtures, markers, results)."""

pytest_plugins = ["e2e_test.pytest_plugin"]
