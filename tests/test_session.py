"""``TargetSession.verify(draft, max_tokens=k)``: a round cut by a length limit.

The server's edge sessions cut their last round at the session's budget. The cut must leave the
session exactly where plain decoding would be after those k tokens: the verdict counts k - 1
accepted drafts and one last token (as every round does), the cache holds a row for every
committed token but the newest, a target-aware drafter gets those rows' features, and rounds
after the cut give plain decoding's tokens. Chains and trees (an accepted path that skips a
sibling, so the cut path is compacted, not truncated).
"""

from __future__ import annotations

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters.base import Draft
from specdec.errors import ConfigError, ContextLengthError
from specdec.models.toy import ToyLM
from specdec.sampling import SamplingConfig
from specdec.session import TargetSession
from specdec.verify import get_rule
from tiny import tiny_native

PROMPT = [3, 1, 4, 1, 5]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=40)


@pytest.fixture(scope="module")
def target():
    return tiny_native()


@pytest.fixture(scope="module")
def plain(target) -> list[int]:
    return SpeculativeDecoder(target, None, get_rule("greedy")).generate(PROMPT, GREEDY).tokens


def _oracle(plain: list[int], done: int, n: int, tree: bool) -> Draft:
    """The next ``n`` plain tokens as a chain; or as a tree whose first branch is a wrong token
    at every depth, so the accepted path is nodes 1, 3, 5, ... (not a prefix of the node order)."""
    right = torch.tensor(plain[done : done + n])
    if not tree:
        return Draft(tokens=right, probs=None)
    tokens, parents, last = [], [], -1
    for tok in right.tolist():
        tokens += [(tok + 1) % 64, tok]  # a wrong sibling first, then the right one
        parents += [last, last]
        last = len(tokens) - 1
    return Draft(tokens=torch.tensor(tokens), probs=None, parents=torch.tensor(parents))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("cut", [1, 2, 4])
def test_a_round_cut_by_max_tokens_leaves_the_session_where_plain_decoding_is(target, plain, tree, cut):
    sess = TargetSession(target, PROMPT, GREEDY, get_rule("greedy"), seed=0, feature_taps=(1,))
    first = sess.verify(_oracle(plain, 0, 3, tree))  # an uncut round first: 3 drafts + 1
    assert first.verdict.tokens.tolist() == plain[:4]
    out = sess.verify(_oracle(plain, 4, 6, tree), max_tokens=cut)  # all 6 would be accepted: 7 tokens, cut to `cut`
    v = out.verdict
    assert v.tokens.tolist() == plain[4 : 4 + cut]
    assert v.num_accepted == cut - 1  # the last kept token stands where a round's own token stands
    if tree:
        assert list(v.path) == [2 * i + 1 for i in range(cut - 1)]
    assert sess.context.tolist() == PROMPT + plain[: 4 + cut]
    assert sess.cache.length == sess.context.numel() - 1  # every committed token's row but the newest
    assert out.features.shape[0] == cut  # the pending row and the accepted drafts', as after any round
    found = {1: torch.empty(0)}
    final = target.hidden(sess.context[:-1], target.new_cache(64), taps=found)
    teacher = torch.stack([found[1], final], dim=1)  # [T, 2, D]
    assert torch.equal(out.features, teacher[len(PROMPT) + 3 : len(PROMPT) + 3 + cut])
    for i in range(4 + cut, 14):  # rounds without a draft carry on as plain decoding
        assert sess.verify(Draft(tokens=torch.tensor([], dtype=torch.long), probs=None)).verdict.tokens.tolist() == [plain[i]]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_draft_that_would_run_past_the_context_is_refused_and_leaves_the_session(tree):
    """12 of 16 positions used: 3 drafts + 1 fill the context, 4 (a chain, or a tree whose deepest
    path is 4 nodes) would not, and is refused as the context's limit, nothing committed."""
    from specdec.errors import ContextLengthError

    small = tiny_native(max_length=16)
    prompt = list(range(3, 15))  # 12 tokens
    cont = SpeculativeDecoder(small, None, get_rule("greedy")).generate(prompt, GREEDY).tokens  # 4: the context's end
    assert len(cont) == 4
    sess = TargetSession(small, prompt, GREEDY, get_rule("greedy"), seed=0)
    ids = torch.tensor(cont + [0])
    with pytest.raises(ContextLengthError, match="context of 16"):
        sess.verify(Draft(tokens=ids[:4], probs=None, parents=torch.tensor([-1, 0, 1, 2]) if tree else None))
    assert sess.context.tolist() == prompt and sess.cache.length == len(prompt) - 1
    out = sess.verify(Draft(tokens=ids[:3], probs=None, parents=torch.tensor([-1, 0, 1]) if tree else None))
    assert out.verdict.tokens.tolist() == cont and sess.context.numel() == 16


