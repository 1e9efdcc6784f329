"""``specdec train``: ``data`` (target-sampled sequences + features), ``eagle`` / ``medusa`` / ``mtp``
(draft heads), ``kangaroo`` (a Kangaroo adapter), ``skip`` (search a layer-skipping draft),
``distill`` / ``online`` (the small draft) and ``calibrate`` (a draft's temperature factor)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specdec import defaults
from specdec.errors import ConfigError
from specdec.models.registry import read_config


def add_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    p = sub.add_parser("train", help="train or search a drafter (data: the target's own replies; distill / online: "
                       "the small draft; eagle, medusa, mtp: heads on the target; skip: a layer-skipping "
                       "self-speculative draft; kangaroo: an early-exit adapter; calibrate: a draft's temperature factor)")
    tsub = p.add_subparsers(dest="train_command", metavar="METHOD", required=True)
    s = tsub.add_parser(
        "skip",
        help="search which attention / MLP sub-layers a self-speculative draft skips",
        description="Greedy search of a skip set on calibration prompts (not the benchmark's), maximising the expected "
        "speed-up from teacher-forced acceptance (T=0 and T=1) and measured per-sub-layer cost. Writes a JSON file "
        "for --draft self-skip:FILE; the search state is checkpointed next to it and resumed.",
    )
    s.add_argument("--target", default=defaults.DEFAULT_TARGET, help="the target model: registry name, folder or .gguf")
    s.add_argument("--out", required=True, help="output JSON file")
    s.add_argument("--prompts", type=int, default=4, help="calibration prompts to use (of the built-in 8, or of --prompt-file)")
    s.add_argument("--prompt-file", help="JSONL calibration prompts (fields: prompt, chat)")
    s.add_argument("--new-tokens", type=int, default=32, help="target continuation length per calibration prompt")
    s.add_argument("--max-steps", type=int, help="stop the inclusion phase after this many candidates (quick runs)")
    s.add_argument("--patience", type=int, default=8, help="stop adding after this many candidates in a row that do not pay")
    s.add_argument("--rank", choices=("alone", "influence"), default="alone",
                   help="order to try sub-layers in: by the acceptance each costs skipped alone (one evaluation "
                   "each), or by block influence 1 - cos(in, out) from one pass (much cheaper)")
    s.add_argument("--cost", choices=("measure", "params"), default="measure",
                   help="sub-layer costs: timed on this machine, or each part's share of the weights (timing-free, "
                   "for a busy machine)")
    s.add_argument("--polish", type=int, default=0, metavar="N",
                   help="then up to N passes of local search: toggle each sub-layer in turn, keep it where the expected "
                   "speed-up rises; stops after a pass that changes nothing (default 0: none; 3 with --from)")
    s.add_argument("--from", dest="start", metavar="FILE",
                   help="start the local search from this skip-set file instead of the greedy search (3 passes "
                   "unless --polish says otherwise)")
    s.add_argument("--draft-vocab", choices=("auto", "full"), default="auto",
                   help="the vocabulary the view drafts over, as `generate --draft-vocab` gives it: auto = the reduced "
                   "one shipped for the target or its default draft, where the target's head can be cut to it (a "
                   "4-bit or int8 head); full = all tokens. Acceptance and the draft's cost are scored with that head")
    k = tsub.add_parser(
        "kangaroo",
        help="train a Kangaroo adapter (the target's first K layers + one trained attention block + its LM head)",
        description="Self-distillation on built-in prompts (not the benchmark's) continued by the target: the adapter "
        "learns the target's next-token law from the residual stream after K layers. Writes a safetensors file for "
        "--draft kangaroo:FILE and a JSON report (held-out acceptance next to layerskip:K); data and training state "
        "are checkpointed next to it and resumed.",
    )
    k.add_argument("--target", default=defaults.DEFAULT_TARGET, help="the target model: registry name, folder or .gguf")
    k.add_argument("--out", required=True, help="output adapter file (.safetensors)")
    k.add_argument("--layers", type=int, help="shallow sub-network depth K (default: half the target's layers)")
    k.add_argument("--prompts", type=int, default=96, help="built-in training prompts to continue (at most 144)")
    k.add_argument("--new-tokens", type=int, default=96, help="target continuation length per prompt")
    k.add_argument("--steps", type=int, default=300, help="optimiser steps")
    k.add_argument("--batch", type=int, default=8, help="sequences per step")
    k.add_argument("--positions", type=int, default=256, help="positions per step the loss is computed on")
    k.add_argument("--lr", type=float, default=2e-3, help="learning rate (AdamW)")
    k.add_argument("--top-k", type=int, default=32, help="target probabilities kept per position (distillation target)")
    k.add_argument("--seed", type=int, default=0, help="seed of the data order and the initialisation")


    d = tsub.add_parser(
        "data",
        help="sample training sequences from the target, with its features (for EAGLE / Medusa / MTP / distillation)",
        description="Chat instructions (generated from templates, none of the benchmark's) and standard-library code "
        "headers, answered by the target at the given temperatures with batched generation; each sequence is then "
        "scored once more to store the target's features (the tapped residual streams and the final hidden state, "
        "float16). Written in shards; rerunning the same command resumes where it stopped. With --sampled-by draft "
        "the draft model answers instead (tokens only): on-policy data for `specdec train distill`.",
    )
    d.add_argument("--target", default=defaults.DEFAULT_TARGET, help="the target model: registry name, folder or .gguf")
    d.add_argument("--out", required=True, help="output folder (shards + config.json)")
    d.add_argument("--sequences", type=int, default=2000, help="sequences to generate")
    d.add_argument("--chat-share", type=float, default=0.7, help="share of chat prompts (the rest: code)")
    d.add_argument("--temperatures", default="0,1", help="comma list, cycled over the sequences")
    d.add_argument("--batch", type=int, default=32, help="sequences decoded together")
    d.add_argument("--max-new-chat", type=int, default=192, help="most tokens of a chat reply")
    d.add_argument("--max-new-code", type=int, default=128, help="most tokens of a code continuation")
    d.add_argument("--taps", default="2,15,27", help="residual-stream layers to store (layer counts)")
    d.add_argument("--no-features", action="store_true",
                   help="store tokens only (enough for `specdec train distill`; heads need the features)")
    d.add_argument("--prompt-file", help="JSONL prompts to answer instead of the built-in templates (fields: prompt, "
                   "chat, optional category); a head learns the prompts it is trained on, so use ones like those it "
                   "will serve (--chat-share is then ignored)")
    d.add_argument("--sampled-by", choices=("target", "draft"), default="target",
                   help="who answers the prompts: the target (default), or the draft model (--draft), whose own "
                   "samples `specdec train distill` then labels with the target's law: DistillSpec's on-policy "
                   "data (tokens only: needs --no-features)")
    d.add_argument("--draft", default=defaults.DEFAULT_DRAFT_MODEL,
                   help="with --sampled-by draft: the draft model that samples (a registry name or folder)")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts drawn and the sampling")


    t = tsub.add_parser(
        "distill",
        help="re-distil the small draft model towards the target's own law (DistillSpec) on `specdec train data` output",
        description="Labels every sequence written by `specdec train data` (tokens only is enough: --no-features) with "
        "the target's top-k next-token probabilities at its reply positions, then trains the draft (the shipped one by "
        "default) to match them: forward KL or total variation distance. Every 20th sequence is held out; the report and "
        "model card give held-out acceptance before and after. Writes a model folder (--out/draft) that --draft loads; "
        "labels and training state are checkpointed in --out and a rerun resumes.",
    )
    t.add_argument("--data", required=True, help="folder written by `specdec train data`")
    t.add_argument("--out", required=True, help="output folder: draft/ (the model), labels.pt, ckpt.pt, report.json")
    t.add_argument("--target", default=defaults.DEFAULT_TARGET, help="the target model: registry name, folder or .gguf")
    t.add_argument("--draft", default=defaults.DEFAULT_DRAFT_MODEL, help="the draft to start from (a registry name or folder)")
    t.add_argument("--steps", type=int, default=600, help="optimiser steps in all (across resumed runs)")
    t.add_argument("--batch", type=int, default=8, help="sequences per step")
    t.add_argument("--positions", type=int, default=512, help="reply positions per step the loss is computed on")
    t.add_argument("--lr", type=float, default=1e-4, help="learning rate (AdamW)")
    t.add_argument("--loss", choices=("kl", "tvd"), default="kl", help="forward KL or total variation (1 - acceptance)")
    t.add_argument("--top-k", type=int, default=32, help="target probabilities kept per position")
    t.add_argument("--max-minutes", type=float, help="stop this run after about this long (rerun to resume)")
    t.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the batch order")

    o = tsub.add_parser(
        "online",
        help="distil the small draft with the target running live beside it (generation + full-vocabulary KL; "
        "meant for a GPU, runs anywhere)",
        description="Has the target answer the built-in training prompts (chat instructions and code headers, none of "
        "the benchmark's) at several temperatures, many sequences at once, then trains the draft to match the target's "
        "whole next-token law (forward KL) at every reply position, the target scoring each batch as it goes. Budgets can "
        "be sequences and steps or seconds (a timed run records the counts it used, so they can be replayed). Every 20th "
        "sequence is held out: the report gives arg-max agreement and T=1 acceptance before and after. Writes --out/draft "
        "(a folder --draft loads) with a model card; data and training state are saved in --out and a rerun resumes. "
        "--heads eagle3 (or eagle1, medusa, mtp) also trains draft heads from scratch on the same target passes, reading "
        "the target's features; each is written to --out/<kind> (a folder --draft loads). "
        "--bundle writes the inputs for a machine that has torch alone (run there with `python -m specdec.train.online`).",
    )
    o.add_argument("--out", required=True, help="output folder: draft/ (the model), data.pt, ckpt.pt, report.json")
    o.add_argument("--target", default=defaults.DEFAULT_TARGET, help="a Llama GGUF target with 4-bit layers")
    o.add_argument("--draft", default=defaults.DEFAULT_DRAFT_MODEL, help="the draft to start from (a registry name or folder)")
    o.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to train: cpu, cuda or auto (cuda when present; default auto)")
    o.add_argument("--chat-prompts", type=int, default=23126, help="built-in chat instructions to answer (at most 23,126)")
    o.add_argument("--code-prompts", type=int, default=1022, help="built-in code headers to continue (at most 1,022)")
    o.add_argument("--temperatures", default="0,1,0.7", help="comma list: every prompt is answered once at each")
    o.add_argument("--code-repeats", type=int, default=4, help="samples of each code prompt at each temperature > 0")
    o.add_argument("--sequences", type=int, default=0, help="sequences to generate (0: as many as --gen-seconds allows)")
    o.add_argument("--gen-seconds", type=float, default=120.0, help="generation time budget when --sequences is 0")
    o.add_argument("--gen-batch", type=int, default=512, help="sequences decoded together")
    o.add_argument("--max-new-chat", type=int, default=192, help="most tokens of a chat reply")
    o.add_argument("--max-new-code", type=int, default=128, help="most tokens of a code continuation")
    o.add_argument("--steps", type=int, default=0, help="optimiser steps (0: as many as --train-seconds allows)")
    o.add_argument("--train-seconds", type=float, default=240.0, help="training time budget when --steps is 0")
    o.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per step")
    o.add_argument("--lr", type=float, default=2e-4, help="the draft's learning rate (AdamW)")
    o.add_argument("--add-layers", default="0", help="comma list, one draft trained per entry (side by side, on the "
                   "same batches): identity-initialised layers appended to the source draft first (0: as it is; "
                   "none: no draft, heads only)")
    o.add_argument("--heads", default="", help="comma list of draft heads trained from scratch beside the draft, on the "
                   "same target passes (eagle3, eagle1, medusa, mtp); each is written to --out/<kind>")
    o.add_argument("--head-vocab", type=int, default=8192, help="the heads' draft vocabulary: most frequent reply tokens")
    o.add_argument("--head-depth", type=int, default=3, help="EAGLE's training-time-test steps, Medusa's heads, MTP's modules")
    o.add_argument("--head-lr", type=float, default=5e-4, help="the heads' learning rate (AdamW)")
    o.add_argument("--init-heads", default="", help="an earlier run's --out: the heads continue from its <kind>/ folders "
                   "and keep their draft vocabulary (copy its data.pt into --out to train on the same sequences)")
    o.add_argument("--fed", type=int, default=0, help="also train a feature-fed draft over this many draft steps: the "
                   "draft with the target's features projected into its input, written to --out/fed (0: none)")
    o.add_argument("--fed-lr", default="0.001", help="comma list: the fed draft's learning rate for its projection, "
                   "one fed draft per value (--out/fed-<lr> when several)")
    o.add_argument("--max-minutes", type=float, help="pause training after about this long (rerun to resume)")
    o.add_argument("--bundle", help="write the inputs to this folder instead of training (for a torch-only machine)")
    o.add_argument("--seed", type=int, default=0, help="seed of the prompts' order, the sampling and the batches")

    for kind, what, depth in (("eagle", "EAGLE-1 or EAGLE-3 head (--variant)", "training-time-test steps (draft steps the head learns to chain)"),
                              ("medusa", "Medusa-1 heads", "heads (head k proposes the token k + 1 places ahead)"),
                              ("mtp", "MTP modules (DeepSeek-V3 style)", "modules (module k proposes the token k + 1 places ahead)")):
        h = tsub.add_parser(
            kind,
            help=f"train {what} on `specdec train data` output",
            description=f"Train {what} for the target on the sequences and features written by `specdec train data`: "
            "labels are the target's own next-token law (self-distillation) over a draft vocabulary of the most frequent "
            "reply tokens; every 20th sequence is held out for the report (teacher-forced acceptance per draft step). "
            "Checkpoints in --out; rerunning the same command resumes.",
        )
        h.add_argument("--data", required=True, help="folder written by `specdec train data`")
        h.add_argument("--out", required=True, help="output folder: head (config.json + model.safetensors), ckpt.pt, report")
        h.add_argument("--target", default=defaults.DEFAULT_TARGET, help="the target model: registry name, folder or .gguf")
        if kind == "eagle":
            h.add_argument("--variant", choices=("eagle3", "eagle1"), default="eagle3", help="EAGLE-3 (fused low/mid/high-layer features) or EAGLE-1 (the last hidden state)")
        h.add_argument("--steps", type=int, default=2000, help="optimiser steps in all (across resumed runs)")
        h.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per batch")
        h.add_argument("--lr", type=float, default=5e-4, help="learning rate (AdamW)")
        h.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (most frequent reply tokens)")
        h.add_argument("--depth", type=int, default=3, help=depth)
        h.add_argument("--max-minutes", type=float, help="stop this run after about this long (resume later)")
        h.add_argument("--eval-every", type=int, default=500, help="optimiser steps between held-out evaluations")


    c = tsub.add_parser(
        "calibrate",
        help="measure the draft temperature factor at which a draft model agrees with the target most (no training)",
        description="The target continues built-in training prompts (none of the benchmark's) at each temperature; both "
        "models then score the continuations teacher-forced, and for each factor f the mean acceptance of a draft token "
        "sampled at f x the temperature (sum of min(p, q)) is computed. The factor with the best mean over the "
        "temperatures is written to FOLDER/draft_calibration.json with the whole table (with --coupled, beside the chance "
        "that a draft token is accepted by coupled verification, the default with a seed); a draft folder holding that "
        "file samples at its factor under --draft-temperature-factor auto (the default). Lossless for any factor.",
    )
    c.add_argument("--out", required=True, metavar="FOLDER",
                   help="where draft_calibration.json goes: the draft model's own folder, for --draft-temperature-factor auto to find it")
    c.add_argument("--draft", default=defaults.DEFAULT_DRAFT_MODEL, help="the draft model (a registry name or folder)")
    c.add_argument("--target", default=defaults.DEFAULT_TARGET, help="the target model: registry name, folder or .gguf")
    c.add_argument("--prompts", type=int, default=64, help="built-in training prompts (chat and code alternating, at most 144)")
    c.add_argument("--new-tokens", type=int, default=96, help="target continuation length per prompt")
    c.add_argument("--temperatures", default="1,0.7", help="comma list: every prompt is continued and scored at each")
    c.add_argument("--factors", help="comma list of factors to try (default: 0.5 to 1.2 in steps of 0.05)")
    c.add_argument("--seed", type=int, default=0, help="seed of the prompts' order and the sampling")
    c.add_argument("--coupled", action="store_true",
                   help="also measure, for every factor, how often coupled verification (the default with a seed) would accept "
                   "a draft token: exactly, from both rows (about 2.4x the time: 355 against 148 s for the defaults on a 2-core AVX2 CPU)")

    for parser in tsub.choices.values():  # every option's help ends with its default
        parser.formatter_class = _WithDefaults


class _WithDefaults(argparse.HelpFormatter):
    """Help that names each option's default unless its text already does."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text and action.option_strings and action.default not in (None, False, argparse.SUPPRESS) \
                and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text


