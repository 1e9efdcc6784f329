"""Training data: prompts stay clear of the benchmark, batched generation equals one-at-a-time decoding,
stored features are the target's, and a stopped run resumes."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch

from specdec.bench.workloads import BUILTIN
from specdec.errors import ConfigError
from specdec.text import encode_prompt
from specdec.train import prompts as pr
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


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = model.new_cache(len(prompt) + n + 1)
    logits = model.forward(torch.tensor(prompt), cache, last_only=True)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(logits[0].argmax()))
        logits = model.forward(torch.tensor(seq[-1:]), cache)
    return seq


def test_code_prompts_are_planned_without_the_chat_template(tiny_target) -> None:
    """Code completions are raw text (chat=False), chat instructions go through the chat template."""
    tok = tiny_target.tokenizer
    items = plan(DataConfig(sequences=10, chat_share=0.5), tok)
    code = {tuple(encode_prompt(tok, c, chat=False)) for c in pr.code_prompts(5, seed=0)}
    chat = {tuple(encode_prompt(tok, c, chat=True)) for c in pr.chat_prompts(5, seed=0)}
    for ids, kind, _, _ in items:
        assert tuple(ids) in (code if kind == "code" else chat), kind


def test_the_plan_interleaves_chat_and_code(tiny_target) -> None:
    """The sequences come shuffled (seeded), not all chats first: a partial run or the held-out
    split sees both kinds."""
    tok = tiny_target.tokenizer
    kinds = [k for _, k, _, _ in plan(DataConfig(sequences=20, chat_share=0.5), tok)]
    assert kinds.count("chat") == 10 and kinds != sorted(kinds) and kinds != sorted(kinds, reverse=True)
    assert kinds != [k for _, k, _, _ in plan(DataConfig(sequences=20, chat_share=0.5, seed=1), tok)]


def test_a_finished_folder_reports_its_sequence_count(tiny_target, tmp_path: Path) -> None:
    """5 sequences in shards of 2: a rerun reports 5 done, not the 6 that three full shards would hold."""
    cfg = DataConfig(sequences=5, batch=3, shard_size=2, max_new_chat=2, max_new_code=2, features=False)
    out = tmp_path / "data"
    assert generate(cfg, tiny_target.model, tiny_target.tokenizer, frozenset(), out) == 5
    seen: list[int] = []
    assert generate(cfg, tiny_target.model, tiny_target.tokenizer, frozenset(), out, progress=seen.append) == 5
    assert seen == [5]


def _one_prompt(tmp_path: Path) -> str:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "Tell me about rivers.", "chat": True}) + "\n")
    return str(path)


def test_sampling_follows_the_seed_and_repeats_with_it(tiny_target, tmp_path: Path) -> None:
    """T = 1 replies to one prompt: the same seed writes the same tokens (the sampler's generator is
    seeded, not torch's global one), another seed other tokens (2 sequences x 4 tokens each)."""
    lm = tiny_target

    def run(seed: int, name: str) -> list[list[int]]:
        cfg = DataConfig(sequences=2, batch=2, shard_size=2, max_new_chat=4, temperatures=(1.0,), features=False,
                         prompt_file=_one_prompt(tmp_path), seed=seed)
        generate(cfg, lm.model, lm.tokenizer, frozenset(), tmp_path / name)
        return [t.tolist() for t in load_shards(tmp_path / name).tokens]

    a = run(0, "a")
    torch.manual_seed(123)  # the global generator moves between the runs
    assert run(0, "b") == a
    assert run(1, "c") != a


def test_a_low_temperature_samples_the_greedy_reply(tiny_target, tmp_path: Path) -> None:
    """The temperature divides the logits: at T = 1e-4 sampling is (in practice) the arg-max, where
    T = 1 over a 49k vocabulary is not (2 sequences x 6 tokens)."""
    lm = tiny_target
    cfg = DataConfig(sequences=2, batch=2, shard_size=2, max_new_chat=6, max_new_code=6, temperatures=(1e-4,),
                     features=False)
    generate(cfg, lm.model, lm.tokenizer, frozenset(), tmp_path / "d")
    data = load_shards(tmp_path / "d")
    for ids, n0 in zip(data.tokens, data.prompt_len):
        assert ids.tolist() == _greedy(lm.model, ids[:n0].tolist(), 6)


def test_a_sequence_ends_at_an_end_of_sequence_token(tiny_target, tmp_path: Path) -> None:
    """With its first greedy reply token made an EOS, each sequence stops right after the first
    EOS it produces (and is the greedy reply up to there)."""
    lm = tiny_target
    cfg = DataConfig(sequences=4, batch=2, shard_size=4, max_new_chat=6, max_new_code=6, temperatures=(0.0,),
                     features=False)
    generate(cfg, lm.model, lm.tokenizer, frozenset(), tmp_path / "free")
    free = load_shards(tmp_path / "free")
    eos = int(free.tokens[0][free.prompt_len[0]])
    generate(cfg, lm.model, lm.tokenizer, frozenset({eos}), tmp_path / "eos")
    stopped = load_shards(tmp_path / "eos")
    assert stopped.tokens[0].numel() == stopped.prompt_len[0] + 1
    for a, b, n0 in zip(free.tokens, stopped.tokens, stopped.prompt_len):
        reply = b[n0:].tolist()
        assert b.tolist() == a[: b.numel()].tolist()
        assert eos not in reply[:-1] and (reply[-1] == eos or len(reply) == 6)


class _Spy:
    """The model, counting prompt passes (``forward``) and raising after ``stop_after`` finished sequences."""

    def __init__(self, model) -> None:
        self.model, self.prompts = model, 0

    def forward(self, *args, **kwargs):
        self.prompts += 1
        return self.model.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_resume_decodes_only_the_missing_sequences(tiny_target, tmp_path: Path) -> None:
    """Shard 1 of 2 lost: the rerun prefills 2 prompts, not 4, and counts 2 + 2 in its progress."""
    lm = tiny_target
    out = tmp_path / "data"
    cfg = DataConfig(sequences=4, batch=2, shard_size=2, max_new_chat=3, max_new_code=3, features=False)
    generate(cfg, lm.model, lm.tokenizer, frozenset(), out)
    (out / "shard-00001.pt").unlink()
    spy, seen = _Spy(lm.model), []
    assert generate(cfg, spy, lm.tokenizer, frozenset(), out, progress=seen.append) == 4
    assert spy.prompts == 2 and seen == [2, 1, 1]


def test_shards_are_written_as_they_fill(tiny_target, tmp_path: Path) -> None:
    """Sequences are started in plan order, so a run stopped after 4 of 6 sequences (batch 2) has
    the first shard on disk already, and the rerun finishes from there."""
    lm = tiny_target
    out = tmp_path / "data"
    cfg = DataConfig(sequences=6, batch=2, shard_size=2, max_new_chat=3, max_new_code=3, features=False)
    done = []

    def stop_at_four(n: int) -> None:
        done.append(n)
        if len(done) == 5:  # the first call reports what was on disk (0), then one per finished sequence
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(cfg, lm.model, lm.tokenizer, frozenset(), out, progress=stop_at_four)
    assert (out / "shard-00000.pt").is_file()
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out) == 6 and len(load_shards(out).tokens) == 6


