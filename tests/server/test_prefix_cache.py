"""Prefix caching: a prefill that copies a stored prompt's keys/values is bitwise a fresh prefill.

The reference for every check is the same model prefilling the whole prompt itself; equality is
``torch.equal`` on logits and on the cache buffers, not a tolerance.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from specdec.models.toy import ToyLM
from specdec.server import ServerSettings, create_app
from specdec.server import prefix_cache as pc_mod
from specdec.server.prefix_cache import (
    SEEN_BLOCK,
    PrefixCache,
    PrefixCached,
    block_hashes,
    common_prefix,
    draft_prefix_cache,
    prefill,
    supports_prefix_cache,
)
from specdec.server.scheduler import BatchedModel, Scheduler
from specdec.server.sessions import SerializedModel
from tiny import tiny_native

VOCAB = 64


def _prompt(seed: int, n: int) -> torch.Tensor:  # [n] int64
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _fresh(model, tokens: torch.Tensor, steps: list[int]):
    """(prefill logits, decode logits, cache) of the model alone, no prefix cache."""
    cache = model.new_cache(512)
    first = model.forward(tokens, cache, last_only=True)
    after = [model.forward(torch.tensor([t]), cache) for t in steps]
    return first, after, cache


def _same_cache(a, b) -> bool:
    n = a.length
    return n == b.length and torch.equal(a.k[:, :, :n], b.k[:, :, :n]) and torch.equal(a.v[:, :, :n], b.v[:, :, :n])


def _prompts() -> dict[str, torch.Tensor]:
    a = _prompt(1, 40)
    return {
        "a": a,
        "a again": a.clone(),  # all but its last token reused
        "shares 25": torch.cat([a[:25], _prompt(2, 30)]),  # a common system message, then its own text
        "extends a": torch.cat([a, _prompt(3, 20)]),  # the next turn of a chat
        "unrelated": _prompt(4, 33),
    }


@pytest.mark.parametrize("wrapper", ["serialized", "batched", "plain"])
def test_prefills_from_the_prefix_cache_are_bitwise_fresh_prefills(wrapper):
    """The server's two wrappers, and ``PrefixCached`` (one process, prompt after prompt: the
    interactive chat's)."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(64 << 20)
    served = {"serialized": lambda: SerializedModel(model, threading.Lock(), prefix_cache=pc),
              "batched": lambda: BatchedModel(model, Scheduler(model), prefix_cache=pc),
              "plain": lambda: PrefixCached(model, pc)}[wrapper]()
    # a prompt's blocks seen before are stored: "a" is seen, "a again" stores its two whole 16-token blocks
    expected_reuse = {"a": 0, "a again": 0, "shares 25": 25, "extends a": 32, "unrelated": 0}
    for name, tokens in _prompts().items():
        before = pc.reused_tokens
        cache = served.new_cache(512)
        first = served.forward(tokens, cache, last_only=True)
        steps = [5, 9, 17]
        after = [served.forward(torch.tensor([t]), cache) for t in steps]
        ref_first, ref_after, ref_cache = _fresh(model, tokens, steps)
        assert pc.reused_tokens - before == expected_reuse[name], name
        assert torch.equal(first, ref_first), name
        assert all(torch.equal(x, y) for x, y in zip(after, ref_after)), name
        assert _same_cache(cache, ref_cache), name