def run(args: argparse.Namespace) -> int:
    from specdec.outputs import check_file, check_folder

    # where the results go is checked before anything loads or trains (it used to fail at the end)
    if getattr(args, "out", None):
        if args.train_command in ("skip", "kangaroo"):
            check_file(Path(args.out))
            # their resumable state (.state.json, .data.pt, .ckpt.pt) is written beside --out from the
            # first minutes on: the folder must be there then, not only when the result is written
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        else:
            check_folder(Path(args.out))
    if getattr(args, "bundle", None):
        check_folder(Path(args.bundle), "--bundle")
    if args.train_command in ("eagle", "medusa", "mtp"):
        return _head(args)
    if args.train_command == "data":
        return _data(args)
    if args.train_command == "skip":
        return _skip(args)
    if args.train_command == "kangaroo":
        return _kangaroo(args)
    if args.train_command == "distill":
        return _distill(args)
    if args.train_command == "online":
        return _online(args)
    if args.train_command == "calibrate":
        return _calibrate(args)
    raise ConfigError(f"unknown train method {args.train_command!r}")


def _calibrate(args: argparse.Namespace) -> int:
    import time

    import torch
    from tqdm.auto import tqdm

    from specdec.drafters import self_spec
    from specdec.drafters.base import check_temperature_factor
    from specdec.engine import CALIBRATION_FILE, NON_MODEL_DRAFTS, EngineConfig, check_draft_name, load_draft, target_dtype
    from specdec.models.registry import check_compatible, load
    from specdec.text import encode_prompt
    from specdec.train import calibrate as cal
    from specdec.train.kangaroo import continue_batched, training_prompts

    temps = _floats(args.temperatures, "--temperatures", positive=True)
    factors = [check_temperature_factor(f) for f in _floats(args.factors, "--factors", positive=True)] if args.factors \
        else list(defaults.CALIBRATION_FACTORS)
    if not 1 <= args.prompts <= 144 or args.new_tokens < 1:
        raise ConfigError("--prompts must be 1-144 and --new-tokens >= 1")
    out = Path(args.out)  # checked before anything loads (see run)
    base, lookup, head = check_draft_name(args.draft)
    if lookup or head is not None or base.strip().lower() in NON_MODEL_DRAFTS or self_spec.parse_name(base) is not None:
        raise ConfigError(f"calibrate measures a draft model (a registry name or folder), not --draft {args.draft}")
    t0 = time.perf_counter()
    dtype, quant = target_dtype(EngineConfig(target=args.target))
    target = load(args.target, dtype=dtype, quant=quant, batch_invariant=False)  # scored, never compared bitwise
    draft = load_draft(EngineConfig(target=args.target, draft=base))  # as it drafts: its dtype and vocabulary
    check_compatible(target, draft)
    prompts = training_prompts(args.prompts, seed=args.seed)
    enc = [encode_prompt(target.tokenizer, text, chat=chat) for text, chat in prompts]
    bar = tqdm(total=len(enc) * len(temps), desc="target continuations", unit="seq")
    seqs = []
    for ti, t in enumerate(temps):
        cont = continue_batched(target.model, enc, new_tokens=args.new_tokens, temperatures=(t,), eos_ids=target.eos_ids,
                                seed=args.seed + ti, progress=bar.update)
        seqs += [(s, len(p), ti) for s, p in zip(cont, enc)]
    bar.close()
    bar = tqdm(total=len(seqs), desc="teacher-forced overlap", unit="seq")
    result = cal.calibrate(target.model, draft.model, seqs, temps, factors, progress=bar.update, coupled=args.coupled)
    bar.close()
    payload = {**result.to_json(), "target": target.name, "draft": draft.name, "prompts": args.prompts,
               "new_tokens": args.new_tokens, "seed": args.seed, "seconds": round(time.perf_counter() - t0, 1),
               "torch": torch.__version__}
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / CALIBRATION_FILE).write_text(json.dumps(payload, indent=1) + "\n")
    except OSError as exc:
        raise ConfigError(f"cannot write {out / CALIBRATION_FILE}: {exc.strerror or exc}") from None
    one = factors.index(1.0) if 1.0 in factors else None
    best = factors.index(result.factor)
    print("| T | agreement | " + " | ".join(f"{f:g}" for f in factors) + " |")
    print("|---|---|" + "---|" * len(factors))
    for t in temps:
        for what, table in (("sum min(p, q)", result.mean_overlap), ("coupled", result.mean_coupled_agreement)):
            if table is None:
                continue
            print(f"| {t:g} | {what} | " + " | ".join(f"{x:.4f}" for x in table[f"{t:g}"]) + " |")
    gain = "" if one is None else " (" + ", ".join(
        f"T = {t:g}: {result.mean_overlap[f'{t:g}'][one]:.4f} -> {result.mean_overlap[f'{t:g}'][best]:.4f}" for t in temps) + ")"
    print(f"[specdec] draft temperature factor {result.factor:g}{gain}; wrote {out / CALIBRATION_FILE}", file=sys.stderr)
    return 0