def test_features_are_stored_as_float16(tiny_target, tmp_path: Path) -> None:
    """A position's features are float16 on disk (half the size of float32)."""
    lm = tiny_target
    cfg = DataConfig(sequences=1, batch=1, shard_size=1, max_new_chat=2, max_new_code=2, taps=(1,))
    generate(cfg, lm.model, lm.tokenizer, frozenset(), tmp_path / "d")
    assert load_shards(tmp_path / "d").feats[0].dtype == torch.float16


def test_a_folder_from_before_the_sampler_setting_resumes(tiny_target, tmp_path: Path) -> None:
    """Older folders' config.json lacks ``sampler`` (they were all target-sampled): they resume."""
    lm = tiny_target
    out = tmp_path / "data"
    cfg = DataConfig(sequences=4, batch=2, shard_size=2, max_new_chat=2, max_new_code=2, features=False)
    generate(cfg, lm.model, lm.tokenizer, frozenset(), out)
    old = json.loads((out / "config.json").read_text())
    del old["sampler"]
    (out / "config.json").write_text(json.dumps(old))
    (out / "shard-00001.pt").unlink()
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out) == 4
    with pytest.raises(ConfigError, match="sampler"):  # but a draft-sampled run does not resume it
        generate(DataConfig(**{**cfg.__dict__, "sampler": "draft"}), lm.model, lm.tokenizer, frozenset(), out)