def test_concurrent_prefills_through_the_scheduler_stay_exact():
    """Eight threads prefill overlapping prompts at once, twice (stores and reuses interleave)."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(64 << 20)
    served = BatchedModel(model, Scheduler(model), prefix_cache=pc)
    base = _prompt(7, 30)
    prompts = [torch.cat([base[: 16 + 2 * i], _prompt(10 + i, 10 + i)]) for i in range(8)] * 2
    results: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        cache = served.new_cache(512)
        results[i] = served.forward(prompts[i], cache, last_only=True)
        results[i] = torch.cat([results[i], served.forward(torch.tensor([3]), cache)])

    for wave in (range(8), range(8, 16)):  # the second wave finds what the first one stored
        threads = [threading.Thread(target=run, args=(i,)) for i in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, tokens in enumerate(prompts):
        first, after, _ = _fresh(model, tokens, [3])
        assert torch.equal(results[i], torch.cat([first, after[0]])), i
    assert pc.hits >= 8  # the second wave found the first one's prompts


def test_only_prefixes_seen_before_are_stored_and_the_byte_budget_holds():
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(100 * per_position)
    served = SerializedModel(model, threading.Lock(), prefix_cache=pc)

    def twice(tokens: torch.Tensor) -> None:
        for _ in range(2):
            served.forward(tokens, served.new_cache(512), last_only=True)

    ax = torch.cat([_prompt(1, 40), _prompt(2, 10)])
    served.forward(ax, served.new_cache(512), last_only=True)
    assert len(pc) == 0  # seen once: nothing stored (distinct prompts do not churn the cache)
    served.forward(ax, served.new_cache(512), last_only=True)
    assert len(pc) == 1 and pc.bytes == 48 * per_position  # seen twice: its three whole blocks
    twice(ax[:40])  # inside the stored prompt: reused, nothing new
    assert len(pc) == 1 and pc.reused_tokens == 39 + 39
    twice(torch.cat([ax, _prompt(3, 20)]))  # extends it: replaces it once its fourth block is seen twice
    assert len(pc) == 1 and pc.bytes == 64 * per_position
    twice(_prompt(4, 45))
    assert len(pc) == 2 and pc.bytes == 96 * per_position
    twice(_prompt(5, 45))  # 128 > 100 positions: the least recently used entry goes
    assert len(pc) == 2 and pc.bytes == 64 * per_position
    twice(_prompt(6, 200))  # larger than the whole budget: not stored
    assert pc.bytes <= 100 * per_position and len(pc) == 2
    assert common_prefix(_prompt(3, 45), _prompt(3, 45)) == 45 and common_prefix(ax, ax[:7]) == 7


def test_short_prompts_and_full_forwards_bypass_the_cache():
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(64 << 20)
    served = SerializedModel(model, threading.Lock(), prefix_cache=pc)
    served.forward(_prompt(1, 8), served.new_cache(512), last_only=True)  # shorter than MIN_TOKENS
    out = served.forward(_prompt(1, 40), served.new_cache(512))  # every row's logits wanted: runs all of it
    assert out.shape[0] == 40 and len(pc) == 0 and pc.lookups == 0


def test_only_batch_invariant_models_get_a_prefix_cache():
    fast = tiny_native(vocab=VOCAB)
    fast.batch_invariant = False
    assert supports_prefix_cache(tiny_native(vocab=VOCAB)) and not supports_prefix_cache(fast)
    assert not supports_prefix_cache(ToyLM(6, order=1, seed=0))
    with pytest.raises(ValueError, match="batch-invariant"):
        SerializedModel(fast, threading.Lock(), prefix_cache=PrefixCache(1 << 20))
    app = create_app(fast, settings=ServerSettings())
    assert app.state.ctx.model.prefix_cache is None


@pytest.mark.parametrize("batching", [True, False])
def test_sessions_on_a_server_give_the_same_verdicts_with_and_without_the_prefix_cache(batching):
    prompt = [int(t) for t in _prompt(9, 48)]
    verdicts = {}
    for size in (64 << 20, 0):
        app = create_app(tiny_native(vocab=VOCAB), settings=ServerSettings(batching=batching, prefix_cache_bytes=size))
        client = TestClient(app, base_url="http://localhost")
        got = []
        for turn in range(3):  # the same prompt three times, then a longer one sharing it
            ids = prompt if turn < 2 else prompt + [7, 8, 9]
            r = client.post("/v1/sessions", json={"prompt_ids": ids, "temperature": 0.0})
            assert r.status_code == 201, r.text
            sid = r.json()["session_id"]
            for seq in range(3):
                v = client.post(f"/v1/sessions/{sid}/verify", json={"seq": seq, "draft_tokens": [1, 2, 3]})
                assert v.status_code == 200, v.text
                got.append(v.json()["tokens"])
        metrics = client.get("/metrics").text
        reused = [line for line in metrics.splitlines() if line.startswith("specdec_prefix_cache_reused_tokens_total")]
        verdicts[size] = got
        if size:
            # the prefill runs prompt[:-1] (47 tokens); the second session stores its two whole
            # 16-token blocks, which the third one reuses
            assert reused and float(reused[0].split()[-1]) == 32
        else:
            assert app.state.ctx.model.prefix_cache is None
    assert verdicts[64 << 20] == verdicts[0]


@pytest.mark.parametrize("how", ["plain", "greedy chain", "sampled chain", "greedy tree", "sampled tree"])
def test_a_finished_sequence_is_kept_and_the_next_turn_prefills_bitwise_fresh(how):
    """``PrefixCached`` keeps a finished sequence's rows, reply included (``TargetSession.close``):
    rows written by one-row steps, verification passes and compacted tree passes.  The next turn —
    the whole sequence and new text — copies all of them and its logits and cache are bitwise a
    fresh prefill's."""
    from specdec.decoder import SpeculativeDecoder
    from specdec.drafters import ModelDrafter
    from specdec.drafters.tree_builder import TreeSpec
    from specdec.gamma import FixedGamma
    from specdec.sampling import SamplingConfig
    from specdec.verify import get_rule

    target = tiny_native(vocab=VOCAB)
    pc = PrefixCache(64 << 20)
    greedy = how.startswith("greedy") or how == "plain"
    drafter = None if how == "plain" else ModelDrafter(tiny_native(vocab=VOCAB, seed=1))
    dec = SpeculativeDecoder(PrefixCached(target, pc), drafter, get_rule("greedy" if greedy else "token"),
                             gamma=FixedGamma(4), tree=TreeSpec(min_prob=0.0) if how.endswith("tree") else None)
    prompt = _prompt(11, 30)
    out = dec.generate(prompt, SamplingConfig(temperature=0.0 if greedy else 1.0, max_new_tokens=40, seed=5))
    reply = torch.tensor(out.tokens)  # [40]: the tiny model emits no end-of-sequence token
    assert reply.numel() == 40
    assert out.stats.target_calls < 40 if drafter is not None else out.stats.target_calls == 40
    if how.endswith("tree"):
        assert out.stats.tree_rounds > 0
    # one entry: the prompt and every committed token but the last (no pass has fed it yet)
    assert len(pc) == 1 and pc.bytes == (30 + 40 - 1) * target.new_cache(1).bytes_per_position
    turn = torch.cat([prompt, reply, _prompt(12, 9)])  # [79]: the next turn re-sends the conversation
    cache = PrefixCached(target, pc).new_cache(512)
    first = PrefixCached(target, pc).forward(turn, cache, last_only=True)
    after = target.forward(torch.tensor([3]), cache)
    ref_first, ref_after, ref_cache = _fresh(target, turn, [3])
    assert pc.reused_tokens == 69
    assert torch.equal(first, ref_first) and torch.equal(after, ref_after[0]) and _same_cache(cache, ref_cache)