def _load_prompts(args: argparse.Namespace) -> list[tuple[str, bool]]:
    from specdec.train.skip import CALIBRATION

    if not args.prompt_file:
        return list(CALIBRATION[: args.prompts])
    rows = []
    try:
        for line in Path(args.prompt_file).read_text().splitlines():
            if line.strip():
                obj = json.loads(line)
                rows.append((str(obj["prompt"]), bool(obj.get("chat", False))))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read calibration prompts from {args.prompt_file!r}: {exc}") from None
    if not rows:
        raise ConfigError(f"{args.prompt_file!r} has no prompts")
    return rows[: args.prompts]


def _skip(args: argparse.Namespace) -> int:
    import dataclasses
    import hashlib

    from tqdm.auto import tqdm

    from specdec.drafters.self_spec import load_plan
    from specdec.engine import EngineConfig, target_dtype, view_vocabulary
    from specdec.models.registry import load
    from specdec.text import encode_prompt
    from specdec.train import skip

    if args.prompts < 1 or args.new_tokens < 1:
        raise ConfigError("--prompts and --new-tokens must be >= 1")
    if args.polish < 0:
        raise ConfigError(f"--polish must be >= 0, got {args.polish}")
    start = load_plan(args.start) if args.start else None  # a bad file is a one-line error before the target loads
    out = Path(args.out)
    state_path = out.with_name(out.name + ".state.json")
    prompts = _load_prompts(args)
    # scored as it decodes (its default dtype: the registry's models as q4, whose head a reduced
    # vocabulary cuts); scored, not bitwise-compared: the faster (not batch-invariant) attention path
    dtype, quant = target_dtype(EngineConfig(target=args.target))
    target = load(args.target, dtype=dtype, quant=quant, batch_invariant=False)
    if not hasattr(target.model, "run_layers"):
        raise ConfigError("the skip search needs the native backend (a Llama, Qwen2, Qwen3, Mistral or Gemma 3 target)")
    from specdec.train import state as saved_state

    state: dict = saved_state.load_json(state_path) or {}
    # the scores it holds are of these prompts, this many tokens, this target: anything else starts over
    calibration = hashlib.sha256(json.dumps([prompts, args.new_tokens]).encode()).hexdigest()[:16]
    if state and (state.get("target") != target.name or state.get("calibration", calibration) != calibration):
        print(f"[specdec] {state_path} holds a search on another target or other calibration prompts: starting over",
              file=sys.stderr)
        state = {}
    state["target"], state["calibration"] = target.name, calibration
    ids = [encode_prompt(target.tokenizer, text, chat=chat) for text, chat in prompts]
    print(f"[specdec] calibration: {len(ids)} prompts x {args.new_tokens} target tokens", file=sys.stderr)
    data = skip.build_calibration(target.model, ids, new_tokens=args.new_tokens)
    vocab = view_vocabulary(EngineConfig(target=args.target, draft_vocab=args.draft_vocab), args.target)
    reduced = target.model.reduced_head(vocab) if vocab is not None else None
    head = "full" if reduced is None else int(reduced.ids.numel())
    if state.get("draft_vocab", "full") != head:  # scores and costs of another head
        state = {"target": target.name, "calibration": calibration}
    state["draft_vocab"] = head
    if reduced is not None:
        print(f"[specdec] the view drafts over a reduced vocabulary of {head:,} tokens", file=sys.stderr)
    if "cost" in state and state.get("cost_source", "measure") == args.cost:
        cost = skip.CostModel(**state["cost"])
    elif args.cost == "params":
        cost = skip.CostModel.from_params(target.model.cfg, head_share=1.0 if reduced is None else reduced.share)
        state["cost"], state["cost_source"] = cost.to_json(), "params"
    else:
        cost = skip.measure_costs(target.model, reduced=reduced)
        state["cost"], state["cost_source"] = cost.to_json(), "measure"
    print(f"[specdec] cost per target step: attention {cost.attn:.4f}, MLP {cost.mlp:.4f}, fixed {cost.fixed:.3f}; "
          f"verify(γ) = 1 + {cost.verify_slope:.3f} γ", file=sys.stderr)
    n = target.model.cfg.n_layers
    if start is not None and start.n_layers != n:
        raise ConfigError(f"--from {args.start}: a skip set for {start.n_layers} layers, the target has {n}")
    bar = tqdm(total=0 if start else (2 * n if args.rank == "alone" else 0) + 2 * n, desc="skip search", unit="eval",
               leave=False, disable=start is not None)

    def progress(what: str, best: skip.SearchResult) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{what}: best ×{best.objective:.3f} (α0 {best.alpha0:.2f}, c {best.draft_cost:.2f})")
        saved_state.write_text(state_path, json.dumps(state))

    if start is not None:
        result = skip.score(target.model, start, data, cost, 0, reduced)
    else:
        result = skip.greedy_search(target.model, data, cost, max_steps=args.max_steps, patience=args.patience,
                                    progress=progress, state=state, rank=args.rank, reduced=reduced)
    bar.close()
    passes = args.polish or (3 if start is not None else 0)
    if passes:
        order = skip.singles_order(state, n)  # the most harmless sub-layers first, where the search scored them
        bar = tqdm(total=passes * 2 * n, desc="local search", unit="eval", leave=False)
        polished = skip.local_search(target.model, data, cost, result.plan, passes=passes, order=order, progress=progress,
                                     reduced=reduced)
        bar.close()
        result = dataclasses.replace(polished, evaluations=result.evaluations + polished.evaluations)
    skip.write_result(result, out, target=target.name, prompts=len(ids), new_tokens=args.new_tokens, rank=args.rank,
                      cost_source=args.cost, command="specdec " + shlex.join(getattr(args, "argv", sys.argv[1:])), draft_vocab=head)
    plan = result.plan
    print(f"[specdec] {out}: skip {len(plan.skip_attn)} attention + {len(plan.skip_mlp)} MLP sub-layers of {n} layers; "
          f"α0 {result.alpha0:.3f}, α1 {result.alpha1:.3f}, draft cost {result.draft_cost:.2f} step, expected "
          f"×{result.speedup0:.2f} (T=0, γ {result.gamma0}), ×{result.speedup1:.2f} (T=1, γ {result.gamma1}); "
          f"{result.evaluations} evaluations", file=sys.stderr)
    return 0


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ConfigError(f"{what} must be a non-empty comma list of non-negative integers, got {text!r}")
    return values