def test_a_folder_without_shards_starts_over_with_new_settings(tiny_target, tmp_path: Path) -> None:
    """A run stopped before its first shard left only config.json: nothing to protect, so a rerun
    with other settings goes ahead (and records them)."""
    lm = tiny_target
    out = tmp_path / "data"
    out.mkdir()
    old = DataConfig(sequences=2, max_new_chat=9, features=False)
    (out / "config.json").write_text(json.dumps(json.loads(json.dumps(old.__dict__))))
    cfg = DataConfig(sequences=2, batch=2, shard_size=2, max_new_chat=2, max_new_code=2, features=False)
    assert generate(cfg, lm.model, lm.tokenizer, frozenset(), out) == 2
    assert json.loads((out / "config.json").read_text())["max_new_chat"] == 2


def test_chat_prompts_leave_out_the_benchmarks_even_when_the_tables_would_make_them(monkeypatch) -> None:
    """The filters work on whatever the tables produce: a benchmark prompt spelled out exactly, or a
    benchmark topic word inside a prompt, never reaches the training data."""
    monkeypatch.setattr(pr, "_TASKS", ("{t}", "Write about {t}."))
    monkeypatch.setattr(pr, "_TOPICS", ("What are the main strengths of Python compared with C?", "lighthouses", "owls"))
    got = pr.chat_prompts(10)
    assert sorted(got) == ["Write about What are the main strengths of Python compared with C?.", "Write about owls.", "owls"]


def test_code_prompts_leave_out_the_benchmarks_function_names(tmp_path: Path) -> None:
    names = set()
    for p in BUILTIN:
        if p.category == "code":
            names |= set(re.findall(r"^def (\w+)", p.text, re.M))
    assert {"read_rows", "retry"} <= names
    body = '    """{} the thing given, with a docstring long enough to be a prompt."""\n    return None\n\n\n'
    (tmp_path / "lib.py").write_text("".join(f"def {n}(x):\n" + body.format(n) for n in sorted(names) + ["keep_me"]))
    got = code_prompts(20, root=tmp_path)
    assert [ast.parse(t + "    pass\n").body[-1].name for t in got] == ["keep_me"]


def test_chat_prompts_leave_out_benchmark_words_in_any_case(monkeypatch) -> None:
    """The benchmark-word filter ignores case: "TCP" or "Lighthouse" in a topic is left out too."""
    monkeypatch.setattr(pr, "_TASKS", ("Write about {t}.",))
    monkeypatch.setattr(pr, "_TOPICS", ("TCP handshakes", "Lighthouse keepers", "owls"))
    assert pr.chat_prompts(10) == ["Write about owls."]


def test_a_header_of_exactly_forty_characters_is_a_prompt(tmp_path: Path) -> None:
    """The length bounds are inclusive: 40 characters (header + docstring + newline) is kept, 39 is not."""
    forty = 'def f():\n    """' + "a" * 20 + '"""\n'
    thirty_nine = 'def g():\n    """' + "b" * 19 + '"""\n'
    assert len(forty) == 40 and len(thirty_nine) == 39
    (tmp_path / "lib.py").write_text(forty + "    return 1\n\n\n" + thirty_nine + "    return 2\n")
    assert code_prompts(5, root=tmp_path) == [forty]


def test_the_chat_share_is_rounded_not_truncated(tiny_target) -> None:
    """10 sequences at chat_share 0.66 plan round(6.6) = 7 chats, not int(6.6) = 6."""
    kinds = [k for _, k, _, _ in plan(DataConfig(sequences=10, chat_share=0.66), tiny_target.tokenizer)]
    assert kinds.count("chat") == 7 and kinds.count("code") == 3


def _shard(path: Path, kind: str) -> None:
    Shard(tokens=[torch.tensor([1, 2], dtype=torch.int32)], prompt_len=[1], temperature=[0.0], kind=[kind]).save(path)


def test_shards_are_read_in_name_order_whatever_order_the_folder_lists(tmp_path: Path, monkeypatch) -> None:
    """load_shards concatenates shard-00000, shard-00001, ... in that order (the held-out split and a
    resume depend on it), even where the file system lists them otherwise (here: reversed)."""
    for i in range(3):
        _shard(tmp_path / f"shard-{i:05d}.pt", f"k{i}")
    real = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(sorted(real(self, pattern), reverse=True)))
    assert load_shards(tmp_path).kind == ["k0", "k1", "k2"]


