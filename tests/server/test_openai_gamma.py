"""γ auto across a server's OpenAI requests: each choice starts from the controller of the last
one that ended under the same rule (:class:`specdec.gamma.GammaMemory`), so a drafter that does
not pay stays backed off from request to request instead of being re-tried at every prompt."""

from __future__ import annotations

import random

from fastapi.testclient import TestClient

from specdec.drafters import ModelDrafter
from specdec.gamma import CostGamma
from specdec.models.toy import ToyLM
from specdec.server import ServerSettings, create_app
from toy_server import LetterTokenizer

VOCAB = 8


def _losing() -> CostGamma:
    """A controller that ended backed off after 200 rounds of a drafter that cannot pay (a drafted
    token ~0.9 of a plain round, half accepted), driven as a decoder drives it."""
    ctrl, rng = CostGamma(), random.Random(5)
    for _ in range(200):
        g = ctrl.next_gamma()
        acc = 0
        while acc < g and rng.random() < 0.5:
            acc += 1
        ctrl.update(gamma=g, accepted=acc, draft_s=g * 0.0026, target_s=0.0029 + 0.0004 * g, other_s=0.0001)
    assert ctrl.next_gamma() == 0
    return ctrl


def test_a_servers_requests_continue_gamma_autos_controller_per_rule():
    """A fresh server's first greedy request drafts (γ auto starts at one token) and leaves its
    controller behind; after a request whose controller ended backed off with a drafter that cannot
    pay, the next drafts nothing in its 6 tokens (the successor starts backed off, probing later)
    and gives the same text; another rule (coupled, T = 1) keeps its own, and so does constrained
    output; a fixed γ leaves the memory alone."""
    target = ToyLM(VOCAB, order=2, seed=3)
    draft = target.perturbed(0.3, seed=1)
    app = create_app(target, tokenizer=LetterTokenizer(), settings=ServerSettings(gamma="auto"),
                     drafter_factory=lambda: ModelDrafter(draft), drafter_name="toy")
    memory = app.state.ctx.gamma_memory
    client = TestClient(app, base_url="http://localhost")

    def ask(**kw) -> dict:
        r = client.post("/v1/completions", json={"prompt": "abcab", "max_tokens": 6, "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    fresh = ask()
    assert fresh["specdec"]["draft_tokens_proposed"] > 0 and isinstance(memory._last["greedy"], CostGamma)
    losing = _losing()
    memory.keep("greedy", losing)  # as if the last request had ended so
    after = ask()
    assert after["specdec"]["draft_tokens_proposed"] == 0
    assert after["choices"][0]["text"] == fresh["choices"][0]["text"]
    kept = memory._last["greedy"]
    assert kept is not losing and kept._draft_s == losing._draft_s and kept.next_gamma() == 0
    sampled = ask(temperature=1.0, seed=2)
    assert sampled["specdec"]["method"] == "coupled" and sampled["specdec"]["draft_tokens_proposed"] > 0
    assert memory._last["greedy"] is kept
    assert ask(gamma=3)["specdec"]["draft_tokens_proposed"] > 0 and memory._last["greedy"] is kept
    # constrained output keeps a controller of its own: it drafts afresh, and free text's stays
    assert ask(allowed_token_ids=list(range(VOCAB)))["specdec"]["draft_tokens_proposed"] > 0
    assert memory._last["greedy"] is kept and isinstance(memory._last["greedy+constrained"], CostGamma)


class _Counting(ModelDrafter):
    """The toy draft, keeping each round's draft length (a tree's: its node count)."""

    def __init__(self, model, drafted: list[int]) -> None:
        super().__init__(model)
        self.drafted = drafted

    def propose(self, context, gamma, sampler):
        draft = super().propose(context, gamma, sampler)
        self.drafted.append(len(draft.tokens))
        return draft

    def propose_tree(self, context, budget, sampler, spec, *, max_depth):
        draft = super().propose_tree(context, budget, sampler, spec, max_depth=max_depth)
        self.drafted.append(len(draft.tokens))
        return draft


def test_the_openai_endpoints_draft_no_more_than_the_servers_max_gamma():
    """``--max-gamma`` bounds the server's own drafts too: a request's γ or tree above it is a 400
    that names the flag; γ guide (which grows past 2 on this easy toy when unbounded), γ auto and
    tree auto (timing-driven, so only bounded here) stay at or below it, with greedy output equal
    to the unbounded server's (the load-driven draft cap is off: only the bound may cut a draft)."""
    target = ToyLM(VOCAB, order=2, seed=3)
    draft = target.perturbed(0.05, seed=1)
    drafted: list[int] = []

    def client(bound: int) -> TestClient:
        app = create_app(target, tokenizer=LetterTokenizer(), settings=ServerSettings(max_gamma=bound, draft_cap=False),
                         drafter_factory=lambda: _Counting(draft, drafted), drafter_name="toy")
        return TestClient(app, base_url="http://localhost")

    def ask(c: TestClient, **kw) -> str:
        r = c.post("/v1/completions", json={"prompt": "abcab", "max_tokens": 40, "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    free, bounded = client(64), client(2)
    for kw in ({"gamma": "guide"}, {"gamma": 2}, {"tree": 2}, {"gamma": "auto"}, {"tree": "auto"}):
        drafted.clear()
        want = ask(free, **kw)
        grew = max(drafted)
        drafted.clear()
        assert ask(bounded, **kw) == want, kw
        assert max(drafted) <= 2, (kw, drafted)
        if "auto" not in kw.values():
            assert max(drafted) == 2 and sum(drafted) > 10, (kw, drafted)  # drafted up to the bound
        if kw == {"gamma": "guide"}:
            assert grew > 2, grew  # unbounded, the same request drafts more: the bound is what held it
    for kw, what in (({"gamma": 3}, "gamma 3"), ({"tree": 4}, "tree 4")):
        r = bounded.post("/v1/completions", json={"prompt": "abcab", "max_tokens": 4, "temperature": 0, **kw})
        assert r.status_code == 400 and what in r.text and "--max-gamma" in r.text, r.text
