"""One benchmark mode in its own process (so its peak memory is its own).

Reads a job (JSON) on stdin, loads what the mode needs, warms up, then writes one JSON line per
generation to stdout and a final ``{"done": ...}`` line with the process's peak RSS.
Run by :mod:`specdec.bench.runner`; not a user-facing command.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specdec.bench.report import PAIRED_COUPLED
from specdec.bench.runner import ERROR_MARK, draft_arms
from specdec.bench.workloads import Prompt, check_chat
from specdec.errors import SpecdecError
from specdec.sampling import SamplingConfig


@dataclass(frozen=True)
class Job:
    mode: str  # plain | edge_only | speculative | hf_plain | hf_assisted | llamacpp | edge_cloud | cloud_streaming[_spec]
    target: str
    draft: str  # a name, or a comma list: the speculative mode then runs every drafter
    prompts: list[dict]
    temperatures: list[float]
    methods: list[str] = field(default_factory=lambda: ["block"])
    gammas: list[str] = field(default_factory=lambda: ["auto"])
    max_new_tokens: int = 128
    repeats: int = 1
    seed: int = 0
    top_p: float | None = None
    repetition_penalty: float | None = None
    draft_dtype: str = "auto"
    draft_vocab: str = "auto"  # or a comma list (auto,full): the speculative mode then runs each drafter under each
    draft_temperature_factor: str = "auto"
    dtype: str = "auto"  # the target's precision (as `specdec generate --dtype`)
    tree_min_prob: float | None = None  # None = the default floor
    batch_invariant: bool = True
    kv_dtype: str = "auto"  # the target's key/value cache (as `specdec generate --kv-dtype`)
    threads: int | None = None
    # network modes (specdec.bench.network): one RTT per worker
    net_modes: list[str] = field(default_factory=list)  # run interleaved, prompt by prompt
    wires: list[str] = field(default_factory=list)
    q_top_k: int = 16
    url: str | None = None
    api_key: str | None = None
    rtt_ms: float | None = None
    emulation: str | None = None
    # llama.cpp rows (specdec.bench.llamacpp): variants run prompt by prompt in this worker
    llamacpp: list[str] = field(default_factory=list)
    llamacpp_draft_max: int = 16
    llamacpp_p_min: float = 0.75
    # a resumed run (specdec.bench.journal): the (temperature, repeat, prompt id) units it already has
    skip: list[list] = field(default_factory=list)


def tokens_sha1(tokens: list[int]) -> str:
    """A short fingerprint of a generation's token ids (equal outputs <=> equal fingerprints, in practice)."""
    import hashlib

    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _emit(row: dict) -> None:
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()


def _todo(job: Job, prompts: list[Prompt], temperature: float) -> list[tuple[int, int, Prompt]]:
    """``(repeat, index, prompt)`` of the units of ``temperature`` still to run (a resumed run
    leaves out those in ``job.skip``; it may have them all)."""
    skip = {tuple(u) for u in job.skip}
    return [(rep, i, p) for rep in range(job.repeats) for i, p in enumerate(prompts) if (temperature, rep, p.id) not in skip]


def _units(job: Job, prompts: list[Prompt], temperature: float):
    """``(repeat, seed, index, prompt)`` for :func:`_todo`'s units, each followed, once the caller's
    loop body has made its rows, by ``{"unit": [temperature, repeat, prompt id]}`` (the runner
    journals a unit's rows then; a unit cut short by an interruption announces nothing)."""
    for rep, i, p in _todo(job, prompts, temperature):
        yield rep, job.seed + rep, i, p
        _emit({"unit": [temperature, rep, p.id]})


def _sampling(job: Job, temperature: float, seed: int) -> SamplingConfig:
    return SamplingConfig(
        temperature=temperature,
        top_p=job.top_p if temperature > 0 else None,
        repetition_penalty=job.repetition_penalty or 1.0,
        seed=seed,
        max_new_tokens=job.max_new_tokens,
    )


def _settings(job: Job, temperature: float):
    """(method, gamma) pairs this job runs at ``temperature``, in a fixed order."""
    from specdec.engine import default_method

    if job.mode != "speculative":
        yield ("greedy" if temperature == 0 else "sample"), None
        return
    for m in job.methods:
        if m == "greedy" and temperature > 0:
            continue
        method = default_method(SamplingConfig(temperature=temperature)) if m == "default" else m
        for g in job.gammas:
            yield method, g


def _decoder(engine, rule, gamma: str | None, tree_min_prob: float | None = None):  # noqa: ANN001 - Engine, Rule
    """``tree-auto`` / ``tree-N`` settings draft token trees; anything else is a chain γ."""
    text = gamma or "auto"
    if text.startswith("tree-"):
        return engine.decoder(rule, "auto", tree=text[len("tree-") :], tree_min_prob=tree_min_prob)
    return engine.decoder(rule, text)