class _RunsCode:
    def __reduce__(self):  # unpickling calls os.getpid(): a file that runs code when loaded
        return (os.getpid, ())


def test_a_shard_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """Shards are read weights-only: a file with the right keys but a pickled callable inside is a
    ConfigError, not loaded (and the callable not run)."""
    torch.save({"tokens": [], "prompt_len": [], "temperature": [], "kind": [], "feats": [], "x": _RunsCode()},
               tmp_path / "shard-00000.pt")
    with pytest.raises(ConfigError, match="is not a shard written by"):
        load_shards(tmp_path)


def test_code_prompts_do_not_depend_on_the_order_the_folder_lists(tmp_path: Path, monkeypatch) -> None:
    """The seed alone decides the code prompts: the library's files are sorted before the seeded
    shuffle, so a file system that lists them in another order (here: reversed) gives the same prompts."""
    body = '    """Return {} of the thing given, with a docstring long enough to be a prompt."""\n    return x\n'
    for i in range(6):
        (tmp_path / f"mod{i}.py").write_text(f"def func_{i}(x):\n" + body.format(i))
    want = code_prompts(2, root=tmp_path, seed=5)
    real = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(sorted(real(self, pattern), reverse=True)))
    assert code_prompts(2, root=tmp_path, seed=5) == want


def test_code_prompts_are_plain_functions_like_the_benchmarks(tmp_path: Path) -> None:
    """Code prompts have the benchmark's shape, a plain ``def``: an ``async def`` is not one."""
    body = '    """Return the thing given, with a docstring long enough to be a prompt."""\n    return x\n\n\n'
    (tmp_path / "lib.py").write_text("async def fetch_it(x):\n" + body + "def keep_me(x):\n" + body)
    got = code_prompts(5, root=tmp_path)
    assert [ast.parse(t + "    pass\n").body[-1].name for t in got] == ["keep_me"]


def test_a_resumed_run_does_not_repeat_the_samples_already_on_disk(tiny_target, tmp_path: Path) -> None:
    """The sampler's generator is seeded with the resume point too: with one prompt at T = 1 (4
    sequences x 4 tokens, shards of 2), the sequences regenerated after shard 1 was lost are not
    copies of shard 0's (the same seed restarted would draw them again, token for token)."""
    lm = tiny_target
    prompt = tmp_path / "one.jsonl"
    prompt.write_text('{"prompt": "Tell me about rivers.", "chat": true}\n')
    cfg = DataConfig(sequences=4, batch=2, shard_size=2, max_new_chat=4, temperatures=(1.0,), features=False,
                     prompt_file=str(prompt))
    out = tmp_path / "data"
    generate(cfg, lm.model, lm.tokenizer, frozenset(), out)
    (out / "shard-00001.pt").unlink()
    generate(cfg, lm.model, lm.tokenizer, frozenset(), out)
    tokens = [t.tolist() for t in load_shards(out).tokens]
    assert len(tokens) == 4 and tokens[2:] != tokens[:2]


def test_tokens_are_stored_as_int32(tiny_target, tmp_path: Path) -> None:
    """A shard's token tensors are int32 on disk (4 bytes a token, as Shard documents), not int64."""
    lm = tiny_target
    cfg = DataConfig(sequences=1, batch=1, shard_size=1, max_new_chat=2, max_new_code=2, features=False)
    generate(cfg, lm.model, lm.tokenizer, frozenset(), tmp_path / "d")
    assert load_shards(tmp_path / "d").tokens[0].dtype == torch.int32


@pytest.mark.parametrize("decorators", ["@functools.cache\n", "@functools.lru_cache(\n    maxsize=None,\n)\n",
                                        "@functools.cache\n# a comment between\n@staticmethod\n"],
                         ids=["one_line", "over_lines", "comment_between"])