@pytest.mark.parametrize("how", ["greedy chain", "sampled chain", "sampled tree", "lookup+model"])
def test_a_draft_behind_a_prefix_cache_keeps_its_rows_and_changes_nothing(how):
    """The draft model behind its own prefix cache (``ModelDrafter.finish`` keeps its rows of the
    committed tokens): the next turn's draft prefill copies them, its cache is bitwise a fresh
    prefill's, and the tokens — at T = 1 under the token rule, which depend on every draft
    proposal and probability — equal decoding that turn with no cache anywhere."""
    from specdec.decoder import SpeculativeDecoder
    from specdec.drafters import ModelDrafter
    from specdec.drafters.hybrid import LookupThenModel
    from specdec.drafters.tree_builder import TreeSpec
    from specdec.gamma import FixedGamma
    from specdec.sampling import SamplingConfig
    from specdec.verify import get_rule

    target, draft = tiny_native(vocab=VOCAB), tiny_native(vocab=VOCAB, seed=1)
    greedy = how.startswith("greedy")
    cfg = SamplingConfig(temperature=0.0 if greedy else 1.0, max_new_tokens=30, seed=5)

    def decoder(cached: bool) -> tuple[SpeculativeDecoder, PrefixCache | None]:
        pcd = PrefixCache(64 << 20) if cached else None
        dm = PrefixCached(draft, pcd) if cached else draft
        # a fixed lookup length: one chosen by measured cost would make the two decodings' rounds,
        # and so their T = 1 tokens, depend on the machine's timings
        drafter = LookupThenModel(ModelDrafter(dm), lookup_tokens=4) if how == "lookup+model" else ModelDrafter(dm)
        tgt = PrefixCached(target, PrefixCache(64 << 20)) if cached else target
        return SpeculativeDecoder(tgt, drafter, get_rule("greedy" if greedy else "token"), gamma=FixedGamma(4),
                                  tree=TreeSpec(min_prob=0.0) if how.endswith("tree") else None), pcd

    dec, pcd = decoder(True)
    prompt = torch.cat([_prompt(13, 20), _prompt(13, 20)])  # repeats itself: prompt lookup finds drafts
    first = dec.generate(prompt, cfg)
    assert len(pcd) == 1
    kept = pcd._entries[next(iter(pcd._entries))].tokens.numel()
    assert 39 <= kept <= 40 + 30 - 1
    turn = torch.cat([prompt, torch.tensor(first.tokens), _prompt(14, 9)])
    second = dec.generate(turn, cfg)
    assert pcd.reused_tokens == kept  # the draft's prefill of the next turn copied every kept row
    plain, _ = decoder(False)
    assert second.tokens == plain.generate(turn, cfg).tokens
    if how.endswith("tree"):
        assert first.stats.tree_rounds > 0
    ref = draft.new_cache(512)
    draft.forward(turn[:-1], ref, last_only=True)
    got = draft.new_cache(512)
    PrefixCached(draft, pcd).forward(turn[:-1], got, last_only=True)
    assert _same_cache(got, ref)


def _filled(model, tokens: torch.Tensor):
    cache = model.new_cache(512)
    model.forward(tokens, cache)
    return cache


def test_keep_replaces_what_it_extends_and_respects_the_budget():
    """A kept sequence is unproven (it may never come back) until a prefill copies from it; unproven
    entries hold at most half of the budget, dropped least recently used first; a kept sequence
    that extends a proven entry (a conversation's next turn) is proven."""
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(100 * per_position)  # unproven entries: at most 50 positions
    seq, other, long = _prompt(1, 90), _prompt(2, 90), _prompt(3, 120)
    cache, other_cache = _filled(model, seq), _filled(model, other)
    pc.keep(seq[:40], cache)  # kept at once, never seen before
    assert len(pc) == 1 and pc.bytes == pc.unproven_bytes == 40 * per_position
    pc.keep(seq[:45], cache)  # extends it: replaces it
    assert len(pc) == 1 and pc.bytes == pc.unproven_bytes == 45 * per_position
    pc.keep(seq[:30], cache)  # inside what is stored: nothing new
    assert len(pc) == 1 and pc.bytes == 45 * per_position
    pc.keep(other[:30], other_cache)  # 75 unproven positions > 50: the older unproven one goes
    assert len(pc) == 1 and pc.bytes == pc.unproven_bytes == 30 * per_position
    assert pc.restore(other[:50], model.new_cache(64)) == 30  # the next turn copies it: proven
    assert pc.unproven_bytes == 0
    pc.keep(other[:70], other_cache)  # that turn finishes: extends a proven entry, so proven
    assert len(pc) == 1 and pc.bytes == 70 * per_position and pc.unproven_bytes == 0
    pc.keep(seq[:20], cache)  # a new conversation beside it: 90 positions in all
    pc.keep(long[:25], _filled(model, long))  # 45 unproven positions: both stay
    # 115 > 100 positions: the least recently used entry went, proven or not (a conversation left idle)
    assert pc.restore(other[:80], model.new_cache(64)) == 0
    assert len(pc) == 2 and pc.bytes == pc.unproven_bytes == 45 * per_position
    pc.keep(long[:60], _filled(model, long))  # an unproven sequence larger than its share: not kept
    assert pc.bytes == 45 * per_position
    pc.keep(seq[:8], cache)  # shorter than MIN_TOKENS: not kept
    assert len(pc) == 2