def _row(job: Job, mode: str, method: str, gamma: str | None, temperature: float, p: Prompt, seed: int, res) -> dict:
    st = res.stats
    return {
        "mode": mode, "method": method, "gamma": gamma, "temperature": temperature, "prompt_id": p.id,
        "category": p.category, "seed": seed, **{k: v for k, v in st.to_dict().items() if k != "method"},
        "rule": st.method, "rss_peak_bytes": _peak_rss(), "tokens_sha1": tokens_sha1(res.tokens),
    }


def run_engine(job: Job, prompts: list[Prompt]) -> None:
    """Our engine.  In the speculative job every prompt is also decoded plainly, among its
    speculative runs and in the same process ("plain_paired"), so that speed-ups compare runs
    taken seconds apart: on a shared machine the same decoding can drift by 10-20% over minutes.
    Where coupled verification runs at T > 0, the prompt is decoded plainly a second time with the
    coupled rule ("plain_paired_coupled": seeded Gumbel-max sampling, what a user who passes a seed
    runs without a drafter), the reference of the coupled rows and the tokens they must equal.
    """
    from specdec.engine import Engine, EngineConfig, factor_for, load_draft
    from specdec.verify import get_rule

    runs = draft_arms(job.draft, job.draft_vocab)  # (label, drafter, vocabulary)
    drafts = [label for label, _, _ in runs]
    if job.mode == "edge_only":  # the draft model alone, in the precision it drafts in
        draft = load_draft(EngineConfig(draft=job.draft, draft_dtype=job.draft_dtype, draft_vocab=job.draft_vocab))
        engine = Engine(draft, None, "none")
    elif job.mode == "plain":
        engine = Engine.build(EngineConfig(target=job.target, draft="none", dtype=job.dtype, batch_invariant=job.batch_invariant,
                                           kv_dtype=job.kv_dtype))
    else:
        cfgs = [EngineConfig(target=job.target, draft=d, dtype=job.dtype, draft_dtype=job.draft_dtype, draft_vocab=v,
                             draft_temperature_factor=factor_for(d, job.draft_temperature_factor),
                             batch_invariant=job.batch_invariant, kv_dtype=job.kv_dtype) for _, d, v in runs]
        engine = Engine.build(cfgs[0])
        # several drafters share the one loaded target; each is decoded on every prompt beside the
        # same plain_paired run, so their speed-ups are paired with the same reference
        engines = [engine] + [Engine.attach(engine.target, c) for c in cfgs[1:]]
    if job.mode != "speculative":
        engines = [engine]
    tag = len(engines) > 1  # rows say which drafter made them only when there is a choice
    plain = Engine(engine.target, None, "none")
    check_chat(prompts, engine.target.tokenizer, job.target)
    encoded = {p.id: engine.encode(p.text, chat=p.chat) for p in prompts}
    llama = _llamacpp_runner(job, engine.target.eos_ids, encoded) if job.llamacpp else None
    for temperature in job.temperatures:
        if not _todo(job, prompts, temperature):
            continue
        settings = list(_settings(job, temperature))
        # coupled rows at T > 0 get their own plain reference: plain decoding with a seed draws by
        # Gumbel-max as coupled speculation does, not by the block rule's cheaper inverse-CDF draw
        coupled = job.mode == "speculative" and temperature > 0 and any(m == "coupled" for m, _ in settings)
        warm = SamplingConfig(temperature=temperature, seed=0, max_new_tokens=16)
        for eng in engines:
            for method, gamma in settings:  # warm-up (oneDNN kernels, allocator), not recorded
                _decoder(eng, get_rule("block" if method == "sample" else method), gamma, job.tree_min_prob).generate(encoded[prompts[0].id], warm)
        if coupled:
            plain.decoder(get_rule("coupled")).generate(encoded[prompts[0].id], warm)
        if llama is not None:
            _llamacpp_warmup(job, llama, encoded[prompts[0].id], temperature)
        # every run of a prompt (llama.cpp's variants, the plain references and each (drafter,
        # setting) pair), their order rotated from prompt to prompt: see ``_arms`` and ``_in_turn``
        refs = []
        if job.mode == "speculative":
            refs = [("plain_paired", "greedy" if temperature == 0 else "block")] + ([(PAIRED_COUPLED, "coupled")] if coupled else [])
        arms = _arms(job.llamacpp if llama is not None else [], refs,
                     [(eng, draft, method, gamma) for eng, draft in zip(engines, drafts) for method, gamma in settings])
        for rep, seed, i, p in _units(job, prompts, temperature):
            cfg = _sampling(job, temperature, seed)
            for arm in _in_turn(arms, i, rep):
                if arm.kind == "llamacpp":  # llama.cpp on the same prompt, seconds from specdec's runs
                    _llamacpp_rows(job, llama, p, encoded[p.id], temperature, seed, [arm.name])
                elif arm.kind == "reference":  # a plain reference: name is its mode, method its rule
                    _emit(_row(job, arm.name, arm.name, None, temperature, p, seed,
                               plain.decoder(get_rule(arm.method)).generate(encoded[p.id], cfg)))
                else:
                    eng, method, gamma = arm.engine, arm.method, arm.gamma
                    rule = get_rule("block" if method == "sample" else method)
                    res = _decoder(eng, rule, gamma, job.tree_min_prob).generate(encoded[p.id], cfg)
                    name = method if job.mode == "speculative" else job.mode
                    row = _row(job, job.mode, name, gamma, temperature, p, seed, res)
                    if eng.draft_model is not None:  # a draft model: the tokens it could propose
                        row["draft_vocab_size"] = getattr(eng.draft_model.model, "proposal_vocab", None)
                    _emit({**row, "draft": arm.name} if tag else row)