def _floats(text: str, what: str, *, positive: bool = False) -> tuple[float, ...]:
    """A comma list of finite numbers, each >= 0 (``positive``: > 0)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} must be a comma list of numbers, got {text!r}") from None
    if positive and (not values or any(not 0 < v < float("inf") for v in values)):
        raise ConfigError(f"{what} must be positive numbers, got {text!r}")
    if not values or any(not 0 <= v < float("inf") for v in values):
        raise ConfigError(f"{what} needs at least one value >= 0")
    return values


def _data(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    import torch

    from specdec.models.registry import check_compatible, load, resolve
    from specdec.train.data import DataConfig, generate

    temps = _floats(args.temperatures, "--temperatures")
    if args.sequences < 1 or args.batch < 1 or not 0.0 <= args.chat_share <= 1.0:
        raise ConfigError("--sequences and --batch must be >= 1 and --chat-share in [0, 1]")
    if min(args.max_new_chat, args.max_new_code) < 1:
        raise ConfigError("--max-new-chat and --max-new-code must be >= 1")
    cfg = DataConfig(target=args.target, sequences=args.sequences, chat_share=args.chat_share, temperatures=temps,
                     max_new_chat=args.max_new_chat, max_new_code=args.max_new_code, batch=args.batch,
                     taps=_int_list(args.taps, "--taps"), seed=args.seed, features=not args.no_features,
                     prompt_file=args.prompt_file, sampler="target" if args.sampled_by == "target" else args.draft)
    if cfg.sampler != "target" and cfg.features:
        raise ConfigError("--sampled-by draft writes tokens only (features are the target's hidden states on its own "
                          "sequences): add --no-features")
    if cfg.prompt_file is not None:
        from specdec.bench.workloads import load_jsonl

        load_jsonl(cfg.prompt_file)  # a bad file is a one-line error before the model loads
    from specdec.engine import EngineConfig, target_dtype

    if cfg.sampler != "target":
        resolve(cfg.sampler)  # an unknown draft is a one-line error before the target loads
    dtype, quant = target_dtype(EngineConfig(target=args.target))
    target = load(args.target, dtype=dtype, quant=quant, batch_invariant=False)
    sampler, precision = target, quant or dtype
    if cfg.sampler != "target":  # the draft answers; prompts, chat template and stop tokens stay the target's
        sampler, precision = load(cfg.sampler, dtype=torch.float32, batch_invariant=False), "float32"
        check_compatible(target, sampler)
    if not hasattr(sampler.model, "forward_batch"):
        raise ConfigError("training data needs the native backend (a Llama, Qwen2, Qwen3, Mistral or Gemma 3 model)")
    if cfg.features and max(cfg.taps) > target.model.cfg.n_layers:
        raise ConfigError(f"--taps must be <= the target's {target.model.cfg.n_layers} layers")
    bar = tqdm(total=cfg.sequences, desc="sequences", unit="seq")
    n = generate(cfg, sampler.model, target.tokenizer, target.eos_ids, Path(args.out), progress=bar.update)
    bar.close()
    who = f"target {target.name}" if sampler is target else f"draft {sampler.name} for target {target.name}"
    print(f"[specdec] {args.out}: {n} sequences ({who}, {precision})", file=sys.stderr)
    return 0


def _head(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from specdec.models.registry import eos_ids, load_tokenizer, resolve
    from specdec.train.heads import TargetHead, TrainConfig, train

    kind = args.variant if args.train_command == "eagle" else args.train_command
    if (args.steps < 1 or args.batch_tokens < 16 or args.depth < 1 or args.draft_vocab < 2 or not 0 < args.lr < float("inf")
            or args.eval_every < 1):
        raise ConfigError("--steps, --depth, --eval-every >= 1, --batch-tokens >= 16, --draft-vocab >= 2 and --lr > 0 are required")
    data = Path(args.data)
    if not (data / "config.json").is_file() or not any(data.glob("shard-*.pt")):
        raise ConfigError(f"{args.data!r} holds no training data; run `specdec train data --out {args.data}` first")
    if not read_config(data).get("features", True):
        raise ConfigError(f"{args.data!r} holds tokens only (--no-features); heads need `specdec train data` with features")
    resolved = resolve(args.target)
    if resolved.folder is None:
        raise ConfigError("training a head needs a local target (a registry name or a folder)")
    cfg_json = read_config(resolved.folder)
    eos = eos_ids(resolved.folder, load_tokenizer(resolved.folder), cfg_json)
    target = TargetHead.from_folder(resolved.folder, resolved.name, eos)
    cfg = TrainConfig(kind=kind, steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, draft_vocab=args.draft_vocab,
                      depth=args.depth, eval_every=args.eval_every)
    bar = tqdm(total=cfg.steps, desc=f"train {kind}", unit="step")

    def progress(step: int, loss: float, parts: list[float]) -> None:
        bar.n = step
        bar.set_postfix_str(f"loss {loss:.3f} ce " + "/".join(f"{p:.2f}" for p in parts))
        bar.refresh()

    report = train(cfg, data, Path(args.out), target, max_minutes=args.max_minutes, progress=progress)
    bar.close()
    steps = report["held_out"]["steps"]
    summary = ", ".join(f"step {s['step']}: accept {s['accept_t1']:.3f} top-1 {s['top1']:.3f}" for s in steps)
    state = "done" if report["finished"] else "paused (rerun to resume)"
    print(f"[specdec] {args.out}: {kind} {state} at step {report['steps']}, {report['train_seconds']:.0f} s; held-out {summary}",
          file=sys.stderr)
    return 0


def _without_steps(cfg: object) -> dict:
    """A training config's fields but the step count (a larger --steps continues a run)."""
    import dataclasses

    fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg or {})  # type: ignore[arg-type]
    return {k: v for k, v in fields.items() if k != "steps"}


