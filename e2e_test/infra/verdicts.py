"""What the main job proved about a disaggregated topology, as short lines for its summary.

- `disagg_proof(cluster)`: runs the proof that fits the topology kind (PD: the KV moved; EPD:
  the encoder ran; AFD: the FFN served) and returns {record key: proof dict}, the same keys
  the pytest records use, so report.py words them the same way everywhere.
- `print_verdicts(summary)`: the proof line(s) and the comparison oracle's verdict line.
"""

from __future__ import annotations

from . import proof, report

KEYS = {"pd": "pd_proof", "epd": "epd_proof", "afd": "afd_ffn_proof"}


def disagg_proof(cluster) -> dict:
    kind = cluster.topology.kind
    if kind == "pd":
        p = (proof.pd_transfer_tokenspeed(cluster) if cluster.engine == "tokenspeed"
             else proof.pd_transfer(cluster))
    elif kind == "epd":
        p = proof.epd_encoder_ran(cluster)
    elif kind == "afd" and not cluster.topology.name.startswith("native"):
        p = proof.afd_ffn_served(cluster)
    else:
        return {}
    return {KEYS[kind]: p.to_dict()}


def proof_lines(summary: dict) -> list[str]:
    """One line per proof in `summary` (keys as in KEYS), worded by report._details."""
    out = []
    for key in KEYS.values():
        if summary.get(key):
            out.append(report._details({key: summary[key]}))
    if summary.get("proof_error"):
        out.append(f"proof FAILED: {summary['proof_error']}")
    return out


def oracle_line(summary: dict) -> str | None:
    """HOOK for the comparison oracle (e2e_test/infra/oracle.py, the lead's): when the main job
    puts the oracle's record under summary["oracle"] ({"verdict", "baseline", "items": [{
    "index", "verdict": identical|numerics|mismatch}], "control": {...}}), this prints e.g.
    "answers vs `1`: 30 identical, 2 numerics, 0 mismatch (verdict pass)". Replace or extend
    the wording here; cmd_main only calls print_verdicts."""
    o = summary.get("oracle")
    if not o:
        return None
    items = o.get("items") or []
    counts = {v: sum(1 for i in items if i.get("verdict") == v)
              for v in ("identical", "numerics", "mismatch")}
    line = f"answers vs `{o.get('baseline', '1')}`: " + ", ".join(
        f"{n} {v}" for v, n in counts.items())
    if o.get("verdict") is not None:
        line += f" (verdict {o['verdict']})"
    return line


def print_verdicts(summary: dict, out=print) -> list[str]:
    lines = proof_lines(summary)
    oracle = oracle_line(summary)
    if oracle:
        lines.append(oracle)
    for ln in lines:
        out(f"  {ln}")
    return lines
