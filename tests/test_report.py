"""Validation report lines from test records (vLLM and TokenSpeed proofs)."""

from e2e_test.infra.reports import report


def test_vllm_and_tokenspeed_pd_proofs_and_tolerance():
    v = report.details({"pd_proof": {"decode_external": 1437, "prompt_tokens": 1437,
                                      "decode_local_compute": 0, "nixl_bytes": 2**20 * 35.4}})
    assert v == "KV proof: decode got 1437/1437 prompt tokens by transfer, recomputed 0, " \
                "35.4 MiB over NIXL"
    t = report.details({"pd_proof": {
        "requests": 4, "prompt_tokens": 1560, "gateway_prefill_selections": 4,
        "gateway_decode_selections": 4, "gateway_transfer_failures": 0,
        "prefill_forward_tokens": 1564.0, "prefill_finished": 4.0, "decode_success": 4.0,
        "decode_generation_tokens": 32.0, "decode_prompt_tokens": 1560.0},
        "pd_vs_regular": {"gsm8k": {"items": 32, "same_prediction": 25, "tolerance": 0.25}}})
    assert "gateway sent 4 prefill + 4 decode selections for 4 requests" in t
    assert "prefill ran 1564/1560 prompt tokens forward, decode finished 4/4 (32 tokens)" in t
    assert t.endswith("gsm8k vs `1`: 25/32 same answers (tolerance 25%)")


def test_epd_proof_line():
    line = report.details({"epd_proof": {"gateway_encode_selections": 3, "image_items": 3,
                                          "decode_success": 3, "requests": 3}})
    assert line == "encoder proof: 3/3 image items dispatched to encode, decode finished 3/3"


def test_main_job_verdict_lines_proof_oracle_and_failure():
    """The oracle part is built by the real producer (oracle.compare/judge, the shape that
    comparisons.against_one_worker returns): a hook written against a made-up shape once
    printed "0 identical, 0 numerics, 0 mismatch" for a 32-item pass."""
    from e2e_test.infra.reports import verdicts
    from e2e_test.infra.verdicts import oracle
    from e2e_test.infra.verdicts.oracle import Step

    def steps(*toks):
        return [Step(t, -0.1, {t: -0.1, "x": -3.0}) for t in toks]

    base = {i: steps("a", "b") for i in range(3)}
    same = oracle.compare("gsm8k", "vllm/prefill-0 alone", "vllm/1p1d", base, base)
    control = oracle.ControlArm([same])
    bad = {**base, 2: steps("a", "c")}
    printed = []
    lines = verdicts.print_verdicts({
        "pd_proof": {"decode_external": 1445, "prompt_tokens": 1445, "decode_local_compute": 0,
                     "nixl_bytes": 2**20 * 35.0},
        "oracle": {"gsm8k": oracle.judge(same, control).to_dict(),
                   "mmlu": oracle.judge(oracle.compare("mmlu", "vllm/prefill-0 alone",
                                                      "vllm/1p1d", base, bad),
                                        control).to_dict()}}, out=printed.append)
    assert lines[0] == ("KV proof: decode got 1445/1445 prompt tokens by transfer, recomputed 0, "
                        "35.0 MiB over NIXL")
    assert lines[1].startswith("answers, gsm8k: ok: gsm8k vllm/1p1d vs vllm/prefill-0 alone: "
                               "3 identical, 0 numerics, 0 mismatch"), lines[1]
    # negative control: a mismatching item is counted and fails the line
    assert lines[2].startswith("answers, mmlu: FAILED: "), lines[2]
    assert "2 identical, 0 numerics, 1 mismatch" in lines[2], lines[2]
    assert printed[0].startswith("  KV proof")
    assert verdicts.print_verdicts({"topology": "1"}, out=printed.append) == []
    assert verdicts.proof_lines({"proof_error": "PD transfer proof failed on 1p1d: x"}) == [
        "proof FAILED: PD transfer proof failed on 1p1d: x"]


def test_afd_comparison_with_the_native_baseline_reads_in_both_record_shapes():
    """The AFD suite's record key (engines/afd.py NATIVE_COMPARISON_KEY): the oracle's verdict,
    and the per-baseline counts of result files written before the oracle."""
    verdict = {"ok": True, "message": "afd-prompts vllm/native vs vllm/1a1f: 8 identical",
               "comparison": {"max_first_step_delta": 0.01}}
    assert report.details({"afd_vs_native": verdict}) == \
        "ok: afd-prompts vllm/native vs vllm/1a1f: 8 identical; max first-step delta 0.01 nats"
    old = {"native-dp2": {"same_text": 7, "prompts": 8, "same_first_token": 8}}
    assert report.details({"afd_vs_native": old}) == \
        "vs native-dp2: 7/8 identical outputs, 8/8 same first token"


def test_the_report_carries_the_runs_time_report_and_its_boot_phases(tmp_path):
    import json
    import shutil
    from pathlib import Path

    from e2e_test.infra.reports import report
    src = (Path(__file__).parent.parent
           / "docs/validation/h100-e2e-1gpu-pd-tokenspeed-pd-896a6a9")
    text = report.render([src])
    assert ("- time: boots 39 %, traffic 50 %, teardown 7 %, idle 4 % of 57 s "
            "(3 boots, 22 s; compile cache: 5 unknown); 4 topologies at once") in text
    assert ("- boot phases (median of 5 worker boots): starting 7.9 s, server imported, "
            "starting engine 1.0 s") in text
    d = tmp_path / "run"
    shutil.copytree(src, d)
    rep = json.loads((d / "timing.json").read_text())
    rep["boot_phases"] = {"boots": 5, "median_s": {"starting": 24.3, "loading weights": 20.1}}
    (d / "timing.json").write_text(json.dumps(rep))
    assert ("- boot phases (median of 5 worker boots): starting 24.3 s, loading weights "
            "20.1 s") in report.render([d])
    del rep["boot_phases"]                            # a report from before phases were kept
    (d / "timing.json").write_text(json.dumps(rep))
    assert "boot phases" not in report.render([d])
    (d / "timing.json").unlink()
    assert "- time:" not in report.render([d])


def test_gateway_cell_says_which_probes_failed():
    """A gateway's readiness with the probes that failed on the way (readiness.ModelServed),
    as TokenSpeed's 1p1d gateways see them; a record without them (an older one) or with
    none reads as the readiness alone."""
    assert report.gateway_cell({"gateway_ready_s": 1.87}) == "1.9 s"
    assert report.gateway_cell({"gateway_ready_s": 1.87, "gateway_probe_failures": []}) == "1.9 s"
    cell = report.gateway_cell({"gateway_ready_s": 7.17, "gateway_probe_failures": [
        {"after_s": 3.0, "error": "probe chat completion HTTP 504: {\"error\": |silence|}"}]})
    assert cell == "7.2 s (1 failed probe: HTTP 504 after 3.0 s)"
    many = report.gateway_cell({"gateway_ready_s": 20.0, "gateway_probe_failures": [
        {"after_s": 3.0, "error": "probe chat completion ReadTimeout('slow')"}] * 5})
    assert many.startswith("20.0 s (5 failed probes: ReadTimeout('slow') after 3.0 s;")
    assert many.endswith("; 2 more)") and "|" not in many
