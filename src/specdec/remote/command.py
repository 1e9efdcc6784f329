"""``specdec generate --remote URL``: draft here with the local draft model, verify on a server."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.errors import ConfigError, MissingPackageError, SpecdecError
from specdec.remote.wire import WIRE_METHODS, WIRE_MODES

if TYPE_CHECKING:
    from specdec.sampling import SamplingConfig

API_KEY_ENV = "SPECDEC_API_KEY"


def remote_only_given(args: argparse.Namespace) -> list[str]:
    """The edge-cloud options of :func:`add_remote_args` that ``args`` sets away from their defaults
    (each spelled as on the command line): without ``--remote`` they would do nothing."""
    own = argparse.ArgumentParser(add_help=False)
    add_remote_args(own)
    return ["--" + name.replace("_", "-") for name, default in vars(own.parse_args([])).items()
            if name != "remote" and getattr(args, name, default) != default]


def add_remote_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("edge-cloud (draft here with --draft, verify on a `specdec serve` server)")
    g.add_argument("--remote", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8000 (an OpenAI-style base URL ending in /v1 works too)")
    g.add_argument("--api-key", help=f"bearer token for the server (default: ${API_KEY_ENV})")
    g.add_argument("--wire", choices=WIRE_MODES, help="what crosses the wire: greedy / coupled (ids only), sparse-q (ids + top-k q), lossy-scalar (one q per token; LOSSY). Default: greedy at temperature 0, coupled otherwise")
    g.add_argument("--q-top-k", type=int, default=16, help="sparse-q: the drafter samples from its top-k q and sends exactly that (default 16)")
    g.add_argument("--tokenizer", help="model name or folder whose tokenizer to use when --draft is not a model (ngram, none)")
    g.add_argument("--remote-timeout", type=float, default=60.0, help="seconds a round may take, retries included (a lost answer is retried with the same seq); a refused first connection fails at once (default 60)")
    g.add_argument("--lossy-timeout-commit-ms", type=float, help="LOSSY: commit the first draft token when the cloud has not answered after this many ms (a common choice is 400)")
    g.add_argument("--gate", default="off", choices=["off", "shape", "lossy-local-commit"], help="gating: shape = stop drafting at a hard token (exact); lossy-local-commit = keep easy blocks without the cloud (LOSSY). Default off")
    g.add_argument("--gate-entropy-bits", type=float, default=2.5, help="T_H: a token whose draft entropy exceeds this is hard (default 2.5)")
    g.add_argument("--gate-margin", type=float, default=0.2, help="T_margin: top-1 minus top-2 below this is hard (default 0.2)")
    g.add_argument("--gate-nll-bits", type=float, help="T_nll: NLL above this is hard (default off; calibrate it on validation data)")
    g.add_argument("--gate-mc-var", type=float, help="T_var: MC-dropout variance above this is hard (only where the draft has dropout)")
    g.add_argument("--gate-r-hard", type=float, default=0.3, help="R_hard: a block with a larger hard ratio goes to the cloud (default 0.3)")
    g.add_argument("--gate-rules", default="number,date,amount,name,rare", help="rule triggers that make a token hard, comma-separated from number, date, amount, name, rare (default all; 'none' for none)")
    g.add_argument("--gate-freq", help="token frequency table for the 'rare' rule: JSON counts by id, or a text corpus")
    g.add_argument("--gate-rare-max-count", type=int, default=0, help="a token seen at most this often is rare (default 0)")


def wire_for(method: str | None, temperature: float) -> str | None:
    """The wire mode a --method implies (None: let the default decide)."""
    if method is None:
        return None
    key = method.strip().lower().replace("-", "_")
    for wire, methods in WIRE_METHODS.items():
        if key in methods:
            return wire
    raise ConfigError(f"method {method!r} cannot run over the wire; choose from: "
                      + ", ".join(m.replace("_", "-") for ms in WIRE_METHODS.values() for m in ms))


def _gate_config(args: argparse.Namespace) -> Any:
    """The edge gate's checked configuration (None: the gate is off), before anything loads."""
    from specdec.remote.gating import GateConfig

    if args.gate == "off":
        ignored = [flag for flag in remote_only_given(args) if flag.startswith("--gate-")]
        if ignored:
            raise ConfigError(f"{', '.join(ignored)} tune{'s' if len(ignored) == 1 else ''} the edge gate, which is off;"
                              " add --gate shape (or lossy-local-commit), or drop "
                              + ("it" if len(ignored) == 1 else "them"))
        return None
    rules_text = args.gate_rules.strip().lower()
    rules = frozenset() if rules_text in ("", "none") else frozenset(r.strip() for r in rules_text.split(",") if r.strip())
    return GateConfig(
        policy=args.gate,
        t_entropy_bits=args.gate_entropy_bits,
        t_margin=args.gate_margin,
        t_nll_bits=args.gate_nll_bits,
        t_mc_var=args.gate_mc_var,
        r_hard=args.gate_r_hard,
        rules=rules,
        rare_max_count=args.gate_rare_max_count,
    )