def test_a_flood_of_one_shot_sequences_never_evicts_what_was_reused():
    """200 distinct finished requests (kept, never re-sent) against a shared system prompt stored
    because two prompts began with it: the shared prefix stays and every later prompt copies it."""
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(200 * per_position)
    served = SerializedModel(model, threading.Lock(), prefix_cache=pc)
    system = _prompt(20, 48)
    for i in range(2):  # seen twice: its three whole blocks are stored
        served.forward(torch.cat([system, _prompt(100 + i, 10)]), served.new_cache(512), last_only=True)
    assert len(pc) == 1 and pc.unproven_bytes == 0
    for i in range(200):
        seq = torch.cat([_prompt(300 + i, 40), _prompt(600 + i, 20)])  # one-shot prompt + its "reply"
        pc.keep(seq, _filled(model, seq))
        assert pc.unproven_bytes <= 100 * per_position and pc.bytes <= 200 * per_position
    before = pc.reused_tokens
    served.forward(torch.cat([system, _prompt(999, 10)]), served.new_cache(512), last_only=True)
    assert pc.reused_tokens - before == 48


def test_a_kept_sequence_that_only_shares_a_system_prompt_stays_unproven():
    """One-shot chats behind a common system prompt: each next prompt copies the shared part from
    a kept sequence (less than half of it), which leaves that sequence unproven, so one-shot
    sequences never hold more than their share however many share the prompt; a next turn, which
    copies most of its kept sequence, proves it."""
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(400 * per_position)  # unproven: at most 200 positions
    system = _prompt(21, 20)
    for i in range(30):
        seq = torch.cat([system, _prompt(400 + i, 40)])  # [60]: the system prompt, a question, its "reply"
        if i:
            assert pc.restore(torch.cat([system, _prompt(700 + i, 5)]), model.new_cache(64)) == 20  # the system part
        pc.keep(seq, _filled(model, seq))
        assert pc.unproven_bytes == pc.bytes <= 200 * per_position
    turn = torch.cat([system, _prompt(429, 40), _prompt(800, 6)])  # the last chat's next turn
    assert pc.restore(turn, model.new_cache(128)) == 60 and pc.unproven_bytes == pc.bytes - 60 * per_position


@pytest.mark.parametrize("batching", [True, False])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 4}])
def test_a_server_keeps_finished_requests_for_the_next_turn(batching, sampling):
    """OpenAI completions on a server: four prompts side by side (their passes batched), then each
    one's next turn — prompt, reply and new text.  Each next turn copies every position of its last
    turn but the final token (the draft's prefills copy too, from their own cache), and every text
    equals a server without a prefix cache."""
    from specdec.drafters import ModelDrafter
    from specdec.server.command import served_draft
    from toy_server import LetterTokenizer

    model, draft = tiny_native(vocab=26), tiny_native(vocab=26, seed=1)
    prompts = ["thequickbrownfoxjumps", "overthelazydogagainandagain", "packmyboxwithfivedozen", "liquorjugsnowplease"]

    def run(size: int) -> tuple[list[str], list[str], int]:
        served = served_draft(draft, model, batching=batching, prefix_cache_bytes=size)  # its own prefix cache
        app = create_app(model, tokenizer=LetterTokenizer(), drafter_factory=lambda: ModelDrafter(served), drafter_name="tiny",
                         draft_model=served, settings=ServerSettings(batching=batching, prefix_cache_bytes=size, max_active_requests=8))
        client = TestClient(app, base_url="http://localhost")

        def texts(ps: list[str]) -> tuple[list[str], int]:
            r = client.post("/v1/completions", json={"prompt": ps, "max_tokens": 12, **sampling})
            assert r.status_code == 200, r.text
            return [c["text"] for c in r.json()["choices"]], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        first, _ = texts(prompts)
        pc = app.state.ctx.model.prefix_cache
        before = pc.reused_tokens if pc is not None else 0
        draft_before = served.prefix_cache.reused_tokens if pc is not None else 0
        second, cached = texts([p + t + "xyz" for p, t in zip(prompts, first)])
        assert cached == ((pc.reused_tokens - before) if pc is not None else 0)  # reported to the client
        if pc is not None:  # the draft's prefills copied at least each prompt's rows too
            assert served.prefix_cache.reused_tokens - draft_before >= sum(len(p) for p in prompts)
        else:
            assert served.prefix_cache is None
        return first, second, cached

    first, second, reused = run(64 << 20)
    assert all(len(t) == 12 for t in first)
    assert reused == sum(len(p) + 12 - 1 for p in prompts)
    assert (first, second, 0) == run(0)


