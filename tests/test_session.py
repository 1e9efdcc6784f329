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
