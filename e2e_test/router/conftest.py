"""Session state the comparison suites share: each topology's eval passes and the control arm."""

from dataclasses import dataclass, field

import pytest


@dataclass
class OracleStore:
    # (engine, topology, eval) -> index -> steps (None where the request failed)
    passes: dict = field(default_factory=dict)
    # (engine, eval) -> oracle.ControlArm measured on the regular topology in this session
    control: dict = field(default_factory=dict)
    # (engine, topology) -> indices of the recall prompts whose pass code came back
    recall: dict = field(default_factory=dict)


@pytest.fixture(scope="session")
def oracle_store() -> OracleStore:
    return OracleStore()