def _gate(cfg: Any, args: argparse.Namespace, tokenizer: Any, draft_model: Any, vocab_size: int) -> Any:
    """The edge gate of ``cfg`` (:func:`_gate_config`; None: off) over the edge's tokenizer and draft."""
    from specdec.remote.gating import Gate, RuleTriggers, token_frequency

    if cfg is None:
        return None
    freq = token_frequency(args.gate_freq, tokenizer=tokenizer, vocab_size=vocab_size) if args.gate_freq else None
    triggers = RuleTriggers(tokenizer, rules=cfg.rules, frequency=freq, rare_max_count=cfg.rare_max_count)
    return Gate(cfg, triggers=triggers, draft_model=draft_model)


def run_generate(args: argparse.Namespace, prompt: str, sampling: SamplingConfig, gamma: str | int,
                 tree: str | int = "chain", grammar: str | None = None, chat_template: str | None = None) -> int:
    """The ``generate --remote`` command body (prompt, sampling, γ, the output options' llguidance
    ``grammar`` and ``--chat-template``'s text already parsed by the CLI)."""
    try:
        import httpx  # noqa: F401 - the client's, checked before the draft is loaded
    except ImportError:
        raise MissingPackageError("--remote needs the 'serve' extra (httpx is missing): pip install 'specdec[serve]'") from None
    from transformers import AutoTokenizer

    from specdec import defaults
    from specdec.drafters import NgramDrafter, self_spec
    from specdec.drafters.hybrid import split_lookup
    from specdec.engine import EngineConfig, check_factor_applies, load_draft, model_drafter
    from specdec.models.registry import load_tokenizer, resolve
    from specdec.remote.client import RemoteConfig
    from specdec.remote.edge import generate_remote
    from specdec.text import encode_prompt

    gate_cfg = _gate_config(args)  # bad thresholds fail before the draft loads
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    wire = args.wire or wire_for(args.method, sampling.temperature)
    remote = RemoteConfig(
        url=args.remote,
        api_key=key,
        wire=wire,
        method=args.method,
        timeout_s=args.remote_timeout,
        retry_budget_s=args.remote_timeout,
        lossy_timeout_commit_ms=args.lossy_timeout_commit_ms,
    )
    quiet = args.json
    log = (lambda msg: None) if quiet else (lambda msg: print(f"[specdec] {msg}", file=sys.stderr, flush=True))
    kind = args.draft.strip().lower()
    base, lookup = split_lookup(args.draft)  # the drafter named, and whether "+lookup" put prompt lookup first
    draft = None
    if kind in ("ngram", "none"):
        check_factor_applies(kind, getattr(args, "draft_temperature_factor", "auto"))
        if not args.tokenizer:
            raise ConfigError(f"--draft {kind} with --remote needs --tokenizer (a model name or folder with the target's tokenizer)")
        folder = resolve(args.tokenizer).folder
        tokenizer = load_tokenizer(folder) if folder is not None else AutoTokenizer.from_pretrained(args.tokenizer)
        eos = frozenset({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        drafter = NgramDrafter(max_ngram=defaults.NGRAM_MAX, min_ngram=defaults.NGRAM_MIN) if kind == "ngram" else None
        name = kind
    elif kind == "self" or self_spec.parse_name(base) is not None:
        raise ConfigError(f"--draft {args.draft} drafts with the target's own layers, which stay on the server;"
                          " with --remote pick a draft model, ngram or none")
    elif _is_head(base) or _is_fed(base):
        raise ConfigError(
            f"--draft {args.draft} reads the target's hidden states, which a remote target does not send;"
            " with --remote pick a draft model, ngram or none"
        )
    else:
        if lookup and args.gate != "off":  # the default drafter has lookup in front: drop it, and say so
            log(f"the edge gate judges the draft model's tokens one by one: drafting with {base} alone")
            lookup = False
        log(f"loading draft {base}" + (" (prompt lookup first)" if lookup else ""))
        cfg = EngineConfig(draft=args.draft, backend=args.backend, dtype=args.dtype, draft_dtype=args.draft_dtype,
                           draft_vocab=getattr(args, "draft_vocab", "auto"),
                           draft_temperature_factor=getattr(args, "draft_temperature_factor", "auto"))
        draft = load_draft(cfg)
        tokenizer, eos = draft.tokenizer, draft.eos_ids
        drafter, name = model_drafter(cfg, draft, lookup=lookup)  # NAME+lookup: prompt lookup first
    if chat_template is not None:  # the edge renders the conversation: its tokenizer is the target's
        from specdec.tokenizer import set_chat_template

        set_chat_template(tokenizer, chat_template)
    vocab = draft.vocab_size if draft is not None else len(tokenizer)
    gate = _gate(gate_cfg, args, tokenizer, draft.model if draft is not None else None, vocab)
    # the grammar masks the drafts here and the server reads it with its own tokenizer; the bad words
    # travel as the edge's token sequences (its tokenizer is the target's); the server checks its vocabulary
    from specdec.token_filter import constraint_factory

    make = constraint_factory(tokenizer, vocab, grammar=grammar, allowed_ids=getattr(args, "allowed_token_ids", None) or None,
                              bad_words=getattr(args, "bad_words", None) or ())
    if make is not None:
        from dataclasses import replace

        sampling = replace(sampling, constraint=make())
    log(f"verifying on {args.remote} (wire {wire or 'default'})")
    on_text = None if quiet else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    if args.interactive:
        return _chat(args, prompt, sampling, remote, drafter, draft, dict(
            drafter_name=name, tokenizer=tokenizer, gamma=gamma, tree=tree, tree_min_prob=args.tree_min_prob,
            eos_ids=eos, q_top_k=args.q_top_k, gate=gate, on_text=on_text, vocab_size=vocab))
    suffix = getattr(args, "suffix", None)
    if suffix is None:
        ids = encode_prompt(tokenizer, prompt, chat=args.chat, system=args.system)
    else:  # fill in the middle: the edge builds the prompt from its tokenizer (the target's), the server verifies as ever
        from specdec import fim

        ids, sampling = fim.fill_request(tokenizer, prompt, suffix, sampling)
    out = generate_remote(
        ids, sampling, remote, drafter=drafter, drafter_name=name, tokenizer=tokenizer, gamma=gamma, tree=tree,
        tree_min_prob=args.tree_min_prob, eos_ids=eos, q_top_k=args.q_top_k, gate=gate, on_text=on_text,
        logprobs=getattr(args, "logprobs", None), vocab_size=vocab,
    )
    note = _context_note(out, sampling.max_new_tokens)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    stats = out.summary()
    if args.json:
        stats.update(target=out.remote.get("model", "remote"), temperature=sampling.temperature, seed=out.remote["seed"])
        payload: dict[str, Any] = {"text": out.text, "token_ids": out.token_ids, "stats": stats, "remote": out.remote}
        if out.gate is not None:
            payload["gate"] = out.gate
        if out.logprobs is not None:
            from specdec.text import logprob_rows

            payload["logprobs"] = logprob_rows(tokenizer, out.token_ids, out.logprobs)
        if args.rounds:
            payload["rounds"] = [r.__dict__ for r in out.result.rounds]
        print(json.dumps(payload))
    else:
        sys.stdout.write("\n")
        print(_summary_line(out), file=sys.stderr)
    return 0


def _context_note(out: Any, asked: int) -> str | None:  # an EdgeResult, and the tokens asked for
    from specdec.cli import context_note

    return context_note(out.result.stats, asked, out.remote["max_context"])


def _summary_line(out: Any) -> str:  # an EdgeResult
    stats = out.summary()
    lossy = "" if out.lossless else f"  [LOSSY: {out.remote['unverified_tokens']} unverified tokens, rule {stats['method']}]"
    cached = out.remote.get("session_cached_tokens", 0)
    return (
        f"[specdec] {stats['generated_tokens']} tokens in {stats['wall_s']:.2f} s = {stats['tokens_per_s']:.1f} tok/s | "
        f"{stats['tokens_per_target_call']:.2f} tokens/cloud call | acceptance {stats['acceptance_rate']:.2f} | "
        f"wire {out.remote['wire']} ({stats['bytes_up']} B up, {stats['bytes_down']} B down) | rtt {stats['rtt_ms']:.1f} ms"
        + (f" | {cached} prompt tokens cached on the server" if cached else "") + lossy
    )


def _chat(args: argparse.Namespace, prompt: str, sampling: "SamplingConfig", remote: Any, drafter: Any, draft: Any,
          options: dict[str, Any]) -> int:
    """``generate --remote URL --interactive``: a chat drafted here and verified on the server, one
    edge session per turn.  The server keeps each ended session in its prefix cache, so a turn's
    session copies the conversation so far instead of prefilling it; here the draft model (where it
    is batch-invariant) gets a prefix cache of its own, as the local chat's draft does."""
    from specdec import defaults
    from specdec.cli import chat_loop
    from specdec.remote.edge import generate_remote
    from specdec.server.prefix_cache import PrefixCache, PrefixCached, supports_prefix_cache
    from specdec.text import encode_messages

    with_model = getattr(drafter, "with_model", None)
    if with_model is not None and draft is not None and supports_prefix_cache(draft.model):
        drafter = with_model(PrefixCached(draft.model, PrefixCache(defaults.EDGE_DRAFT_PREFIX_CACHE_BYTES)))

    def turn(messages: list[dict[str, str]], turn_sampling: "SamplingConfig") -> tuple[str, str]:
        out = generate_remote(encode_messages(options["tokenizer"], messages), turn_sampling, remote, drafter=drafter,
                              **options)
        note = _context_note(out, turn_sampling.max_new_tokens)
        return out.text, _summary_line(out) + ("" if note is None else "\n" + note)

    return chat_loop(turn, args.system, sampling, first=prompt.strip() or None)


__all__ = ["add_remote_args", "run_generate", "SpecdecError"]


def _is_fed(ref: str) -> bool:
    """A fed draft (``specdec train online --fed``): a folder whose config reads target features."""
    from specdec.drafters.fed import fed_config

    path = Path(ref).expanduser()
    return path.is_dir() and fed_config(path) is not None


def _is_head(ref: str) -> bool:
    """A draft head (EAGLE / Medusa / MTP): a registry name or a head folder."""
    from specdec.drafters.heads import HEADS, resolve_head

    if ref.strip().lower() in HEADS:
        return True
    try:
        return resolve_head(ref) is not None
    except ConfigError:
        return True
