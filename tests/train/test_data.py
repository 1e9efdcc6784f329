"""Training data: prompts stay clear of the benchmark, batched generation equals one-at-a-time decoding,
stored features are the target's, and a stopped run resumes."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from specdec.bench.workloads import BUILTIN
from specdec.errors import ConfigError
from specdec.train.data import DataConfig, Shard, generate, load_shards, plan
from specdec.train.prompts import chat_prompts, code_prompts
from tests.tiny import make_tiny


def test_chat_prompts_are_distinct_deterministic_and_not_the_benchmarks() -> None:
    a = chat_prompts(500, seed=3)
    assert len(set(a)) == 500 and a == chat_prompts(500, seed=3) and a != chat_prompts(500, seed=4)
    bench = [p.text.lower() for p in BUILTIN]
    for p in chat_prompts(5000):
        assert p.lower() not in bench
        assert not any(w in p.lower() for w in ("tcp", "photosynthesis", "pancake", "lighthouse"))


def test_code_prompts_are_stdlib_function_headers_not_the_benchmarks() -> None:
    bench_names = {p.id.split("/", 1)[1] for p in BUILTIN if p.category == "code"}
    prompts = code_prompts(40)
    assert len(prompts) == 40
    for text in prompts:
        fn = ast.parse(text + "    pass\n").body[-1]
        assert isinstance(fn, ast.FunctionDef) and fn.name not in bench_names
        assert ast.get_docstring(fn)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory):
    from specdec.models.registry import load

    folder = make_tiny(tmp_path_factory.mktemp("tiny"), layers=2, hidden=32, max_positions=512)
    return load(str(folder), batch_invariant=False)


def test_generation_features_and_resume(tiny_target, tmp_path: Path) -> None:
    lm = tiny_target
    cfg = DataConfig(sequences=5, batch=3, shard_size=2, max_new_chat=6, max_new_code=6, taps=(1,), temperatures=(0.0, 1.0))
    out = tmp_path / "data"
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out) == 5
    shards = sorted(out.glob("shard-*.pt"))
    assert [p.name for p in shards] == ["shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
    data = load_shards(out)
    todo = plan(cfg, lm.tokenizer)
    model = lm.model
    for i, (ids, n0, temp) in enumerate(zip(data.tokens, data.prompt_len, data.temperature)):
        prompt, _, want_temp, _ = todo[i]
        assert ids[:n0].tolist() == prompt and temp == want_temp and ids.numel() == n0 + 6
        if temp == 0.0:  # greedy: the batched run equals plain one-token-at-a-time decoding
            cache = model.new_cache(64)
            logits = model.forward(torch.tensor(prompt), cache, last_only=True)
            seq = list(prompt)
            for _ in range(6):
                seq.append(int(logits[0].argmax()))
                logits = model.forward(torch.tensor(seq[-1:]), cache)
            assert ids.tolist() == seq
        taps: dict[int, torch.Tensor] = {1: torch.empty(0)}
        final = model.hidden(ids.long(), model.new_cache(64), taps=taps)
        feats = data.feats[i]  # [n, 2, D] float16
        torch.testing.assert_close(feats[:, -1].float(), final, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(feats[:, 0].float(), taps[1], atol=2e-3, rtol=2e-3)
    # resume: the last shard is lost, a rerun rebuilds only it
    first = shards[0].read_bytes()
    shards[-1].unlink()
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out) == 5
    assert shards[-1].is_file() and shards[0].read_bytes() == first
    assert len(load_shards(out).tokens) == 5


def test_prompt_file_replaces_the_templates(tiny_target, tmp_path: Path) -> None:
    """--prompt-file: every planned sequence answers a prompt of the file (cycled past its length),
    with the chat template where the line says chat and the kind from its category."""
    import json

    from specdec.text import encode_prompt

    lines = [{"prompt": "Write a haiku about rain.", "chat": True},
             {"prompt": "def add(a, b):\n", "chat": False, "category": "code"},
             {"prompt": "Summarise the plot of a novel.", "chat": True, "category": "assistant"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    tok = tiny_target.tokenizer
    cfg = DataConfig(sequences=7, prompt_file=str(path), max_new_chat=9, max_new_code=5)
    items = plan(cfg, tok)
    assert len(items) == 7
    want = {tuple(encode_prompt(tok, x["prompt"], chat=x["chat"])): x for x in lines}
    seen = set()
    for ids, kind, temp, max_new in items:
        row = want[tuple(ids)]  # KeyError: a prompt that is not in the file
        seen.add(row["prompt"])
        assert kind == row.get("category", "chat" if row["chat"] else "code")
        assert max_new == (9 if row["chat"] else 5)
    assert len(seen) == 3  # 7 sequences over 3 prompts: all of them used
    assert plan(cfg, tok) == items  # deterministic in the seed


def test_the_plan_cycles_the_temperatures_and_keeps_the_chat_share(tiny_target) -> None:
    tok = tiny_target.tokenizer
    items = plan(DataConfig(sequences=12, chat_share=0.25, temperatures=(0.0, 1.0, 0.5)), tok)
    assert [t for _, _, t, _ in items] == [0.0, 1.0, 0.5] * 4
    assert sum(kind == "chat" for _, kind, _, _ in items) == 3
    assert sum(kind == "chat" for _, kind, _, _ in plan(DataConfig(sequences=12, chat_share=1.0), tok)) == 12


def test_a_prompt_files_order_depends_on_the_seed(tiny_target, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question number {i}?", "chat": True}) + "\n" for i in range(12)))
    tok = tiny_target.tokenizer
    a = [ids for ids, *_ in plan(DataConfig(sequences=12, prompt_file=str(path), seed=0), tok)]
    b = [ids for ids, *_ in plan(DataConfig(sequences=12, prompt_file=str(path), seed=1), tok)]
    assert sorted(a) == sorted(b) and a != b


class _Counting:
    """The model, with the widest batch it was handed."""

    def __init__(self, model) -> None:
        self.model, self.widest = model, 0

    def forward_batch(self, items):
        self.widest = max(self.widest, len(items))
        return self.model.forward_batch(items)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_generation_decodes_at_most_batch_sequences_together(tiny_target, tmp_path: Path) -> None:
    spy = _Counting(tiny_target.model)
    cfg = DataConfig(sequences=7, batch=3, shard_size=4, max_new_chat=4, max_new_code=4, features=False)
    assert generate(cfg, spy, tiny_target.tokenizer, frozenset(), tmp_path / "data") == 7
    assert spy.widest == 3


def test_a_rerun_keeps_the_shards_on_disk_and_refuses_other_settings(tiny_target, tmp_path: Path) -> None:
    lm = tiny_target
    out = tmp_path / "data"
    cfg = DataConfig(sequences=4, batch=2, shard_size=2, max_new_chat=3, max_new_code=3, features=False)
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out) == 4
    first = torch.load(out / "shard-00000.pt", weights_only=True)
    first["temperature"] = [99.0, 99.0]  # a mark: a rerun that regenerated this shard would lose it
    torch.save(first, out / "shard-00000.pt")
    (out / "shard-00001.pt").unlink()
    seen = []
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out, progress=seen.append) == 4
    assert seen[0] == 2  # the sequences already on disk, counted once
    assert load_shards(out).temperature[:2] == [99.0, 99.0] and len(load_shards(out).tokens) == 4
    with pytest.raises(ConfigError, match=r"other settings \(max_new_chat\)"):
        generate(DataConfig(sequences=4, batch=2, shard_size=2, max_new_chat=5, max_new_code=3, features=False),
                 lm.model, lm.tokenizer, frozenset(), out)


def test_an_interrupted_shard_write_leaves_the_shard_as_it_was(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "shard-00000.pt"
    Shard(kind=["chat"]).save(path)
    before = path.read_bytes()

    def cut_short(obj, f, *args, **kwargs):  # a write killed half-way
        Path(f).write_bytes(before[:50])
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(KeyboardInterrupt):
        Shard(kind=["code"]).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and load_shards(tmp_path).kind == ["chat"]


def test_a_shard_deleted_in_the_middle_is_generated_again(tiny_target, tmp_path: Path) -> None:
    """A rerun resumes at the first missing shard (a damaged one deleted, as load_shards' error
    advises), not after as many shards as are on disk: with shard 0 of 3 gone it counted all six
    sequences done and left four on disk."""
    lm = tiny_target
    out = tmp_path / "data"
    cfg = DataConfig(sequences=6, batch=3, shard_size=2, max_new_chat=3, max_new_code=3, features=False)
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out) == 6
    (out / "shard-00000.pt").unlink()
    seen = []
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out, progress=seen.append) == 6
    assert seen[0] == 0  # nothing before the gap
    assert sorted(p.name for p in out.glob("shard-*.pt")) == [f"shard-{i:05d}.pt" for i in range(3)]
    assert len(load_shards(out).tokens) == 6