class _Arm(NamedTuple):
    """One run of a prompt: a llama.cpp variant, a plain reference, or an engine's (drafter, setting)."""

    kind: str  # "llamacpp" | "reference" | "engine"
    name: str  # the llama.cpp variant, the reference's mode, or the drafter's label
    method: str | None = None  # the reference's or the setting's rule
    gamma: str | None = None
    engine: object | None = None  # the Engine that runs an "engine" arm


def _arms(llamacpp: list[str], refs: list[tuple[str, str]], runs: list[tuple]) -> list[_Arm]:
    """A prompt's runs before rotation: llama.cpp's variants, the plain references ((mode, rule)),
    then the engines' runs ((engine, drafter label, method, gamma))."""
    return ([_Arm("llamacpp", v) for v in llamacpp] + [_Arm("reference", name, rule) for name, rule in refs]
            + [_Arm("engine", draft, method, gamma, eng) for eng, draft, method, gamma in runs])


def _in_turn(arms: list[_Arm], prompt: int, rep: int) -> list[_Arm]:
    """``arms`` turned one place on from prompt to prompt and from repeat to repeat on the same prompt.

    A fixed order would give each run its own place (after llama.cpp's, whose threads may still be
    spinning, and after the others): a bias between the rows compared. An offset of rep * prompts
    gave a prompt the same order in every repeat whenever the arms' count divides the prompts'.
    """
    turn = (prompt + rep) % max(len(arms), 1)  # max(..., 1): no arm (greedy alone at T > 0, no reference)
    return arms[turn:] + arms[:turn]


class _FirstTokenTimer:
    """A transformers streamer that only records when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:  # noqa: ANN001 - transformers' streamer protocol
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(job: Job, prompts: list[Prompt]) -> None:
    """Hugging Face ``generate`` on the same weights, plain or with ``assistant_model=``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models.registry import eos_ids, resolve
    from specdec.text import encode_prompt

    tfolder = resolve(job.target).folder
    tokenizer = AutoTokenizer.from_pretrained(str(tfolder))
    target = AutoModelForCausalLM.from_pretrained(str(tfolder), dtype=torch.float32).eval()
    assistant = None
    if job.mode == "hf_assisted":
        from specdec.drafters.hybrid import split_lookup

        assistant = AutoModelForCausalLM.from_pretrained(str(resolve(split_lookup(job.draft)[0]).folder), dtype=torch.float32).eval()
    eos = sorted(eos_ids(tfolder, tokenizer, target.config.to_dict()))  # (as specdec's own rows stop)
    check_chat(prompts, tokenizer, job.target)
    encoded = {p.id: encode_prompt(tokenizer, p.text, chat=p.chat) for p in prompts}

    def generate(ids: list[int], temperature: float, seed: int, max_new: int):
        x = torch.tensor([ids])
        kwargs = dict(max_new_tokens=max_new, do_sample=temperature > 0, eos_token_id=eos, pad_token_id=eos[0])
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=job.top_p or 1.0)
        if job.repetition_penalty:
            kwargs.update(repetition_penalty=job.repetition_penalty)
        if assistant is not None:
            kwargs.update(assistant_model=assistant)
        timer = _FirstTokenTimer()
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(x, attention_mask=torch.ones_like(x), streamer=timer, **kwargs)
        wall = time.perf_counter() - start
        return out[0, x.shape[1]:].tolist(), wall, (timer.first - start) if timer.first else wall

    for temperature in job.temperatures:
        if not _todo(job, prompts, temperature):
            continue
        generate(encoded[prompts[0].id], temperature, 0, 16)  # warm-up
        for _, seed, _, p in _units(job, prompts, temperature):
            tokens, wall, ttft = generate(encoded[p.id], temperature, seed, job.max_new_tokens)
            n = len(tokens)
            _emit({
                "mode": job.mode, "method": job.mode, "gamma": None, "temperature": temperature,
                "prompt_id": p.id, "category": p.category, "seed": seed, "generated_tokens": n,
                "wall_s": wall, "tokens_per_s": n / wall if wall > 0 else 0.0, "ttft_s": ttft,
                "lossless": True, "rss_peak_bytes": _peak_rss(),
                "hf_num_assistant_tokens": getattr(assistant.generation_config, "num_assistant_tokens", None) if assistant else None,
            })