@pytest.mark.parametrize("batching", [True, False])
@pytest.mark.parametrize("end", ["delete", "ttl"])
@pytest.mark.parametrize("wire", [{"temperature": 0.0, "wire": "greedy"}, {"temperature": 1.0, "seed": 7, "wire": "sparse-q"}])
def test_an_ended_edge_session_is_kept_for_the_edges_next_sequence(batching, end, wire):
    """An edge session of four verification rounds ends (its edge deletes it, or it idles past the
    TTL); the edge's next sequence starts with everything it committed (a chat's next turn).  Its
    prefill copies every committed position but the last (reported in the create response), and
    every round's verdict equals a server without a prefix cache."""
    model = tiny_native(vocab=VOCAB)
    prompt = _prompt(31, 30).tolist()
    drafts = [[5, 9, 2], [7, 7], [1, 30, 12, 4], [3]]

    def q(tokens: list[int]) -> dict:
        if wire["wire"] == "greedy":
            return {}
        return {"q": [{"ids": [t, (t + 1) % VOCAB], "probs": [0.75, 0.25]} for t in tokens]}

    def run(size: int) -> tuple[list[dict], int]:
        app = create_app(model, settings=ServerSettings(batching=batching, prefix_cache_bytes=size))
        client = TestClient(app, base_url="http://localhost")
        store = app.state.ctx.store

        def session(ids: list[int]) -> tuple[str, int, list[dict]]:
            r = client.post("/v1/sessions", json={"prompt_ids": ids, **wire})
            assert r.status_code == 201, r.text
            sid = r.json()["session_id"]
            rounds = []
            for seq, tokens in enumerate(drafts):
                v = client.post(f"/v1/sessions/{sid}/verify", json={"seq": seq, "draft_tokens": tokens, **q(tokens)})
                assert v.status_code == 200, v.text
                rounds.append({k: v.json()[k] for k in ("num_accepted", "tokens", "next_token")})
            return sid, r.json()["cached_prompt_tokens"], rounds

        sid, cached, first = session(prompt)
        assert cached == 0
        if end == "delete":
            assert client.delete(f"/v1/sessions/{sid}").status_code == 200
        else:
            store.get(sid).last_used -= 2 * app.state.ctx.settings.session_ttl_s
            assert store.sweep() == 1
        assert len(store) == 0
        committed = [t for r in first for t in r["tokens"]]
        _, cached, second = session(prompt + committed + [4, 8, 15])
        return first + second, cached

    rounds, cached = run(64 << 20)
    assert cached == len(prompt) + sum(len(r["tokens"]) for r in rounds[:4]) - 1
    assert (rounds, 0) == run(0)


def _served(max_positions: int):
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(max_positions * per_position)
    return model, per_position, pc, SerializedModel(model, threading.Lock(), prefix_cache=pc)


def test_a_prompt_of_whole_blocks_is_stored_whole():
    """A prompt whose length is a multiple of SEEN_BLOCK: its last block is a whole block too."""
    assert len(block_hashes(torch.arange(3 * SEEN_BLOCK))) == 3
    assert len(block_hashes(torch.arange(3 * SEEN_BLOCK - 1))) == 2
    model, per_position, pc, served = _served(200)
    prompt = _prompt(1, 3 * SEEN_BLOCK)
    for _ in range(2):
        served.forward(prompt, served.new_cache(512), last_only=True)
    assert len(pc) == 1 and pc.bytes == 3 * SEEN_BLOCK * per_position
    assert pc.restore(torch.cat([prompt, _prompt(2, 5)]), model.new_cache(128)) == 3 * SEEN_BLOCK


def test_copying_exactly_half_of_a_kept_sequence_proves_it():
    model, per_position, pc, _ = _served(400)
    seq = _prompt(1, 60)
    pc.keep(seq, _filled(model, seq))
    assert pc.unproven_bytes == 60 * per_position
    assert pc.restore(torch.cat([seq[:29], _prompt(2, 10)]), model.new_cache(64)) == 29  # under half: still unproven
    assert pc.unproven_bytes == 60 * per_position
    assert pc.restore(torch.cat([seq[:30], _prompt(3, 10)]), model.new_cache(64)) == 30  # half: a next turn
    assert pc.unproven_bytes == 0


def test_a_prefill_that_copied_from_an_entry_makes_it_the_most_recently_used():
    model, per_position, pc, served = _served(100)
    a, b, c = _prompt(1, 48), _prompt(2, 48), _prompt(3, 48)
    for prompt in (a, b):
        for _ in range(2):  # seen twice: stored
            served.forward(prompt, served.new_cache(512), last_only=True)
    assert len(pc) == 2
    assert pc.restore(torch.cat([a, _prompt(4, 5)]), model.new_cache(64)) == 48  # a is used again
    for _ in range(2):  # 144 > 100 positions: the least recently used entry (b) goes
        served.forward(c, served.new_cache(512), last_only=True)
    assert len(pc) == 2
    assert pc.restore(torch.cat([a, _prompt(5, 5)]), model.new_cache(64)) == 48
    assert pc.restore(torch.cat([b, _prompt(6, 5)]), model.new_cache(64)) == 0


def test_a_prefill_that_fails_after_copying_leaves_the_cache_empty():
    """A pass that fails (e.g. its request was cancelled) after the stored rows were copied: the
    cache is as it was, empty and with no rows counted as copied, so a retry on it prefills from
    scratch, bitwise as a fresh one."""
    model, _, pc, _ = _served(200)
    prompt = _prompt(1, 40)
    pc.keep(prompt, _filled(model, prompt))

    def failing(tokens, cache, *, last_only):
        raise RuntimeError("cancelled")

    cache = model.new_cache(512)
    with pytest.raises(RuntimeError, match="cancelled"):
        prefill(failing, pc, prompt, cache, True)
    # nothing copied is held any more, nor counted: ``restored`` is what a session reports as
    # cached tokens, and once stayed at 39 for a retry that copied nothing
    assert cache.length == 0 and cache.restored == 0
    logits = prefill(model.forward, pc, prompt, cache, True)  # the retry: copies 39 rows, runs the last
    first, _, fresh = _fresh(model, prompt, [])
    assert torch.equal(logits, first) and _same_cache(cache, fresh)


