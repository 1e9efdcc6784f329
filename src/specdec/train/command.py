"""``specdec train``: ``skip`` (search a layer-skipping draft for a target), ``kangaroo`` (train a Kangaroo adapter)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec import defaults
from specdec.errors import ConfigError


def add_parser(sub) -> None:  # noqa: ANN001 - argparse's subparsers action
    p = sub.add_parser("train", help="train or search a drafter (skip: a layer-skipping self-speculative draft; "
                       "kangaroo: an early-exit adapter)")
    tsub = p.add_subparsers(dest="train_command", metavar="METHOD", required=True)
    s = tsub.add_parser(
        "skip",
        help="search which attention / MLP sub-layers a self-speculative draft skips",
        description="Greedy search of a skip set on calibration prompts (not the benchmark's), maximising the expected "
        "speed-up from teacher-forced acceptance (T=0 and T=1) and measured per-sub-layer cost. Writes a JSON file "
        "for --draft self-skip:FILE; the search state is checkpointed next to it and resumed.",
    )
    s.add_argument("--target", default=defaults.DEFAULT_TARGET)
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
    k = tsub.add_parser(
        "kangaroo",
        help="train a Kangaroo adapter (the target's first K layers + one trained attention block + its LM head)",
        description="Self-distillation on built-in prompts (not the benchmark's) continued by the target: the adapter "
        "learns the target's next-token law from the residual stream after K layers. Writes a safetensors file for "
        "--draft kangaroo:FILE and a JSON report (held-out acceptance next to layerskip:K); data and training state "
        "are checkpointed next to it and resumed.",
    )
    k.add_argument("--target", default=defaults.DEFAULT_TARGET)
    k.add_argument("--out", required=True, help="output adapter file (.safetensors)")
    k.add_argument("--layers", type=int, help="shallow sub-network depth K (default: half the target's layers)")
    k.add_argument("--prompts", type=int, default=96, help="built-in training prompts to continue (at most 144)")
    k.add_argument("--new-tokens", type=int, default=96, help="target continuation length per prompt")
    k.add_argument("--steps", type=int, default=300, help="optimiser steps")
    k.add_argument("--batch", type=int, default=8, help="sequences per step")
    k.add_argument("--positions", type=int, default=256, help="positions per step the loss is computed on")
    k.add_argument("--lr", type=float, default=2e-3)
    k.add_argument("--top-k", type=int, default=32, help="target probabilities kept per position (distillation target)")
    k.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.train_command == "skip":
        return _skip(args)
    if args.train_command == "kangaroo":
        return _kangaroo(args)
    raise ConfigError(f"unknown train method {args.train_command!r}")


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
    from tqdm.auto import tqdm

    from specdec.models.registry import load
    from specdec.text import encode_prompt
    from specdec.train import skip

    if args.prompts < 1 or args.new_tokens < 1:
        raise ConfigError("--prompts and --new-tokens must be >= 1")
    out = Path(args.out)
    state_path = out.with_name(out.name + ".state.json")
    prompts = _load_prompts(args)
    # acceptance is scored, not bitwise-compared: the faster (not batch-invariant) attention path
    target = load(args.target, batch_invariant=False)
    if not hasattr(target.model, "run_layers"):
        raise ConfigError("the skip search needs the native backend (a Llama / Qwen2 target)")
    state: dict = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state and state.get("target") != target.name:
        state = {}
    state["target"] = target.name
    ids = [encode_prompt(target.tokenizer, text, chat=chat) for text, chat in prompts]
    print(f"[specdec] calibration: {len(ids)} prompts x {args.new_tokens} target tokens", file=sys.stderr)
    data = skip.build_calibration(target.model, ids, new_tokens=args.new_tokens)
    if "cost" in state and state.get("cost_source", "measure") == args.cost:
        cost = skip.CostModel(**state["cost"])
    elif args.cost == "params":
        cost = skip.CostModel.from_params(target.model.cfg)
        state["cost"], state["cost_source"] = cost.to_json(), "params"
    else:
        cost = skip.measure_costs(target.model)
        state["cost"], state["cost_source"] = cost.to_json(), "measure"
    print(f"[specdec] cost per target step: attention {cost.attn:.4f}, MLP {cost.mlp:.4f}, fixed {cost.fixed:.3f}; "
          f"verify(γ) = 1 + {cost.verify_slope:.3f} γ", file=sys.stderr)
    n = target.model.cfg.n_layers
    bar = tqdm(total=(2 * n if args.rank == "alone" else 0) + 2 * n, desc="skip search", unit="eval", leave=False)

    def progress(what: str, best: skip.SearchResult) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{what}: best ×{best.objective:.3f} (α0 {best.alpha0:.2f}, c {best.draft_cost:.2f})")
        state_path.write_text(json.dumps(state))

    result = skip.greedy_search(target.model, data, cost, max_steps=args.max_steps, patience=args.patience, progress=progress, state=state,
                                rank=args.rank)
    bar.close()
    skip.write_result(result, out, target=target.name, prompts=len(ids), new_tokens=args.new_tokens, rank=args.rank,
                      cost_source=args.cost, command="specdec " + " ".join(sys.argv[1:]))
    plan = result.plan
    print(f"[specdec] {out}: skip {len(plan.skip_attn)} attention + {len(plan.skip_mlp)} MLP sub-layers of {n} layers; "
          f"α0 {result.alpha0:.3f}, α1 {result.alpha1:.3f}, draft cost {result.draft_cost:.2f} step, expected "
          f"×{result.speedup0:.2f} (T=0, γ {result.gamma0}), ×{result.speedup1:.2f} (T=1, γ {result.gamma1}); "
          f"{result.evaluations} evaluations", file=sys.stderr)
    return 0


def _kangaroo(args: argparse.Namespace) -> int:
    import time

    import torch
    from tqdm.auto import tqdm

    from specdec.drafters.kangaroo import save_adapter
    from specdec.models.registry import load
    from specdec.text import encode_prompt
    from specdec.train import kangaroo as kt

    if min(args.prompts, args.new_tokens, args.steps, args.batch, args.positions, args.top_k) < 1 or args.lr <= 0:
        raise ConfigError("--prompts, --new-tokens, --steps, --batch, --positions, --top-k and --lr must be positive")
    t0 = time.perf_counter()
    out = Path(args.out)
    data_path, ckpt_path = out.with_name(out.name + ".data.pt"), out.with_name(out.name + ".ckpt.pt")
    # features are learned from, not compared bitwise: the faster (not batch-invariant) attention path
    target = load(args.target, batch_invariant=False)
    model = target.model
    if not hasattr(model, "run_layers"):
        raise ConfigError("kangaroo needs the native backend (a Llama / Qwen2 target)")
    k = args.layers if args.layers is not None else model.cfg.n_layers // 2
    adapter = kt.new_adapter(model, k, seed=args.seed)  # checks K
    key = {"target": target.name, "layers": k, "prompts": args.prompts, "new_tokens": args.new_tokens,
           "top_k": args.top_k, "seed": args.seed}
    saved = torch.load(data_path, weights_only=False) if data_path.is_file() else None
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
        torch.save({"key": key, "train": train_data, "held_out": held_data}, data_path)
    tokens = sum(f.tokens.numel() for f in train_data)
    print(f"[specdec] {len(train_data)} training sequences ({tokens} tokens), {len(held_data)} held out; "
          f"adapter after {k} of {model.cfg.n_layers} layers, {sum(p.numel() for p in adapter.parameters())} parameters",
          file=sys.stderr)
    cfg = kt.TrainConfig(steps=args.steps, batch=args.batch, positions=args.positions, lr=args.lr, seed=args.seed)
    state = None
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        if ck.get("key") == key and ck.get("train") == cfg:
            state = ck["state"]
            print(f"[specdec] resuming from step {state['step']} ({ckpt_path})", file=sys.stderr)
    w_head = kt.head_weight(model)
    bar = tqdm(total=cfg.steps, initial=state["step"] if state else 0, desc="kangaroo", unit="step", leave=False)

    def on_step(step: int, loss: float, st: dict) -> None:
        bar.update(1)
        bar.set_postfix_str(f"loss {loss:.3f}")
        if step % 25 == 0 or step == cfg.steps:
            torch.save({"key": key, "train": cfg, "state": st}, ckpt_path)

    losses = kt.train(adapter, train_data, w_head, cfg, state=state, on_step=on_step)
    bar.close()
    rep = kt.report(model, adapter, held_data)
    tail = losses[-20:]
    card = {"target": target.name, "layers": k, "method": "Kangaroo adapter, self-distilled on the target's own "
            "continuations of built-in prompts", "train_sequences": len(train_data), "train_tokens": tokens,
            "steps": cfg.steps, "batch": cfg.batch, "positions": cfg.positions, "lr": cfg.lr, "top_k": args.top_k,
            "seed": args.seed, "final_loss": round(sum(tail) / max(len(tail), 1), 4),
            "wall_s_this_run": round(time.perf_counter() - t0, 1), "held_out": rep}
    save_adapter(adapter, out, card=card)
    out.with_name(out.stem + ".json").write_text(json.dumps(card, indent=1) + "\n")
    ls = rep[f"layerskip:{k}"]
    print(f"[specdec] {out}: loss {card['final_loss']:.3f}; held-out acceptance kangaroo α0 {rep['kangaroo']['alpha_t0']:.3f} "
          f"α1 {rep['kangaroo']['alpha_t1']:.3f} vs layerskip:{k} α0 {ls['alpha_t0']:.3f} α1 {ls['alpha_t1']:.3f} "
          f"({rep['held_out_positions']} positions)", file=sys.stderr)
    return 0
