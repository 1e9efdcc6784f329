"""``specdec bench`` argument parsing and the command itself."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from pathlib import Path

from specdec import defaults
from specdec.bench.journal import Journal
from specdec.errors import ConfigError, MissingPackageError
from specdec.outputs import check_folder


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


#: environment variables that change what a bench runs (the workers inherit them)
COMMAND_ENV = ("SPECDEC_INT8_KERNEL", "SPECDEC_SCRIPTED")


def command_line(argv: list[str], environ) -> str:  # noqa: ANN001 - a mapping such as os.environ
    """The command as a user would retype it, with the settings of :data:`COMMAND_ENV` in front."""
    env = [f"{var}={shlex.quote(environ[var])}" for var in COMMAND_ENV if environ.get(var)]
    return " ".join([*env, "specdec bench", *(shlex.quote(a) for a in argv)])


def add_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    p = sub.add_parser(
        "bench",
        help="benchmark plain and speculative decoding, Hugging Face, llama.cpp and edge-cloud runs on the same prompts",
        description="Run every mode (each in its own process) on the same prompts, sampling settings and seeds; "
        "write results.json, a Markdown summary (README.md) and PNG plots.",
    )
    p.add_argument("--target", default=defaults.DEFAULT_TARGET, help=f"target model (default {defaults.DEFAULT_TARGET})")
    p.add_argument("--draft", default=defaults.DEFAULT_DRAFT, help=f"draft model, 'NAME+lookup' (prompt lookup, the draft model NAME where nothing repeats), 'ngram', 'lookahead', 'self', a draft head (EAGLE / Medusa / MTP folder or name), or a self-speculative view of the target: layerskip:K, self-skip, swift, kangaroo (modes plain,speculative); a comma list compares several drafters in one run: each decodes every prompt beside the same paired plain run (modes plain,speculative) (default {defaults.DEFAULT_DRAFT})")
    p.add_argument("--modes", default="plain,edge_only,speculative,hf_plain,hf_assisted",
                   help="comma list of plain (the target alone; 'cloud_only' is accepted too), edge_only (the draft alone), speculative, "
                   "hf_plain, hf_assisted, llamacpp (llama.cpp on the target's GGUF; needs the llamacpp extra) (local), and edge_cloud, cloud_streaming, cloud_streaming_spec (cloud server process "
                   "+ edge process over an emulated RTT) (default plain,edge_only,speculative,hf_plain,hf_assisted)")
    p.add_argument("--methods", default="default", help="comma list of rules for the speculative mode ('default' = greedy at T=0, block otherwise; default: default). 'coupled' at T>0 adds a paired plain seeded-sampling run, its rows' reference")
    p.add_argument("--gammas", default="auto", help="comma list of γ values (integers, 'auto', 'guide'; default auto)")
    p.add_argument("--trees", default="", help="comma list of token-tree settings ('auto' or a node count) run after the chain γ values of the speculative mode, prompt by prompt in the same process (paired); rows are labelled tree-<setting> (default: none)")
    p.add_argument("--tree-min-prob", type=float, default=None, metavar="P",
                   help=f"greedy and coupled trees: leave out nodes whose cumulative draft probability is below P (see "
                        f"specdec generate --help; default {defaults.TREE_MIN_PROB:g})")
    p.add_argument("--temperatures", default="0,1", help="comma list (0 = greedy; default 0,1)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--repeats", type=int, default=1, help="seeds per prompt (seed, seed+1, ...; default 1)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--top-p", type=float, help="nucleus sampling at T > 0 (default off)")
    p.add_argument("--repetition-penalty", type=float, help="repetition penalty (default off = 1.0)")
    p.add_argument("--prompts", help="JSONL prompt file (fields: prompt, id, category, chat); default: the built-in set")
    p.add_argument("--categories", help="comma list of prompt categories to keep (e.g. code,chat; default all)")
    p.add_argument("--limit", type=int, help="keep the first N prompts of each category (default all)")
    p.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8", "w8a8", "q4"],
                   help="draft precision (see specdec generate --help; default auto)")
    p.add_argument("--draft-vocab", default="auto", metavar="auto|full|auto,full",
                   help="the draft model's vocabulary: auto = the reduced one its folder ships, else all; full = all"
                        " tokens (see specdec generate --help); auto,full runs every drafter under both, side by side"
                        " beside the same paired plain run (modes plain,speculative) (default auto)")
    p.add_argument("--draft-temperature-factor", default="auto", metavar="auto|F",
                   help="drafters that sample from a model sample at F x the temperature: auto = the factor the draft's"
                        " folder ships, else 1 (see specdec generate --help; default auto)")
    p.add_argument("--dtype", "--target-dtype", dest="dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8", "q4"],
                   help="target precision for specdec's rows (default auto; see specdec generate --help)."
                        " The Hugging Face rows always run the float32 weights")
    p.add_argument("--fast-attention", action="store_true", help="target without batch invariance (see specdec generate --help; default off)")
    p.add_argument("--kv-dtype", default=defaults.KV_DTYPE, choices=["auto", "float16"],
                   help="the target's key/value cache for specdec's rows (default auto; see specdec generate --help)")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: torch's choice; network modes: the server and each edge process get this many, default 1)")
    g = p.add_argument_group("llama.cpp mode (llamacpp; needs the llamacpp extra)")
    g.add_argument("--llamacpp", default="plain,spec",
                   help="comma list of llama.cpp rows on the target's GGUF: plain, spec (the binding's speculative loop with the "
                   "draft converted to GGUF), lookup (its prompt-lookup drafter); they run inside the speculative worker, "
                   "prompt by prompt, when that mode runs too (default plain,spec)")
    g.add_argument("--llamacpp-draft-max", type=int, default=16, help="spec: most tokens drafted per round (default 16, llama.cpp's)")
    g.add_argument("--llamacpp-p-min", type=float, default=0.75,
                   help="spec: stop drafting after a token the draft gives less than this probability (default 0.75, llama.cpp's)")
    g = p.add_argument_group("edge-cloud modes (edge_cloud, cloud_streaming, cloud_streaming_spec)")
    g.add_argument("--rtts", default="0,20,50,100", help="comma list of emulated round-trip times in ms (default 0,20,50,100)")
    g.add_argument("--wires", default="greedy,coupled,sparse-q,lossy-scalar",
                   help="comma list of wire modes for edge_cloud; each runs where valid (greedy at T=0, the others at T>0; default all four)")
    g.add_argument("--rtt-emulation", default="auto", choices=["auto", "proxy", "netem"],
                   help="auto = tc netem in network namespaces where scripts/netem.sh finds it, else the asyncio delay proxy (default auto)")
    g.add_argument("--q-top-k", type=int, default=16, help="sparse-q: top-k truncation of q (default 16)")
    p.add_argument("--out", help="output folder (default benchmarks/run-<date>)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the run that was stopped (Ctrl-C, SIGTERM, a failing worker) in --out: repeat its "
                        "command with --resume; the prompts each mode finished (kept in OUT/partial.jsonl while a run goes "
                        "on; edge-cloud modes: at each RTT) are not run again (default off)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (default: draw them)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: re-render README.md and the plots of --out from its results.json (default off)")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from specdec.bench import report, runner, workloads
    from specdec.engine import parse_gamma, parse_tree, parse_tree_min_prob
    from specdec.verify import get_rule

    if args.report_only:
        if args.resume:
            raise ConfigError("--resume runs the rest of a run; --report-only runs nothing: give one of them")
        return _rerender(args)
    if args.resume and not args.out:
        raise ConfigError("--resume needs --out: the folder of the run to go on with")
    temps = _non_negative(args.temperatures, "temperatures must be numbers", "temperature must be >= 0")
    gammas = [str(parse_gamma(g)) for g in _csv(args.gammas)]
    gammas += [f"tree-{parse_tree(t)}" for t in _csv(args.trees) if str(parse_tree(t)) != "chain"]
    parse_tree_min_prob(args.tree_min_prob)  # a bad value fails here, before any worker starts
    methods = _csv(args.methods)
    for m in methods:
        if m != "default":
            get_rule(m)
    if args.max_new_tokens < 1 or args.repeats < 1:
        raise ConfigError("--max-new-tokens and --repeats must be >= 1")
    modes = _csv(args.modes)
    for name, listed in (("--modes", modes), ("--temperatures", temps), ("--methods", methods)):
        if not listed:
            raise ConfigError(f"{name} is empty: nothing would run")
        twice = sorted({str(x) for x in listed if listed.count(x) > 1})
        if twice:  # a mode run twice is two samples per prompt, and its own "×plain" reads against itself
            raise ConfigError(f"{name} lists {', '.join(twice)} more than once")
    if "speculative" in modes and not gammas:
        raise ConfigError("--gammas (with --trees) is empty: the speculative mode would run no setting")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.repetition_penalty is not None and not args.repetition_penalty > 0.0:
        raise ConfigError(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    rtts, wires = _network_args(args, temps)
    llamacpp = _llamacpp_args(args)
    from specdec.drafters.heads import resolve_head
    from specdec.drafters.self_spec import parse_name

    from specdec.drafters.hybrid import split_lookup

    from specdec.bench.runner import split_drafts, split_vocabs

    drafts = split_drafts(args.draft)
    if not drafts:
        raise ConfigError("--draft is empty")
    if len(drafts) != len(set(drafts)):
        raise ConfigError(f"--draft lists a drafter twice: {args.draft}")
    vocabs = split_vocabs(args.draft_vocab)
    if len(drafts) > 1 or len(vocabs) > 1:  # several drafters side by side: only the speculative mode compares them
        bad = [m for m in _csv(args.modes) if m not in ("plain", "cloud_only", "speculative")]
        what = f"--draft with several drafters ({args.draft})" if len(drafts) > 1 else f"--draft-vocab {args.draft_vocab}"
        if bad:
            raise ConfigError(f"{what} runs with --modes plain,speculative only; {', '.join(bad)} need one draft")
    from specdec.engine import check_draft_name, parse_temperature_factor
    from specdec.models.registry import check_name

    check_name(args.target)  # a typo fails now, not after minutes of other modes
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    parse_temperature_factor(args.draft_temperature_factor)
    for draft in drafts:
        check_draft_name(draft)
        base = split_lookup(draft)[0]  # NAME+lookup: what matters here is NAME
        if parse_name(base) is not None:  # a view of the target: there is no draft model to run alone
            bad = [m for m in _csv(args.modes) if m in ("edge_only", "hf_assisted", "edge_cloud")]
            if bad:
                raise ConfigError(f"--draft {draft} is a self-speculative view of the target: modes {', '.join(bad)} "
                                  "need a separate draft model (use --modes plain,speculative)")
        elif resolve_head(base) is not None:  # a head reads the target's hidden states: it never runs alone
            bad = [m for m in _csv(args.modes) if m not in ("plain", "cloud_only", "speculative")]
            if bad:
                raise ConfigError(f"--draft {draft} is a draft head (it reads the target's hidden states): modes "
                                  f"{', '.join(bad)} need a separate draft model (use --modes plain,speculative)")
    prompts = workloads.load_jsonl(args.prompts) if args.prompts else list(workloads.BUILTIN)
    prompts = workloads.select(prompts, categories=_csv(args.categories) if args.categories else None, limit=args.limit)
    command = command_line(argv if argv is not None else sys.argv[2:], os.environ)

    cfg = runner.BenchConfig(
        target=args.target, draft=args.draft, prompts=tuple(prompts), modes=tuple("plain" if m == "cloud_only" else m for m in _csv(args.modes)),
        methods=tuple(methods), gammas=tuple(gammas), temperatures=tuple(temps),
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, draft_dtype=args.draft_dtype, draft_vocab=",".join(vocabs), dtype=args.dtype,
        draft_temperature_factor=args.draft_temperature_factor,
        tree_min_prob=defaults.TREE_MIN_PROB if args.tree_min_prob is None else args.tree_min_prob,
        batch_invariant=not args.fast_attention, kv_dtype=args.kv_dtype, threads=args.threads, command=command,
        rtts=tuple(rtts), wires=tuple(wires), rtt_emulation=args.rtt_emulation, q_top_k=args.q_top_k,
        llamacpp=tuple(llamacpp), llamacpp_draft_max=args.llamacpp_draft_max, llamacpp_p_min=args.llamacpp_p_min,
    )
    out = args.out or f"benchmarks/run-{time.strftime('%Y%m%d-%H%M%S')}"
    check_plots(args.no_plots)  # a missing extra fails now, not after every mode has run
    check_folder(Path(out))  # a bad --out fails now, not after every mode has run
    check_not_foreign(Path(out))
    journal = Journal.open(Path(out), runner.config_dict(cfg), resume=args.resume, machine=runner.machine_info())
    if journal.kept.parts:
        print(f"[specdec] resuming {out}: {len(journal.kept.samples)} generations kept", file=sys.stderr)
    try:
        result = runner.run(cfg, journal=journal)
    except BaseException:  # Ctrl-C, SIGTERM (a KeyboardInterrupt), a failing worker, ...
        kept = journal.stop()
        if kept:
            print(f"[specdec] stopped: {out}/{journal.path.name} keeps {kept} generation{'s' * (kept != 1)}; the same"
                  f" command with --resume{'' if args.out else f' --out {out}'} goes on from there", file=sys.stderr)
        raise
    written = report.write(result, out, make_plots=not args.no_plots)
    journal.remove()
    print(f"[specdec] wrote {written['dir']}/README.md, results.json and {len(written['plots'])} plots", file=sys.stderr)
    for g in written["stats"]:
        if g.mode == "speculative":
            vs = [f"×{ratio:.2f} {name}" for ratio, name in ((g.speedup_vs_cloud, "plain"), (g.speedup_vs_hf_assisted, "HF assisted"))
                  if ratio is not None]
            print(f"[specdec] {g.what} γ={g.gamma} T={g.temperature:g}: {g.tokens_per_s_median:.1f} tok/s"
                  + "".join(f", {v}" for v in vs), file=sys.stderr)
    for n in written["network"]:
        print(f"[specdec] {n.label} γ={n.gamma or '–'} T={n.temperature:g} RTT {n.rtt_ms:g} ms: {n.tokens_per_s_median:.1f} tok/s, "
              f"×{(n.speedup_vs_streaming or 0):.2f} cloud_streaming", file=sys.stderr)
    return 0


def check_plots(no_plots: bool) -> None:
    """The plots need matplotlib (the 'bench' extra): without it a run is refused before it starts."""
    if no_plots:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingPackageError("the bench's plots need the 'bench' extra (matplotlib is missing): "
                                  "pip install 'specdec[bench]', or pass --no-plots") from None


def _is_bench_result(result: object) -> bool:
    """Whether a parsed results.json is a bench result (a JSON object with 'config' and 'samples')."""
    return isinstance(result, dict) and "samples" in result and "config" in result


def _bench_result(path: Path) -> bool:
    """Whether ``path`` holds a bench result."""
    import json

    try:
        return _is_bench_result(json.loads(path.read_text()))
    except (OSError, ValueError):
        return False


def check_not_foreign(out: Path) -> None:
    """The run replaces ``out``'s README.md and results.json: refuse a folder where those files are
    something else's (a project's README, another tool's results), which a run would overwrite.
    A folder an earlier bench run wrote (its results.json is a bench result) is run again."""
    results, readme = out / "results.json", out / "README.md"
    if results.exists() and not _bench_result(results):
        raise ConfigError(f"--out {out}: {results} is not a specdec bench result and the run would replace it;"
                          " give another folder")
    if readme.exists() and not results.exists():
        raise ConfigError(f"--out {out}: {readme} was not written by specdec bench (no results.json beside it)"
                          " and the run would replace it; give another folder")


def _rerender(args: argparse.Namespace) -> int:
    """``--report-only``: the summary and plots again from a committed ``results.json``."""
    import json

    from specdec.bench import report

    if not args.out:
        raise ConfigError("--report-only needs --out: the folder holding results.json")
    path = Path(args.out) / "results.json"
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not _is_bench_result(result):
        raise ConfigError(f"{path} is not a specdec bench result (no 'config' / 'samples')")
    check_plots(args.no_plots)
    written = report.write(result, args.out, make_plots=not args.no_plots)
    print(f"[specdec] re-rendered {written['dir']}/README.md and {len(written['plots'])} plots", file=sys.stderr)
    return 0


def _non_negative(text: str, not_number: str, negative: str) -> list[float]:
    """A comma list of numbers >= 0, or a ConfigError with the caller's wording."""
    values = []
    for item in _csv(text):
        try:
            values.append(float(item))
        except ValueError:
            raise ConfigError(f"{not_number}, got {item!r}") from None
        if not math.isfinite(values[-1]) or values[-1] < 0:  # NaN and infinity too, before any worker starts
            raise ConfigError(f"{negative}, got {item}")
    return values