def test_cached_tokens_count_each_prompt_once_with_n_choices():
    from specdec.drafters import ModelDrafter
    from specdec.server.command import served_draft
    from toy_server import LetterTokenizer

    model, draft = tiny_native(vocab=26), tiny_native(vocab=26, seed=1)
    served = served_draft(draft, model, batching=False, prefix_cache_bytes=64 << 20)
    app = create_app(model, tokenizer=LetterTokenizer(), drafter_factory=lambda: ModelDrafter(served), drafter_name="tiny",
                     draft_model=served, settings=ServerSettings(batching=False, prefix_cache_bytes=64 << 20, max_active_requests=8))
    client = TestClient(app, base_url="http://localhost")
    prompt = "thequickbrownfoxjumpsoverthelazydog"
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert first.status_code == 200, first.text
    again = prompt + first.json()["choices"][0]["text"] + "xyz"
    r = client.post("/v1/completions", json={"prompt": again, "max_tokens": 4, "temperature": 1.0, "seed": 3, "n": 3})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(again)
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]


def test_seen_blocks_are_forgotten_least_recently_seen_first(monkeypatch):
    """With room for 4 remembered blocks: A (2 blocks) and B (2 blocks) seen, A seen again (stored,
    and now the most recently seen), then C: B's blocks are the ones forgotten, so C seen again is
    stored and B seen again is not."""
    monkeypatch.setattr(pc_mod, "SEEN_BLOCKS", 4)
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30)
    a, b, c = (_prompt(s, 2 * SEEN_BLOCK) for s in (1, 2, 3))
    caches = {id(t): _filled(model, t) for t in (a, b, c)}
    for t in (a, b, a, c):
        pc.store(t, caches[id(t)])
    assert len(pc) == 1  # A (seen twice)
    pc.store(c, caches[id(c)])  # C's blocks are remembered: stored
    assert len(pc) == 2
    pc.store(b, caches[id(b)])  # B's were forgotten (least recently seen): not stored
    assert len(pc) == 2


def test_stored_rows_do_not_follow_later_writes_to_the_cache():
    """A kept sequence's rows are a copy: the cache it came from, reused for another prompt, leaves
    them as they were, so the next turn still prefills bitwise as a fresh one."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30)
    seq, other = _prompt(1, 40), _prompt(2, 40)
    cache = _filled(model, seq)
    pc.keep(seq, cache)
    cache.truncate(0)
    model.forward(other, cache)  # the same buffers now hold another sequence's rows
    turn = torch.cat([seq, _prompt(3, 5)])
    got = model.new_cache(512)
    assert pc.restore(turn, got) == 40
    model.forward(turn[40:], got, last_only=True)
    _, _, fresh = _fresh(model, turn, [])
    assert _same_cache(got, fresh)


class _Racing:
    """A cache whose rows, when the store copies them, are first stored by "another thread"."""

    def __init__(self, pc: PrefixCache, tokens: torch.Tensor, cache) -> None:
        self._pc, self._tokens, self._cache, self._raced = pc, tokens, cache, False
        self.bytes_per_position = cache.bytes_per_position
        self.v = cache.v

    @property
    def k(self):
        if not self._raced:
            self._raced = True
            self._pc.store(self._tokens, self._cache)
        return self._cache.k


def test_a_prompt_another_thread_stored_meanwhile_is_not_stored_twice():
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(1 << 30)
    prompt = _prompt(1, 48)
    cache = _filled(model, prompt)
    pc.store(prompt, cache)  # seen once
    pc.store(prompt, _Racing(pc, prompt, cache))  # seen twice; the copy races a store of the same prompt
    assert len(pc) == 1 and pc.bytes == 48 * per_position


def test_a_sequence_of_exactly_min_tokens_is_kept_and_copied():
    """MIN_TOKENS is the shortest stored sequence (shorter ones are not): one of exactly that length
    is kept, and a longer prompt starting with it copies all of it."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30, min_tokens=16)
    seq = _prompt(1, 16)
    pc.keep(seq, _filled(model, seq))
    assert len(pc) == 1
    assert pc.restore(torch.cat([seq, _prompt(2, 3)]), model.new_cache(64)) == 16


def test_a_prompt_as_large_as_the_whole_budget_is_stored():
    """The byte budget is inclusive: a prompt seen twice whose rows fill it exactly is stored."""
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(48 * per_position)
    prompt = _prompt(1, 48)
    for _ in range(2):
        pc.store(prompt, _filled(model, prompt))
    assert len(pc) == 1 and pc.bytes == pc.max_bytes


def test_storing_a_prompt_already_covered_makes_it_the_most_recently_used():
    """A kept sequence that a stored entry already covers refreshes that entry, so the next
    eviction takes the other, least recently used one."""
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(100 * per_position)
    a, b, c = _prompt(1, 48), _prompt(2, 48), _prompt(3, 48)
    for t in (a, b):
        for _ in range(2):
            pc.store(t, _filled(model, t))  # seen twice: stored (proven)
    assert len(pc) == 2
    pc.keep(a[:40], _filled(model, a))  # inside a: a is used again
    for _ in range(2):
        pc.store(c, _filled(model, c))  # 144 > 100 positions: the least recently used (b) goes
    assert pc.restore(torch.cat([a, _prompt(4, 3)]), model.new_cache(64)) == 48
    assert pc.restore(torch.cat([b, _prompt(5, 3)]), model.new_cache(64)) == 0


