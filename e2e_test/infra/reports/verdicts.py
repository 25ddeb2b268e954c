"""What the main job proved about a disaggregated topology, as short lines for its summary.

- `disagg_proof(cluster)`: runs the proof that fits the topology kind (PD: the KV moved; EPD:
  the encoder ran; AFD: the FFN served; each the engine's own hook) and returns {record key: proof dict}, the same keys
  the pytest records use, so report.py words them the same way everywhere.
- `print_verdicts(summary)`: the proof line(s) and the comparison oracle's verdict line.
"""

from __future__ import annotations

from ..engines import PROOF_KEYS as KEYS
from . import report


def disagg_proof(cluster) -> dict:
    """The engine's proof for the topology kind (Engine.disagg_proof)."""
    return cluster.driver.disagg_proof(cluster)


def proof_lines(summary: dict) -> list[str]:
    """One line per proof in `summary` (keys as in KEYS), worded by report.details."""
    out = []
    for key in KEYS.values():
        if summary.get(key):
            out.append(report.details({key: summary[key]}))
    if summary.get("proof_error"):
        out.append(f"proof FAILED: {summary['proof_error']}")
    return out


def oracle_lines(summary: dict) -> list[str]:
    """The comparison oracle's verdicts in `summary["oracle"]` ({eval: Verdict.to_dict()}, as
    comparisons.against_one_worker returns them), one line per eval, worded by
    report.oracle_line as in every other report: e.g. "answers, gsm8k: ok: gsm8k vllm/1p1d
    vs vllm/prefill-0 alone: 31 identical, 1 numerics, 0 mismatch (numerics budget 7 from the
    control arm); max first-step delta 0.126 nats"."""
    return [f"answers, {name}: {report.oracle_line(v)}"
            for name, v in (summary.get("oracle") or {}).items()]


def print_verdicts(summary: dict, out=print) -> list[str]:
    lines = proof_lines(summary)
    lines += oracle_lines(summary)
    for ln in lines:
        out(f"  {ln}")
    return lines