def _kangaroo(args: argparse.Namespace) -> int:
    import time

    import torch
    from tqdm.auto import tqdm

    from specdec.drafters.kangaroo import save_adapter
    from specdec.models.registry import load
    from specdec.text import encode_prompt
    from specdec.train import kangaroo as kt
    from specdec.train import state

    if min(args.prompts, args.new_tokens, args.steps, args.batch, args.positions, args.top_k) < 1 or not 0 < args.lr < float("inf"):
        raise ConfigError("--prompts, --new-tokens, --steps, --batch, --positions, --top-k and --lr must be positive")
    t0 = time.perf_counter()
    out = Path(args.out)
    data_path, ckpt_path = out.with_name(out.name + ".data.pt"), out.with_name(out.name + ".ckpt.pt")
    # features are learned from, not compared bitwise: the faster (not batch-invariant) attention path
    target = load(args.target, batch_invariant=False)
    model = target.model
    if not hasattr(model, "run_layers"):
        raise ConfigError("kangaroo needs the native backend (a Llama, Qwen2, Qwen3, Mistral or Gemma 3 target)")
    k = args.layers if args.layers is not None else model.cfg.n_layers // 2
    adapter = kt.new_adapter(model, k, seed=args.seed)  # checks K
    key = {"target": target.name, "layers": k, "prompts": args.prompts, "new_tokens": args.new_tokens,
           "top_k": args.top_k, "seed": args.seed}
    cfg = kt.TrainConfig(steps=args.steps, batch=args.batch, positions=args.positions, lr=args.lr, seed=args.seed)
    # a checkpoint of other settings is refused before the data is made (it was restarted in silence
    # and its adapter overwritten); a larger --steps continues it
    ck = state.load(ckpt_path)
    if ck is not None:
        state.check_resume(ckpt_path, {"key": ck.get("key"), **_without_steps(ck.get("train"))},
                           {"key": key, **_without_steps(cfg)})
    saved = state.load(data_path)
    if saved is not None and saved.get("key") == key:
        train_data, held_data = saved["train"], saved["held_out"]
        print(f"[specdec] data: {len(train_data)} sequences from {data_path}", file=sys.stderr)
    else:
        prompts = kt.training_prompts(args.prompts, seed=args.seed)
        enc = [encode_prompt(target.tokenizer, text, chat=chat) for text, chat in prompts]
        held = [encode_prompt(target.tokenizer, text, chat=chat) for text, chat in kt.HELD_OUT]
        bar = tqdm(total=len(enc) + len(held), desc="target continuations", unit="seq", leave=False)
        seqs = kt.continue_batched(model, enc, new_tokens=args.new_tokens, temperatures=(0.0, 1.0),
                                   eos_ids=target.eos_ids, seed=args.seed, progress=bar.update)
        held_seqs = kt.continue_batched(model, held, new_tokens=args.new_tokens, temperatures=(0.0,),
                                        eos_ids=target.eos_ids, seed=args.seed, progress=bar.update)
        bar.close()
        feats = tqdm(total=len(seqs) + len(held_seqs), desc="teacher-forced features", unit="seq", leave=False)
        train_data, held_data = [], []
        for ids, seq in zip(enc, seqs):
            train_data.append(kt.features(model, seq, len(ids) - 1, k, top_k=args.top_k))
            feats.update(1)
        for ids, seq in zip(held, held_seqs):
            held_data.append(kt.features(model, seq, len(ids) - 1, k, top_k=args.top_k))
            feats.update(1)
        feats.close()
        state.save({"key": key, "train": train_data, "held_out": held_data}, data_path)
    tokens = sum(f.tokens.numel() for f in train_data)
    print(f"[specdec] {len(train_data)} training sequences ({tokens} tokens), {len(held_data)} held out; "
          f"adapter after {k} of {model.cfg.n_layers} layers, {sum(p.numel() for p in adapter.parameters())} parameters",
          file=sys.stderr)
    resumed = None
    if ck is not None:
        resumed = ck["state"]
        print(f"[specdec] resuming from step {resumed['step']} ({ckpt_path})", file=sys.stderr)
    w_head = kt.head_weight(model)
    bar = tqdm(total=cfg.steps, initial=resumed["step"] if resumed else 0, desc="kangaroo", unit="step", leave=False)

    signals = state.BetweenSteps()  # Ctrl-C / SIGTERM: the step in progress ends, then its state is saved

    def on_step(step: int, loss: float, st: dict) -> None:
        bar.update(1)
        bar.set_postfix_str(f"loss {loss:.3f}")
        if step % 25 == 0 or step == cfg.steps or signals.pending is not None:
            state.save({"key": key, "train": cfg, "state": st}, ckpt_path)
        signals.stop_if_pending(step, ckpt_path)

    with signals:
        losses = kt.train(adapter, train_data, w_head, cfg, state=resumed, on_step=on_step)
    bar.close()
    rep = kt.report(model, adapter, held_data)
    tail = losses[-20:]
    card = {"target": target.name, "layers": k, "method": "Kangaroo adapter, self-distilled on the target's own "
            "continuations of built-in prompts", "train_sequences": len(train_data), "train_tokens": tokens,
            "steps": cfg.steps, "batch": cfg.batch, "positions": cfg.positions, "lr": cfg.lr, "top_k": args.top_k,
            "seed": args.seed, "final_loss": round(sum(tail) / max(len(tail), 1), 4),
            "wall_s_this_run": round(time.perf_counter() - t0, 1), "held_out": rep}
    save_adapter(adapter, out, card=card)
    state.write_text(out.with_name(out.stem + ".json"), json.dumps(card, indent=1) + "\n")
    ls = rep[f"layerskip:{k}"]
    print(f"[specdec] {out}: loss {card['final_loss']:.3f}; held-out acceptance kangaroo α0 {rep['kangaroo']['alpha_t0']:.3f} "
          f"α1 {rep['kangaroo']['alpha_t1']:.3f} vs layerskip:{k} α0 {ls['alpha_t0']:.3f} α1 {ls['alpha_t1']:.3f} "
          f"({rep['held_out_positions']} positions)", file=sys.stderr)
    return 0