def test_the_index_forgets_dropped_entries():
    """Evicted entries leave no trace in the index (it would otherwise grow with every distinct prompt)."""
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(60 * per_position)
    for s in range(6):
        t = _prompt(s, 48)
        for _ in range(2):
            pc.store(t, _filled(model, t))
    assert len(pc) == 1 and len(pc._index) == 1


def _fake(per_position: int):
    return SimpleNamespace(batch_invariant=True, new_cache=lambda n: SimpleNamespace(bytes_per_position=per_position))


def test_the_draft_prefix_cache_holds_as_many_positions_as_the_targets():
    target, draft = _fake(45 * 1024), _fake(4 * 1024)
    pcd = draft_prefix_cache(target, draft, 45 * 1024 * 100)
    assert pcd is not None and pcd.max_bytes == 4 * 1024 * 100
    assert draft_prefix_cache(target, draft, 0) is None  # the target has no prefix cache: neither has the draft


def test_prefix_cached_hands_pass_options_on():
    """PrefixCached.forward passes the wrapped model's options (e.g. compact draft rows) on, with
    and without the prefix cache in front."""
    inner = tiny_native(vocab=VOCAB)
    seen = []

    class Recording:
        batch_invariant = True

        def new_cache(self, n=512):
            return inner.new_cache(n)

        def forward(self, tokens, cache, *, last_only=False, compact=False):
            seen.append(compact)
            return inner.forward(tokens, cache, last_only=last_only)

    wrapped = PrefixCached(Recording(), PrefixCache(1 << 30))
    wrapped.forward(_prompt(1, 40), wrapped.new_cache(512), last_only=True, compact=True)
    wrapped.forward(_prompt(1, 40), wrapped.new_cache(512), compact=True)
    assert seen == [True, True]


def test_only_a_prefix_seen_before_counts_not_blocks_seen_elsewhere():
    """Blocks are remembered by chained hashes: a prompt [a, d] after [a, c] and [e, d] shares only
    its first block with what was seen (d was seen after another block), so 16 tokens are stored."""
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(1 << 30)
    a, c, d, e = (_prompt(s, SEEN_BLOCK) for s in (1, 2, 3, 4))
    for t in (torch.cat([a, c]), torch.cat([e, d]), torch.cat([a, d])):
        pc.store(t, _filled(model, t))
    assert len(pc) == 1 and pc.bytes == SEEN_BLOCK * per_position