def test_a_decorated_functions_prompt_keeps_its_decorators_whole(tmp_path: Path, decorators: str) -> None:
    """A code prompt is the whole header: every decorator from its first line, the ``def`` line and
    the docstring. A decorator written over several lines (or a comment among them) was once cut,
    one line per decorator assumed, leaving a prompt that began with ``)`` and was not Python."""
    (tmp_path / "lib.py").write_text(
        f"import functools\n\n\n{decorators}def cached_value(x):\n"
        '    """Return the cached value for x, with a docstring long enough to be a prompt."""\n    return x\n')
    [text] = code_prompts(5, root=tmp_path)
    assert text.startswith(f"{decorators}def cached_value(x):\n")
    assert isinstance(ast.parse(text + "    pass\n").body[-1], ast.FunctionDef)


def test_methods_and_nested_functions_are_not_code_prompts(tmp_path: Path) -> None:
    """Only top-level functions are prompts (the benchmark's shape): a method's or a nested
    function's header is indented and would not parse on its own."""
    doc = '"""Return the thing given, with a docstring long enough to be a prompt."""'
    (tmp_path / "lib.py").write_text(
        f"class Box:\n    def method(self, x):\n        {doc}\n        return x\n\n\n"
        f"def outer(x):\n    {doc}\n\n    def inner(y):\n        {doc}\n        return y\n    return inner(x)\n")
    got = code_prompts(5, root=tmp_path)
    assert got == [f"def outer(x):\n    {doc}\n"]


def test_a_header_of_exactly_1200_characters_is_a_prompt(tmp_path: Path) -> None:
    """The upper length bound is inclusive too: 1200 characters is kept, 1201 is not."""
    def header(name: str, n: int) -> str:
        start = f'def {name}():\n    """'
        return start + "a" * (n - len(start) - 4) + '"""\n'

    keep, drop = header("f", 1200), header("g", 1201)
    assert len(keep) == 1200 and len(drop) == 1201
    (tmp_path / "lib.py").write_text(keep + "    return 1\n\n\n" + drop + "    return 2\n")
    assert code_prompts(5, root=tmp_path) == [keep]


def test_a_draft_sampled_folder_is_not_resumed_as_target_sampled(tiny_target, tmp_path: Path) -> None:
    """The sampler setting a folder recorded is compared like any other: sequences the draft
    sampled (on-policy) are not resumed by a target-sampled run (only a folder that lacks the
    setting counts as target-sampled)."""
    lm = tiny_target
    out = tmp_path / "data"
    cfg = DataConfig(sequences=4, batch=2, shard_size=2, max_new_chat=2, max_new_code=2, features=False,
                     sampler="some-draft")
    generate(cfg, lm.model, lm.tokenizer, frozenset(), out)
    (out / "shard-00001.pt").unlink()
    with pytest.raises(ConfigError, match=r"other settings \(sampler\)"):
        generate(DataConfig(**{**cfg.__dict__, "sampler": "target"}), lm.model, lm.tokenizer, frozenset(), out)


def test_code_prompts_are_a_seeded_sample_not_a_files_first_functions(tmp_path: Path) -> None:
    """The functions found are shuffled by the seed before n are taken: from one file of 12
    functions, 3 prompts are not always its first three (seeds 0-4 reach more than 3 functions)."""
    body = '    """Return {} of the thing given, with a docstring long enough to be a prompt."""\n    return x\n\n\n'
    (tmp_path / "lib.py").write_text("".join(f"def func_{i}(x):\n" + body.format(i) for i in range(12)))
    seen = {t for seed in range(5) for t in code_prompts(3, root=tmp_path, seed=seed)}
    assert len(seen) > 3
    assert code_prompts(3, root=tmp_path, seed=2) == code_prompts(3, root=tmp_path, seed=2)


def test_a_folder_whose_config_lacks_a_setting_other_than_the_sampler_is_refused(tiny_target, tmp_path: Path) -> None:
    """Only ``sampler`` has a default for folders that predate it: any other setting missing from
    config.json (a file cut down or of another tool) is a difference, named, not resumed in silence."""
    lm = tiny_target
    out = tmp_path / "data"
    cfg = DataConfig(sequences=4, batch=2, shard_size=2, max_new_chat=2, max_new_code=2, features=False)
    generate(cfg, lm.model, lm.tokenizer, frozenset(), out)
    old = json.loads((out / "config.json").read_text())
    del old["taps"]
    (out / "config.json").write_text(json.dumps(old))
    with pytest.raises(ConfigError, match=r"other settings \(taps\)"):
        generate(cfg, lm.model, lm.tokenizer, frozenset(), out)