def _distill_command(args: argparse.Namespace) -> str:
    """The command that reproduces this run (every option spelled out, whoever called it)."""
    import shlex

    opts = ("data", "out", "target", "draft", "steps", "batch", "positions", "lr", "loss", "top_k", "seed")
    return "specdec train distill " + " ".join(f"--{o.replace('_', '-')} {shlex.quote(str(getattr(args, o)))}" for o in opts)


def _distill(args: argparse.Namespace) -> int:
    import platform
    import time

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from specdec.engine import EngineConfig, target_dtype
    from specdec.models.registry import check_compatible, load, resolve
    from specdec.train import distill as ds
    from specdec.train import state
    from specdec.train.data import load_shards

    if min(args.steps, args.batch, args.positions, args.top_k) < 1 or not 0 < args.lr < float("inf"):
        raise ConfigError("--steps, --batch, --positions, --top-k and --lr must be positive")
    data_dir, out = Path(args.data), Path(args.out)
    if not (data_dir / "config.json").is_file() or not any(data_dir.glob("shard-*.pt")):
        raise ConfigError(f"{args.data!r} holds no training data; run `specdec train data --no-features --out {args.data}` first")
    data_cfg = read_config(data_dir)
    source = resolve(args.draft).folder
    if source is None:
        raise ConfigError("distillation needs a local draft (a registry name or a folder)")
    out.mkdir(parents=True, exist_ok=True)
    cfg = ds.DistillConfig(steps=args.steps, batch=args.batch, positions=args.positions, lr=args.lr, top_k=args.top_k,
                           loss=args.loss, seed=args.seed)
    shards = load_shards(data_dir)
    key = {"data": data_cfg, "sequences": len(shards.tokens), "target": args.target, "top_k": cfg.top_k}
    labels_path, ckpt_path = out / "labels.pt", out / "ckpt.pt"
    # a checkpoint of other settings is refused before anything is computed (it was restarted in
    # silence and its finished draft overwritten); a larger --steps continues it
    run_key = {**_without_steps(cfg), "key": key, "source": str(source)}
    ck = state.load(ckpt_path)
    if ck is not None:
        state.check_resume(ckpt_path, {**_without_steps(ck.get("cfg")), "key": ck.get("key"), "source": ck.get("source")},
                           run_key)
    saved = state.load(labels_path)
    if saved is not None and saved.get("key") == key:
        labels = saved["labels"]
    else:
        dtype, quant = target_dtype(EngineConfig(target=args.target))
        target = load(args.target, dtype=dtype, quant=quant, batch_invariant=False)
        check_compatible(target, load(str(source), batch_invariant=False))
        bar = tqdm(total=len(shards.tokens), desc="target labels", unit="seq")
        labels = []
        for toks, plen, kind in zip(shards.tokens, shards.prompt_len, shards.kind):
            labels.append(ds.label(target.model, toks, plen, kind, top_k=cfg.top_k))
            bar.update(1)
        bar.close()
        del target
        state.save({"key": key, "labels": labels}, labels_path)
    train_ix, held_ix = ds.split(len(labels), cfg.held_out_every)
    train_data, held = [labels[i] for i in train_ix], [labels[i] for i in held_ix]
    if not train_data or not held:
        raise ConfigError(f"{args.data!r} has {len(labels)} sequences; distillation needs at least {cfg.held_out_every}")
    positions = sum(x.top_p.shape[0] for x in train_data)
    print(f"[specdec] {len(train_data)} training sequences ({positions} reply positions), {len(held)} held out",
          file=sys.stderr)
    student = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    st_now, before, train_s = None, None, 0.0
    if ck is not None:
        student.load_state_dict(ck["student"])
        st_now, before, train_s = ck["state"], ck["before"], ck.get("train_seconds", 0.0)
        print(f"[specdec] resuming from step {st_now['step']} ({ckpt_path})", file=sys.stderr)
    if before is None:
        before = ds.held_out_acceptance(student, held)
    bar = tqdm(total=cfg.steps, initial=st_now["step"] if st_now else 0, desc=f"distill ({cfg.loss})", unit="step")
    run_started = time.perf_counter()

    def save(st: dict) -> None:
        spent = train_s + time.perf_counter() - run_started  # training time across resumed runs
        state.save({"key": key, "cfg": ds.config_dict(cfg), "source": str(source), "student": student.state_dict(),
                    "state": st, "before": before, "train_seconds": spent}, ckpt_path)

    last: list[dict] = []

    signals = state.BetweenSteps()  # Ctrl-C / SIGTERM: the step in progress ends, then its state is saved

    def on_step(step: int, loss: float, st: dict) -> None:
        bar.update(1)
        bar.set_postfix_str(f"loss {loss:.4f}")
        last[:] = [st]
        if step % 25 == 0 or step == cfg.steps or signals.pending is not None:
            save(st)
        signals.stop_if_pending(step, ckpt_path)

    max_s = args.max_minutes * 60 if args.max_minutes else None
    with signals:
        losses = ds.train(student, train_data, cfg, state=st_now, on_step=on_step, max_seconds=max_s)
    bar.close()
    if last and last[0]["step"] < cfg.steps:  # paused by --max-minutes between two checkpoints: keep the steps
        save(last[0])
    ck = state.load(ckpt_path)
    done = ck is not None and ck["state"]["step"] >= cfg.steps
    step = ck["state"]["step"] if ck is not None else 0
    train_s = ck.get("train_seconds", 0.0) if ck is not None else 0.0
    report_path = out / "report.json"
    report = {"finished": done, "steps": step, "train_seconds": round(train_s, 1), "held_out_before": before,
              "last_losses": [round(x, 4) for x in losses[-20:]]}
    if done:
        after = ds.held_out_acceptance(student, held)
        report["held_out_after"] = after
        card = {"target": args.target, "source": args.draft, "config": ds.config_dict(cfg), "data": data_cfg,
                "train_sequences": len(train_data), "train_positions": positions, "held_out_sequences": len(held),
                "steps": step, "train_seconds": round(train_s, 1), "machine": platform.processor() or platform.machine(),
                "command": _distill_command(args), "held_out_before": before, "held_out_after": after}
        ds.save_draft(student, Path(source), out / "draft", card)
    state.write_text(report_path, json.dumps(report, indent=1) + "\n")
    if done:
        b, a = before["all"], report["held_out_after"]["all"]
        print(f"[specdec] {out / 'draft'}: held-out greedy agreement {b['greedy']:.3f} -> {a['greedy']:.3f}, "
              f"T=1 acceptance (lower bound) {b['t1_lower']:.3f} -> {a['t1_lower']:.3f}", file=sys.stderr)
    else:
        print(f"[specdec] paused at step {step} of {cfg.steps} (rerun the same command to resume)", file=sys.stderr)
    return 0