def _llamacpp_args(args: argparse.Namespace) -> list[str]:
    """Checked ``--llamacpp`` variants (and the extra installed, when the mode is requested)."""
    from specdec.bench.llamacpp import VARIANTS, require

    variants = _csv(args.llamacpp)
    for v in variants:
        if v not in VARIANTS:
            raise ConfigError(f"unknown llama.cpp row {v!r}; choose from {', '.join(VARIANTS)}")
    if args.llamacpp_draft_max < 1:
        raise ConfigError("--llamacpp-draft-max must be >= 1")
    if not 0 <= args.llamacpp_p_min < 1:
        raise ConfigError(f"--llamacpp-p-min must be in [0, 1), got {args.llamacpp_p_min}")
    if "llamacpp" in _csv(args.modes):
        if not variants:
            raise ConfigError("--llamacpp is empty")
        require()
    return variants


def _network_args(args: argparse.Namespace, temps: list[float]) -> tuple[list[float], list[str]]:
    """Parsed and checked ``--rtts`` and ``--wires``."""
    from specdec.bench.network import wire_valid
    from specdec.remote.wire import WIRE_MODES

    rtts = _non_negative(args.rtts, "--rtts must be numbers of milliseconds", "an RTT must be >= 0 ms")
    wires = _csv(args.wires)
    for w in wires:
        if w not in WIRE_MODES:
            raise ConfigError(f"unknown wire mode {w!r}; choose from {', '.join(WIRE_MODES)}")
    if not rtts:
        raise ConfigError("--rtts is empty")
    if "edge_cloud" in _csv(args.modes) and not any(wire_valid(w, t) for w in wires for t in temps):
        raise ConfigError("no --wires value is valid at the --temperatures given (greedy needs T=0, the others T>0)")
    if args.q_top_k < 1:
        raise ConfigError("--q-top-k must be >= 1")
    return rtts, wires