SHORT_GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingConfig(temperature=1.0, max_new_tokens=10)


def _toy(max_length: int = 1 << 20) -> ToyLM:
    m = ToyLM(6, order=2, seed=1)
    m.max_length = max_length
    return m


def test_the_constructor_refuses_ids_outside_the_vocabulary_and_nothing_else():
    """Ids 0 and V-1 are fine; V and -1 are refused with the offending id named."""
    TargetSession(_toy(), [0, 5, 3], SHORT_GREEDY, get_rule("greedy"), seed=0)
    with pytest.raises(ConfigError, match="token id 6, outside"):
        TargetSession(_toy(), [0, 6, 3], SHORT_GREEDY, get_rule("greedy"), seed=0)
    with pytest.raises(ConfigError, match="token id -1, outside"):
        TargetSession(_toy(), [0, -1, 3], SHORT_GREEDY, get_rule("greedy"), seed=0)


def test_the_constructor_refuses_a_prompt_that_fills_the_context():
    """A prompt of max_length - 1 tokens leaves room for one token; one of max_length does not."""
    sess = TargetSession(_toy(8), [1] * 7, SHORT_GREEDY, get_rule("greedy"), seed=0)
    out = sess.verify(Draft(tokens=torch.tensor([], dtype=torch.long), probs=None))
    assert out.verdict.tokens.numel() == 1 and sess.context.numel() == 8
    with pytest.raises(ContextLengthError, match="8 tokens"):
        TargetSession(_toy(8), [1] * 8, SHORT_GREEDY, get_rule("greedy"), seed=0)
    with pytest.raises(ConfigError, match="empty"):
        TargetSession(_toy(8), [], SHORT_GREEDY, get_rule("greedy"), seed=0)


def test_a_greedy_only_rule_is_refused_at_a_temperature():
    with pytest.raises(ConfigError, match="needs temperature 0"):
        TargetSession(_toy(), [1, 2], SAMPLED, get_rule("greedy"), seed=0)
    TargetSession(_toy(), [1, 2], SAMPLED, get_rule("token"), seed=0)  # the others are fine


def test_the_tree_round_hands_the_drafts_sibling_mode_to_the_rule(monkeypatch):
    """A sampled tree drafted without replacement must be verified as such: the session passes
    ``draft.siblings`` on to the tree rule (a rule told 'iid' is biased)."""
    import specdec.verify_tree as vt

    seen = []
    real = vt.tree_token

    def spy(*args, **kwargs):
        seen.append(kwargs.get("siblings"))
        return real(*args, **kwargs)

    monkeypatch.setitem(vt.TREE_RULES, "tree_token", vt.TreeRule(**{**vt.TREE_RULES["tree_token"].__dict__, "fn": spy}))
    sess = TargetSession(_toy(), [1, 2], SAMPLED, get_rule("token"), seed=0)
    q = torch.full((2, 6), 1 / 6)
    for mode in ("without_replacement", "iid"):
        sess.verify(Draft(tokens=torch.tensor([3, 4]), probs=q, parents=torch.tensor([-1, -1]), siblings=mode))
    assert seen == ["without_replacement", "iid"]


def test_a_scored_prompt_token_tied_with_others_ranks_by_the_strictly_more_likely_ones():
    """``score_prompt``'s rank is 1 + the number of tokens strictly more likely: a token tied with
    others (a flat row) ranks 1, not after its ties."""
    from specdec.session import score_prompt

    class Flat:
        max_length = 64
        vocab_size = 4

        def new_cache(self, n):
            return None

        def forward(self, tokens, cache):
            rows = torch.zeros(tokens.numel(), 4)
            rows[:, 3] = 1.0  # token 3 most likely; tokens 0, 1, 2 tied below it
            return rows

    scored = score_prompt(Flat(), [0, 1, 3, 2], 1)
    assert [rank for _, _, rank in scored] == [2, 1, 2]
