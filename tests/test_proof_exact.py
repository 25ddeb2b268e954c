"""The exact PD, EPD and AFD proofs (engines/vllm.vllm_transfer_problems,
engines/tokenspeed.tokenspeed_transfer_problems and epd_problems, engines/afd.afd_trace_problems;
the shared KV arithmetic in proof.py) against the figures the H200 runs recorded (their proof
records, kept in each run's line of docs/validation/index.jsonl), each with negative controls
built from the same numbers."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from e2e_test.infra.engines import afd, tokenspeed, vllm
from e2e_test.infra.reports import index
from e2e_test.infra.reports.results import safe_name
from e2e_test.infra.verdicts import proof

INDEX = {x["run"]: x for x in index.read(
    Path(__file__).resolve().parent.parent / "docs" / "validation" / "index.jsonl")}
# SmolLM2-135M-Instruct's config.json (the fields the KV size depends on)
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "hidden_size": 576, "dtype": "bfloat16"}


def _record(run, test):
    """The proof keys of the run's first test whose record file name (results.safe_name of
    its id) holds `test` (index.jsonl `proofs`)."""
    proofs = INDEX[run]["proofs"]
    return proofs[next(t for t in sorted(proofs) if test in safe_name(t))]


def test_kv_bytes_per_token_of_smollm2():
    per_token, layout = proof.kv_bytes_per_token(SMOLLM2, "bfloat16")
    assert per_token == 23040 == 30 * 2 * 3 * 64 * 2
    assert layout["head_dim"] == 64 and layout["dtype_bytes"] == 2
    no_head_dim = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}
    assert proof.kv_bytes_per_token(no_head_dim, "bfloat16")[0] == 23040   # 576 / 9
    assert proof.kv_bytes_per_token(SMOLLM2, "fp8")[0] == 11520
    with pytest.raises(proof.HarnessError, match="size is unknown"):
        proof.kv_bytes_per_token(SMOLLM2, "int3")


def test_kv_dtype_and_cache_config():
    assert proof.kv_dtype("auto", ["--dtype", "bfloat16"], {}) == "bfloat16"
    assert proof.kv_dtype("fp8", ["--dtype", "bfloat16"], {}) == "fp8"
    assert proof.kv_dtype(None, [], {"torch_dtype": "float16"}) == "float16"
    assert proof.kv_dtype(None, [], SMOLLM2) == "bfloat16"
    # argparse keeps the last --dtype: the model's, then a CPU worker's or the user's extra
    assert proof.kv_dtype(None, ["--dtype", "bfloat16", "--dtype", "float32"], {}) == "float32"
    assert proof.kv_dtype(None, ["--dtype=bfloat16", "--dtype", "float32"], {}) == "float32"
    samples = {("vllm:cache_config_info", (("block_size", "16"), ("cache_dtype", "auto"))): 1.0,
               ("vllm:num_requests_running", ()): 0.0}
    assert vllm.cache_config(samples) == {"block_size": "16", "cache_dtype": "auto"}
    assert vllm.cache_config({}) == {}


RUNS = ["h200-e2e-1gpu-pd-vllm", "h200-e2e-1gpu-pd-vllm-05e988f", "h200-1gpu-pd-packed",
        "h200x2-pd"]


@pytest.mark.parametrize("run", RUNS)
def test_recorded_bytes_are_every_block_holding_a_prompt_token(run):
    """The records kept the total prompt tokens only: the bytes must be a block count that
    prompts of that total can make with sum ceil(p_i / 16), and more than full blocks alone
    (sum floor(p_i / 16) <= floor(total / 16)) could: the last partial block moves too."""
    p = _record(run, "test_pd_kv_transfer_proof")["pd_proof"]
    per_block = 16 * 23040
    assert p["nixl_bytes"] % per_block == 0
    blocks = int(p["nixl_bytes"] // per_block)
    lo, hi = proof.blocks_range(p["prompt_tokens"], p["requests"], 16)
    assert lo <= blocks <= hi, (blocks, lo, hi)
    assert blocks > p["prompt_tokens"] // 16            # full blocks alone fall short
    assert p["decode_external"] == p["prompt_tokens"] == p["prefill_local_compute"]
    assert p["decode_local_compute"] == 0 and p["nixl_transfers"] == p["requests"]


def _vllm_proof(**kw):
    """The h200-e2e-1gpu-pd-vllm figures (1438 tokens, 4 requests, 33,914,880 B), with a
    per-request split that the record did not keep (any split of 4 prompts of 353-368 tokens
    makes 23 blocks each; from now on the proof records the split)."""
    p = _record("h200-e2e-1gpu-pd-vllm", "test_pd_kv_transfer_proof")["pd_proof"]
    base = vllm.TransferProof(
        requests=p["requests"], prompt_tokens=p["prompt_tokens"],
        decode_external=p["decode_external"], decode_local_compute=p["decode_local_compute"],
        decode_local_cache_hit=p["decode_local_cache_hit"],
        prefill_local_compute=p["prefill_local_compute"], nixl_bytes=p["nixl_bytes"],
        nixl_transfers=p["nixl_transfers"], failed_transfers=p["failed_transfers"],
        prompt_tokens_each=[359, 360, 359, 360], block_size=16, kv_bytes_per_token=23040)
    return replace(base, **kw)


def test_recorded_vllm_proof_passes_exactly():
    p = _vllm_proof()
    assert p.expected_blocks == 92 and p.expected_bytes == 33914880 == p.nixl_bytes
    assert vllm.vllm_transfer_problems(p) == []
    assert p.to_dict()["expected_bytes"] == 33914880


@pytest.mark.parametrize("broken, why", [
    # the last (partial) block of every request not moved: 4 blocks fewer
    ({"nixl_bytes": 33914880 - 4 * 16 * 23040}, "NIXL moved 32440320 B (88 blocks)"),
    # the last block of one request missing
    ({"nixl_bytes": 33914880 - 16 * 23040}, "(91 blocks), expected 33914880 B = 92 blocks"),
    # one layer of the 30 not moved
    ({"nixl_bytes": 33914880 * 29 // 30}, "expected 33914880 B"),
    # the bytes of a model with 29 layers: what a config that lost one would expect
    ({"kv_bytes_per_token": 29 * 2 * 3 * 64 * 2}, "expected 32784384 B"),
    # decode recomputed the last token of each prompt
    ({"decode_external": 1434.0, "decode_local_compute": 4.0}, "decode received KV for 1434"),
    ({"prefill_local_compute": 1437.0}, "prefill computed 1437 of 1438"),
    ({"failed_transfers": 1.0}, "1 failed KV transfers"),
    ({"nixl_transfers": 3.0}, "3 NIXL transfers for 4 requests"),
    ({"block_size": None}, "the bytes cannot be checked"),
    ({"prompt_tokens_each": [359, 360, 359, 361]}, "do not add up to 1438"),
    ({"prompt_tokens": 0}, "nothing was proved"),
])
def test_vllm_proof_negative_controls(broken, why):
    problems = vllm.vllm_transfer_problems(_vllm_proof(**broken))
    assert problems and any(why in p for p in problems), problems


def test_vllm_proof_without_nixl_checks_tokens_only():
    p = _vllm_proof(nixl=False, nixl_bytes=0.0, nixl_transfers=0.0, block_size=None)
    assert vllm.vllm_transfer_problems(p) == []
    assert vllm.vllm_transfer_problems(replace(p, decode_external=0.0))


def test_blocks_range():
    assert proof.blocks_range(1438, 4, 16) == (90, 93)
    assert proof.blocks_range(32, 2, 16) == (2, 3)          # 16+16 or 1+31
    assert proof.blocks_range(3, 3, 16) == (1, 3)


# -- TokenSpeed -------------------------------------------------------------------------------

TS_RUNS = ["h200x2-tokenspeed", "h200x2-tokenspeed-pd-rerun"]


def _ts(run, **kw):
    p = dict(_record(run, "test_pd_kv_transfer_proof")["pd_proof"])
    return tokenspeed.TokenSpeedPDProof(**{**p, **kw})


@pytest.mark.parametrize("run", TS_RUNS)
def test_recorded_tokenspeed_proofs_pass(run):
    p = _ts(run)
    assert p.decode_prompt_tokens == p.prompt_tokens
    assert p.prefill_forward_tokens == p.prompt_tokens + p.requests
    assert tokenspeed.tokenspeed_transfer_problems(p, p.requests) == []


@pytest.mark.parametrize("run", TS_RUNS)
@pytest.mark.parametrize("broken, why", [
    ("decode_short", "decode counted"),
    ("prefill_short", "prefill ran"),
    ("prefill_extra", "prefill ran"),
    ("decode_lost_one", "decode finished only 3 of 4"),
    ("no_decode_selection", "the gateway picked"),
    ("no_prompt", "no prompt tokens sent: nothing was proved"),
    ("no_generation", "decode generated no tokens"),
])
def test_tokenspeed_proof_negative_controls(run, broken, why):
    p = _ts(run)
    changed = {"decode_short": {"decode_prompt_tokens": p.prompt_tokens - p.prompt_tokens // 4},
               "prefill_short": {"prefill_forward_tokens": 0.9 * p.prompt_tokens},
               "prefill_extra": {"prefill_forward_tokens": p.prompt_tokens + 2 * p.requests},
               "decode_lost_one": {"decode_success": 3.0},
               "no_decode_selection": {"gateway_decode_selections": 3},
               "no_prompt": {"prompt_tokens": 0},
               "no_generation": {"decode_generation_tokens": 0.0}}[broken]
    problems = tokenspeed.tokenspeed_transfer_problems(replace(p, **changed), p.requests)
    assert any(why in x for x in problems), problems


# -- TokenSpeed EPD -----------------------------------------------------------------------------

EPD_RUNS = ["h200-e2e-1gpu-epd-tokenspeed-156fb87", "h200-e2e-1gpu-epd-tokenspeed-96e9300",
            "h200-e2e-1gpu-epd-tokenspeed-cdba3e8"]


def _epd(run, **kw):
    p = dict(_record(run, "test_epd_encoder_proof")["epd_proof"])
    return tokenspeed.EncoderProof(**{**p, **kw})


@pytest.mark.parametrize("run", EPD_RUNS)
def test_recorded_epd_proofs_pass(run):
    p = _epd(run)
    assert p.prefill_forward_tokens == p.prompt_tokens + p.requests
    assert tokenspeed.epd_problems(p, p.requests) == []


@pytest.mark.parametrize("run", EPD_RUNS)
@pytest.mark.parametrize("broken, why", [
    ({"gateway_encode_selections": 2}, "the gateway sent 2 of 3 image items to an encode"),
    ({"gateway_prefill_selections": 2}, "the gateway picked prefill 2"),
    ({"gateway_transfer_failures": 1}, "1 bootstrap/transfer failures"),
    ({"decode_success": 2.0}, "decode finished only 2 of 3"),
    # the image's tokens never run forward on the prefill (embeddings lost), or it recomputed
    ({"prefill_forward_tokens": 10.0}, "prefill ran 10 tokens forward"),
    ({"prefill_forward_tokens": "recompute"}, "prefill ran"),
    ({"image_items": 0}, "nothing was proved"),
    ({"prompt_tokens": 0}, "nothing was proved"),
], ids=["encode-short", "prefill-pick", "transfer", "decode-lost", "prefill-skipped",
        "prefill-recomputed", "no-image", "no-prompt"])
def test_epd_proof_negative_controls(run, broken, why):
    p = _epd(run)
    if broken.get("prefill_forward_tokens") == "recompute":
        broken = {"prefill_forward_tokens": 2.0 * p.prompt_tokens}
    problems = tokenspeed.epd_problems(replace(p, **broken), p.requests)
    assert any(why in x for x in problems), problems


def test_the_recorded_epd_negative_control_fails_the_exact_checks_too():
    """The recorded e2e negative control (a regular worker read as all three roles): the
    gateway picked no leg, and its forward tokens (prompt and decode steps, 290 for 266 prompt
    tokens) are outside the prefill's bound."""
    msg = _record("h200-e2e-1gpu-epd-tokenspeed-96e9300",
                  "test_epd_proof_fails_where_nothing_moved")["epd_proof_negative_control"]
    p = tokenspeed.EncoderProof(**json.loads(msg[msg.index("{"):].rstrip(")").replace("'", '"')))
    problems = tokenspeed.epd_problems(p, p.requests)
    assert any("prefill ran 290 tokens forward for 266" in x for x in problems), problems
    assert any("0 of 3 image items" in x for x in problems), problems


# -- AFD ----------------------------------------------------------------------------------------

def _ffn(**kw):
    p = dict(_record("h200x2-afd", "test_afd_ffn_served_vllm-1a1f")["afd_ffn_proof"])
    p.pop("new_traces")
    return replace(afd.FfnProof(**p), **kw)


def test_recorded_afd_proof_passes():
    p = _ffn()
    assert (p.new_traces, p.expected_min_new) == (8, 7)
    assert afd.afd_trace_problems(p) == []


@pytest.mark.parametrize("broken, why", [
    ({"traces_after": 2 + 1}, "1 new FFN step traces, 7 expected"),     # one trace: not enough
    ({"traces_after": 2 + 6}, "6 new FFN step traces, 7 expected"),
    ({"traces_after": 2}, "0 new FFN step traces"),
    ({"kernel_events": 0}, "no GPU kernel"),
    ({"completion_tokens": 0}, "generated no token"),
    ({"kernel_events": None}, "none of the 8 new FFN traces could be read"),
])
def test_afd_proof_negative_controls(broken, why):
    problems = afd.afd_trace_problems(_ffn(**broken))
    assert any(why in x for x in problems), problems