def _llamacpp_runner(job: Job, eos_ids: frozenset[int], encoded: dict[str, list[int]]):
    """llama.cpp on the GGUF file the target is made from, with the variants of ``job.llamacpp``,
    its context sized for the longest of the ``encoded`` prompts."""
    from specdec.bench.llamacpp import LlamaCppRunner, context_for
    from specdec.models.registry import gguf_file

    n_ctx = context_for(max(map(len, encoded.values())), job.max_new_tokens, job.llamacpp_draft_max)
    return LlamaCppRunner.load(gguf_file(job.target), list(job.llamacpp), draft=job.draft, eos_ids=eos_ids,
                               threads=job.threads or torch.get_num_threads(), draft_max=job.llamacpp_draft_max,
                               p_min=job.llamacpp_p_min, n_ctx=n_ctx)


def _llamacpp_warmup(job: Job, llama, ids: list[int], temperature: float) -> None:  # noqa: ANN001
    for v in job.llamacpp:
        llama.generate(v, ids, temperature=temperature, seed=0, max_new=16, top_p=job.top_p)


def _llamacpp_rows(job: Job, llama, p: Prompt, ids: list[int], temperature: float, seed: int,  # noqa: ANN001
                   variants: list[str] | None = None) -> None:
    from specdec.bench.llamacpp import run_rows

    def make_row(variant: str, stats: dict) -> dict:
        mode = f"llamacpp_{variant}"
        return {"mode": mode, "method": mode, "gamma": None, "temperature": temperature, "prompt_id": p.id,
                "category": p.category, "seed": seed, **stats, "rss_peak_bytes": _peak_rss(),
                **({"draft_max": job.llamacpp_draft_max, "draft_p_min": job.llamacpp_p_min} if variant == "spec" else {})}

    for row in run_rows(llama, list(job.llamacpp if variants is None else variants), ids, temperature=temperature, seed=seed, max_new=job.max_new_tokens,
                        top_p=job.top_p if temperature > 0 else None, repetition_penalty=job.repetition_penalty,
                        make_row=make_row):
        _emit(row)


def run_llamacpp(job: Job, prompts: list[Prompt]) -> None:
    """llama.cpp alone (the ``llamacpp`` mode when no speculative worker hosts its rows)."""
    import json as _json

    from specdec.models.registry import eos_ids, load_tokenizer, resolve
    from specdec.text import encode_prompt

    folder = resolve(job.target).folder
    tokenizer = load_tokenizer(folder)
    eos = eos_ids(folder, tokenizer, _json.loads((folder / "config.json").read_text()))
    check_chat(prompts, tokenizer, job.target)
    encoded = {p.id: encode_prompt(tokenizer, p.text, chat=p.chat) for p in prompts}
    llama = _llamacpp_runner(job, eos, encoded)
    for temperature in job.temperatures:
        if not _todo(job, prompts, temperature):
            continue
        _llamacpp_warmup(job, llama, encoded[prompts[0].id], temperature)
        for _, seed, _, p in _units(job, prompts, temperature):
            _llamacpp_rows(job, llama, p, encoded[p.id], temperature, seed)


def main() -> int:
    spec = json.loads(sys.stdin.read())
    job = Job(**spec)
    if job.threads:
        torch.set_num_threads(job.threads)
    prompts = [Prompt(**p) for p in job.prompts]
    if job.url is not None:
        from specdec.bench.edge_worker import run_network

        run_network(job, prompts, _emit, _sampling, _peak_rss, _todo, _units)
    elif job.mode.startswith("hf_"):
        run_hf(job, prompts)
    elif job.mode == "llamacpp":
        run_llamacpp(job, prompts)
    else:
        run_engine(job, prompts)
    _emit({"done": True, "rss_peak_bytes": _peak_rss()})
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SpecdecError as exc:  # a bad model, option or file: one line, not a traceback
        print(f"{ERROR_MARK}{exc}", file=sys.stderr)
        sys.exit(2)