def test_a_stored_prompt_does_not_follow_the_callers_tensor():
    """The stored tokens are a copy: a caller reusing its token buffer afterwards changes nothing."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30)
    seq = _prompt(1, 40)
    buf = seq.clone()
    pc.keep(buf, _filled(model, seq))
    buf[:] = _prompt(2, 40)  # the caller's buffer now holds another prompt
    assert pc.restore(torch.cat([buf, _prompt(3, 3)]), model.new_cache(64)) == 0
    assert pc.restore(torch.cat([seq, _prompt(3, 3)]), model.new_cache(64)) == 40


def test_unproven_entries_may_fill_exactly_their_share():
    """UNPROVEN_SHARE is inclusive: kept sequences of 30 + 20 positions under a 100-position budget
    (a 50-position share) both stay."""
    model = tiny_native(vocab=VOCAB)
    per_position = model.new_cache(1).bytes_per_position
    pc = PrefixCache(100 * per_position)
    a, b = _prompt(1, 30), _prompt(2, 20)
    pc.keep(a, _filled(model, a))
    pc.keep(b, _filled(model, b))
    assert len(pc) == 2 and pc.unproven_bytes == 50 * per_position


def test_a_prompt_too_short_to_copy_from_is_not_a_lookup():
    """A prefill of exactly MIN_TOKENS tokens can copy nothing (its last token always runs): it is
    not counted as a lookup (the hit rate's denominator)."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30, min_tokens=16)
    seq = _prompt(1, 40)
    pc.keep(seq, _filled(model, seq))
    assert pc.restore(seq[:16], model.new_cache(64)) == 0
    assert pc.lookups == 0


def test_a_prompt_that_only_shares_the_start_of_an_entry_does_not_replace_it():
    """Storing replaces only an entry the new prompt extends: one that shares a 20-token system
    message with a stored prompt is stored beside it, and both stay reusable."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30)
    x = _prompt(1, 48)
    t = torch.cat([x[:20], _prompt(2, 28)])
    for prompt in (x, x, t, t):
        pc.store(prompt, _filled(model, prompt))
    assert len(pc) == 2
    assert pc.restore(torch.cat([x, _prompt(3, 3)]), model.new_cache(64)) == 48
    assert pc.restore(torch.cat([t, _prompt(3, 3)]), model.new_cache(64)) == 48


def test_a_last_only_pass_on_a_filled_cache_is_not_a_prefill():
    """Only a prefill of an empty cache copies stored rows: a last_only pass of 40 tokens appended to
    a cache that already holds 20 (a draft catching up) runs them all, although a stored sequence
    starts with those 40 tokens (its rows belong at positions 0..39, not 20..59)."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30)
    head, q = _prompt(1, 20), _prompt(2, 40)
    pc.keep(q, _filled(model, q))
    cache, ref = model.new_cache(512), model.new_cache(512)
    model.forward(head, cache)
    model.forward(head, ref)
    got = PrefixCached(model, pc).forward(q, cache, last_only=True)
    want = model.forward(q, ref, last_only=True)
    assert torch.equal(got, want) and _same_cache(cache, ref)


def test_a_scrape_reports_the_prefix_cache_bytes_and_queue_held_now():
    """/metrics sets the prefix cache's bytes and each scheduler's queue length as they are at the
    scrape, not as a pass last left them: gauges set to stale values (as a pass sets the queue
    length when it begins) read the current ones after a scrape."""
    app = create_app(tiny_native(vocab=VOCAB), settings=ServerSettings(prefix_cache_bytes=64 << 20))
    client = TestClient(app, base_url="http://localhost")
    prompt = [int(t) for t in _prompt(9, 48)]
    for _ in range(2):  # the second session stores the prompt's whole blocks
        assert client.post("/v1/sessions", json={"prompt_ids": prompt, "temperature": 0.0}).status_code == 201
    ctx = app.state.ctx
    held = ctx.model.prefix_cache.bytes
    assert held > 0
    scheduler = ctx.model.scheduler
    ctx.metrics.prefix_bytes.set(1)
    scheduler.metrics.queue.labels(scheduler.name).set(5)
    text = client.get("/metrics").text
    assert f"specdec_prefix_cache_bytes {float(held)}" in text, text
    assert f'specdec_scheduler_queue_length{{model="{scheduler.name}"}} {float(len(scheduler))}' in text, text


def test_min_tokens_must_be_at_least_one():
    """A prefix cache keyed by no tokens at all is refused (min_tokens 0 would index every prompt
    under the empty key and store sequences of no tokens); one token is the smallest allowed."""
    with pytest.raises(ValueError, match="bad prefix cache limits"):
        PrefixCache(1 << 20, min_tokens=0)
    with pytest.raises(ValueError, match="bad prefix cache limits"):
        PrefixCache(-1)
    assert PrefixCache(0, min_tokens=1).min_tokens == 1


def test_a_model_without_caches_gets_no_prefix_cache():
    """batch_invariant alone is not enough: the model must also make caches to copy rows into."""
    assert not supports_prefix_cache(SimpleNamespace(batch_invariant=True))
    assert supports_prefix_cache(SimpleNamespace(batch_invariant=True, new_cache=lambda n: None))


def test_a_prefill_of_exactly_min_tokens_is_remembered_and_stored():
    """A prompt of exactly MIN_TOKENS tokens copies nothing (its last token runs) but still goes
    through the cache: seen twice, it is stored, and a longer prompt starting with it copies all of it."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30, min_tokens=16)
    prompt = _prompt(1, 16)
    for _ in range(2):
        prefill(model.forward, pc, prompt, model.new_cache(64), True)
    assert len(pc) == 1
    assert pc.restore(torch.cat([prompt, _prompt(2, 5)]), model.new_cache(64)) == 16


class _Cancelled(BaseException):
    """Not an Exception (as KeyboardInterrupt, or a cancellation raised into a pass)."""


def test_a_prefill_stopped_by_a_base_exception_leaves_the_cache_empty():
    """Whatever stops the pass after the stored rows were copied, a BaseException included, the
    cache is left empty (not holding copied rows with no prompt behind them)."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30)
    prompt = _prompt(1, 40)
    pc.keep(prompt, _filled(model, prompt))

    def stopped(tokens, cache, *, last_only):
        raise _Cancelled()

    cache = model.new_cache(512)
    with pytest.raises(_Cancelled):
        prefill(stopped, pc, prompt, cache, True)
    assert cache.length == 0


def test_every_restore_that_could_copy_is_a_lookup_hit_or_miss():
    """lookups (a hit rate's denominator) counts each restore long enough to copy from, a miss
    included; hits counts only the ones that copied."""
    model = tiny_native(vocab=VOCAB)
    pc = PrefixCache(1 << 30)
    seq = _prompt(1, 40)
    pc.keep(seq, _filled(model, seq))
    assert pc.restore(torch.cat([seq, _prompt(2, 3)]), model.new_cache(64)) == 40
    assert pc.restore(_prompt(3, 40), model.new_cache(64)) == 0
    assert (pc.lookups, pc.hits) == (2, 1)


@pytest.mark.parametrize("batching", [True, False])
def test_a_prefix_cache_of_zero_bytes_is_none(batching):
    """``--prefix-cache-bytes 0`` turns the prefix cache off: the served target and the served draft
    have none (not an empty one in front of every prefill); a positive size gives each one."""
    from specdec.server.app import serving_model
    from specdec.server.command import served_draft
    from specdec.server.metrics import ServerMetrics

    for size, on in ((0, False), (64 << 20, True)):
        target = tiny_native(vocab=VOCAB)
        served = serving_model(target, ServerSettings(batching=batching, prefix_cache_bytes=size), ServerMetrics())
        assert (served.prefix_cache is not None) == on, size
        draft = served_draft(tiny_native(vocab=VOCAB, seed=1), target, batching=batching, prefix_cache_bytes=size)
        assert (draft.prefix_cache is not None) == on, size
