"""The interactive chat's prefix cache on the real SmolLM2-135M weights: a finished turn's rows,
reply included, are what a fresh prefill of the next turn computes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import FixedGamma
from specdec.sampling import SamplingConfig
from specdec.server.prefix_cache import PrefixCache, PrefixCached
from specdec.text import encode_messages
from specdec.verify import get_rule

TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a hash table?"}]


@pytest.mark.parametrize("target_fixture", ["q4_target", "int8_target", "float32"])
@pytest.mark.parametrize("tree", [False, True])
def test_next_turn_copies_the_whole_last_turn_and_prefills_bitwise_fresh(smollm2, target_fixture, tree, request):
    """A greedy reply decoded with the default draft (a chain of 4, or 8-node trees), then the next
    turn through the chat template: every position of the last turn but its final token is copied
    (the reply re-tokenises to the same ids), and the prefill's logits and cache equal the target
    prefilling the whole conversation itself."""
    target = smollm2[0] if target_fixture == "float32" else request.getfixturevalue(target_fixture)
    draft = smollm2[1]
    tok, model = target.tokenizer, target.model
    pc = PrefixCache(256 << 20)
    dec = SpeculativeDecoder(PrefixCached(model, pc), ModelDrafter(draft.model), get_rule("greedy"),
                             gamma=FixedGamma(8 if tree else 4), tree=TreeSpec(min_prob=0.0) if tree else None,
                             eos_ids=target.eos_ids)
    ids = encode_messages(tok, TURN)
    out = dec.generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=32))
    assert len(out.tokens) == 32 and (out.stats.tree_rounds > 0) == tree
    turn = torch.tensor(encode_messages(tok, TURN + [{"role": "assistant", "content": tok.decode(out.tokens, skip_special_tokens=True)},
                                                       {"role": "user", "content": "And a heap?"}]))  # [n]
    cache, fresh = model.new_cache(512), model.new_cache(512)
    logits = PrefixCached(model, pc).forward(turn, cache, last_only=True)
    assert pc.reused_tokens == len(ids) + 32 - 1
    assert torch.equal(logits, model.forward(turn, fresh, last_only=True))
    n = cache.length
    assert n == fresh.length and torch.equal(cache.k[:, :, :n], fresh.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], fresh.v[:, :, :n])


@pytest.mark.parametrize("target_fixture", ["q4_target", "float32"])
def test_a_batching_server_keeps_replies_decoded_side_by_side_bitwise(smollm2, target_fixture, request):
    """Two chats decoded at once through the batching scheduler (their verification passes share
    batches), each kept when it finishes (``TargetSession.close`` -> ``ServedModel.keep_sequence``):
    each next turn copies all of its last turn but the final token, and its logits and cache equal
    the target prefilling the whole conversation alone."""
    import threading
    import time

    from specdec.server.scheduler import BatchedModel, Scheduler
    from specdec.server.sessions import SerializedModel

    target = smollm2[0] if target_fixture == "float32" else request.getfixturevalue(target_fixture)
    tok, model = target.tokenizer, target.model
    pc = PrefixCache(256 << 20)
    served = BatchedModel(model, Scheduler(model), initial_length=64, prefix_cache=pc)
    draft = SerializedModel(smollm2[1].model, threading.Lock())  # one draft object, one pass at a time
    chats = [TURN, [{"role": "user", "content": "Name three prime numbers and say why they are prime."}]]
    outs: dict[int, list[int]] = {}
    sizes: list[int] = []
    observe = served.scheduler.on_pass

    def counting(stats):
        sizes.append(stats.sequences)
        observe(stats)

    served.scheduler.on_pass = counting

    def chat(i: int) -> None:
        dec = SpeculativeDecoder(served, ModelDrafter(draft), get_rule("greedy"), gamma=FixedGamma(4), eos_ids=target.eos_ids)
        outs[i] = dec.generate(encode_messages(tok, chats[i]), SamplingConfig(temperature=0.0, max_new_tokens=32)).tokens

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(2)]
    hold = threading.Event()
    served.scheduler.compute.post(hold.wait)  # the compute thread waits: both prompts queue for the first pass
    for t in threads:
        t.start()
    while len(served.scheduler) < 2:
        time.sleep(0.001)
    hold.set()
    for t in threads:
        t.join()
    assert sorted(outs) == [0, 1] and all(len(o) == 32 for o in outs.values()) and sizes[0] == 2
    for i, messages in enumerate(chats):
        reply = tok.decode(outs[i], skip_special_tokens=True)
        turn = torch.tensor(encode_messages(tok, messages + [{"role": "assistant", "content": reply},
                                                             {"role": "user", "content": "Say more."}]))  # [n]
        before = pc.reused_tokens
        cache, fresh = served.new_cache(512), model.new_cache(512)
        logits = served.forward(turn, cache, last_only=True)
        assert pc.reused_tokens - before == len(encode_messages(tok, messages)) + 32 - 1, i
        assert torch.equal(logits, model.forward(turn, fresh, last_only=True)), i
        n = cache.length
        assert n == fresh.length and torch.equal(cache.k[:, :, :n], fresh.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], fresh.v[:, :, :n])


@pytest.mark.parametrize("tree", ["chain", "8"])
def test_the_default_chat_engine_keeps_the_drafts_rows_and_changes_no_output(tree):
    """``Engine.with_prefix_cache`` on the default models (4-bit target, int8 draft): the draft,
    batch-invariant on the compiled kernels, gets its own prefix cache and keeps its rows of each
    finished turn.  Three turns of a chat sampled at T = 1 with a seed under block verification at
    γ 4 — whose tokens depend on every draft proposal and probability — give the engine's own tokens
    without any cache, and the draft's prefills copy what earlier turns kept.  (Without prompt
    lookup in front: its draft length is picked by the clock, so block verification's tokens would
    differ run to run with or without a cache.)"""
    from specdec.engine import Engine, EngineConfig
    from specdec.defaults import DEFAULT_DRAFT_MODEL

    engine = Engine.build(EngineConfig(draft=DEFAULT_DRAFT_MODEL))
    cached = engine.with_prefix_cache()
    draft_model = cached.drafter.model  # ModelDrafter -> PrefixCached
    assert draft_model.prefix_cache is not None and cached.target.model.prefix_cache is not None
    tok = engine.target.tokenizer
    history = list(TURN)
    cfg = SamplingConfig(temperature=1.0, seed=3, max_new_tokens=24)
    last: list[int] = []
    for turn, follow_up in enumerate(["And a heap?", "Which is faster?", "Thanks."]):
        ids = encode_messages(tok, history)
        before = draft_model.prefix_cache.reused_tokens
        out = cached.generate(ids, cfg, method="block", gamma=4, tree=tree)
        ref = engine.generate(ids, cfg, method="block", gamma=4, tree=tree)
        assert out.token_ids == ref.token_ids, turn
        if turn > 0:  # the last turn's prompt and at least part of its reply
            assert draft_model.prefix_cache.reused_tokens - before > len(last), turn
        last = ids
        history += [{"role": "assistant", "content": out.text}, {"role": "user", "content": follow_up}]