def _online_command(args: argparse.Namespace) -> str:
    """The command that reproduces this run: every option spelled out, the counts a timed run
    reached are in its report (pass them as --sequences / --steps to replay it)."""
    import shlex

    opts = ("out", "target", "draft", "device", "chat_prompts", "code_prompts", "temperatures", "code_repeats",
            "sequences", "gen_seconds", "gen_batch", "max_new_chat", "max_new_code", "steps", "train_seconds",
            "batch_tokens", "lr", "add_layers", "heads", "head_vocab", "head_depth", "head_lr", "init_heads", "fed", "fed_lr",
            "seed")
    return "specdec train online " + " ".join(f"--{o.replace('_', '-')} {shlex.quote(str(getattr(args, o)))}" for o in opts)


def _online(args: argparse.Namespace) -> int:
    import torch

    from specdec.models.gguf_blocks import ships_q4
    from specdec.models.registry import check_compatible, gguf_file, load, resolve
    from specdec.train import online

    from specdec.heads.modules import KINDS

    temps = _floats(args.temperatures, "--temperatures")
    add = () if args.add_layers.strip() == "none" else _int_list(args.add_layers, "--add-layers")
    heads = tuple(x.strip() for x in args.heads.split(",") if x.strip())
    if any(k not in KINDS for k in heads) or len(set(heads)) != len(heads):
        raise ConfigError(f"--heads {args.heads!r}: distinct kinds among {', '.join(KINDS)}")
    if min(args.head_vocab, args.head_depth) < 1 or not 0 < args.head_lr < float("inf"):
        raise ConfigError("--head-vocab, --head-depth and --head-lr must be positive")
    fed_lr = _floats(args.fed_lr, "--fed-lr")
    if args.fed < 0 or any(x <= 0 for x in fed_lr) or len(set(fed_lr)) != len(fed_lr):
        raise ConfigError("--fed must be >= 0 and --fed-lr distinct positive values")
    if not add and not heads and not args.fed:
        raise ConfigError("--add-layers none trains no draft: give --heads or --fed")
    if args.init_heads and not all((Path(args.init_heads) / k / "model.safetensors").is_file() for k in heads):
        raise ConfigError(f"--init-heads {args.init_heads}: needs a <kind>/model.safetensors for each of --heads")
    if len(set(add)) != len(add):
        raise ConfigError("--add-layers needs distinct values (one draft is trained per value)")
    if min(args.chat_prompts, args.code_prompts, args.sequences, args.steps, args.code_repeats) < 0 \
            or min(args.gen_batch, args.batch_tokens) < 1 or not 0 < args.lr < float("inf"):
        raise ConfigError("counts must be >= 0, --gen-batch, --batch-tokens and --lr positive")
    if args.chat_prompts + args.code_prompts == 0:
        raise ConfigError("nothing to answer: --chat-prompts and --code-prompts are both 0")
    if min(args.max_new_chat, args.max_new_code) < 1:
        raise ConfigError("--max-new-chat and --max-new-code must be >= 1")
    from specdec.train.prompts import chat_prompts

    available = len(chat_prompts(args.chat_prompts))
    if available < args.chat_prompts:
        raise ConfigError(f"--chat-prompts {args.chat_prompts}: there are {available:,} built-in chat instructions")
    if args.sequences == 0 and args.gen_seconds <= 0 or args.steps == 0 and args.train_seconds <= 0:
        raise ConfigError("give --sequences or a positive --gen-seconds, and --steps or a positive --train-seconds")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this torch sees no GPU")
    if not ships_q4(args.target):
        raise ConfigError(f"{args.target!r}: online distillation reads a Llama GGUF target with 4-bit layers")
    source = resolve(args.draft).folder
    if source is None or not (source / "model.safetensors").is_file():
        raise ConfigError("online distillation needs a local draft folder (config.json + model.safetensors)")
    target = load(args.target, batch_invariant=False)
    check_compatible(target, load(str(source), batch_invariant=False))
    cfg_json = read_config(target.folder)
    if cfg_json.get("model_type") != "llama":
        raise ConfigError(f"{args.target!r} is a {cfg_json.get('model_type')} model; online distillation reads Llama targets")
    gguf = gguf_file(args.target)
    prompts = online.tokenised_prompts(target.tokenizer, args.chat_prompts, args.code_prompts, target.eos_ids, args.seed)
    if len(prompts["code"]) < args.code_prompts:
        raise ConfigError(f"--code-prompts {args.code_prompts}: this Python's standard library has {len(prompts['code']):,}"
                          " function headers to continue")
    prompts["target_name"] = args.target
    if args.bundle:
        online.write_bundle(Path(args.bundle), gguf=gguf, target_config=cfg_json, draft=source, prompts=prompts)
        print(f"[specdec] {args.bundle}: bundle written (the GGUF travels separately: {gguf.name})", file=sys.stderr)
        return 0
    prompts["target_sha256"] = online.sha256(gguf)
    cfg = online.OnlineConfig(
        sequences=args.sequences, gen_seconds=args.gen_seconds, gen_batch=args.gen_batch, temperatures=temps,
        max_new_chat=args.max_new_chat, max_new_code=args.max_new_code,
        code_repeats=args.code_repeats, steps=args.steps, train_seconds=args.train_seconds,
        batch_tokens=args.batch_tokens, lr=args.lr, add_layers=add, heads=heads, head_vocab=args.head_vocab,
        head_depth=args.head_depth, head_lr=args.head_lr, init_heads=args.init_heads, fed=args.fed, fed_lr=fed_lr,
        seed=args.seed)
    out = Path(args.out)

    def log(msg: str) -> None:
        print(f"[specdec] {msg}", file=sys.stderr, flush=True)

    command = _online_command(args)
    pause = None
    if args.max_minutes:
        import time

        deadline = time.monotonic() + 60 * args.max_minutes
        pause = lambda step: time.monotonic() > deadline  # noqa: E731
    try:
        report = online.run(gguf, cfg_json, source, prompts, cfg, out, torch.device(device), log, command=command,
                            pause=pause)
    except ValueError as e:  # too few sequences for a held-out set, an unreadable target file
        raise ConfigError(str(e)) from None
    if not report["finished"]:
        where = f"step {report['train']['steps']}" if "train" in report else f"{report['generated']} sequences generated"
        log(f"paused at {where} (rerun the same command to resume)")
        return 0
    b = report["held_out_before"]["all"]
    for name, st in report["students"].items():
        online.finish_folder(out / name, source, online.model_card(report, name, args.target, args.draft))
        a = st["held_out_after"]["all"]
        log(f"{out / name}: held-out greedy agreement {b['greedy']:.3f} -> {a['greedy']:.3f}, "
            f"T=1 acceptance {b['t1']:.3f} -> {a['t1']:.3f}")
    for name, h in report["heads"].items():
        (out / name / "README.md").write_text(online.head_card(report, name))
        log(f"{out / name}: held-out top-1 per draft step " + " / ".join(f"{x['top1']:.3f}" for x in h["held_out"]["steps"]))
    return 0
