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


def test_a_wide_tree_within_the_budget_is_not_refused_for_its_branches():
    """The cache has room for a token tree's extra branches beyond the context's own capacity
    (MAX_TREE_NODES): a depth-1 tree of 100 siblings, in a session whose budget is 10 tokens, is
    verified, not refused as running past the context."""
    model = tiny_native()
    sess = TargetSession(model, PROMPT, SHORT_GREEDY, get_rule("greedy"), seed=0)
    tokens = torch.tensor([i % 64 for i in range(100)])
    out = sess.verify(Draft(tokens=tokens, probs=None, parents=torch.full((100,), -1)))
    assert out.verdict.tokens.numel() == 2 and sess.context.numel() == len(PROMPT) + 2
    assert sess.cache.length == len(PROMPT) + 1


def test_a_plain_round_on_a_full_context_is_a_context_length_error():
    """conclude_plain refuses a round when the context has no room for its token, with the same
    ContextLengthError as verify (nothing written past the context)."""
    small = tiny_native(max_length=16)
    sess = TargetSession(small, list(range(3, 18)), SHORT_GREEDY, get_rule("greedy"), seed=0)  # 15 tokens
    logits = small.forward(sess.plain_feed(), sess.cache)  # [1, V]
    sess.conclude_plain(logits)
    assert sess.context.numel() == 16
    before = sess.context.tolist()
    with pytest.raises(ContextLengthError, match="context of 16"):
        sess.conclude_plain(logits)
    assert sess.context.tolist() == before


def test_a_tree_with_more_nodes_than_the_cache_holds_is_a_context_length_error():
    """12 of 16 positions used (cache length 11): a tree of 4 root siblings fills the cache's 16
    rows ([last] + 4 nodes) and is verified; one of 5 would need 17 rows and is refused as the
    context's limit (ContextLengthError, not the cache's own 'KV cache full'), nothing committed."""
    small = tiny_native(max_length=16)
    prompt = list(range(3, 15))  # 12 tokens
    sess = TargetSession(small, prompt, SHORT_GREEDY, get_rule("greedy"), seed=0)
    with pytest.raises(ContextLengthError, match="context of 16"):
        sess.verify(Draft(tokens=torch.tensor([1, 2, 3, 4, 5]), probs=None, parents=torch.full((5,), -1)))
    assert sess.context.tolist() == prompt and sess.cache.length == len(prompt) - 1
    out = sess.verify(Draft(tokens=torch.tensor([1, 2, 3, 4]), probs=None, parents=torch.full((4,), -1)))
    assert sess.context.numel() == len(prompt) + out.verdict.tokens.numel()


def test_node_argmax_is_the_raw_logits_argmax_whatever_the_sampling_config():
    """Outcome.node_argmax is the target's arg-max of its *raw* logits (Lookahead's Jacobi step
    reads the model, not the request's sampling settings): a logit_bias that buries the raw arg-max
    changes the emitted token but not node_argmax."""
    model = tiny_native()
    raw = int(model.forward(torch.tensor(PROMPT), model.new_cache(32))[-1].argmax())
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10, logit_bias=((raw, -100.0),))
    sess = TargetSession(model, PROMPT, cfg, get_rule("greedy"), seed=0)
    out = sess.verify(Draft(tokens=torch.tensor([], dtype=torch.long), probs=None, wants_argmax=True))
    assert out.node_argmax is not None and out.node_argmax.tolist() == [raw]
    assert out.verdict.tokens.tolist() != [raw]


def test_a_passed_min_tokens_floor_leaves_the_sessions_config():
    """_settle's promise: once min_tokens tokens were committed, the StopFloor leaves the
    session's config (its inner constraint, here none, takes its place), so later rows skip the
    constrained path; before the floor it stays."""
    from specdec.sampling import StopFloor, floor_stops

    model = tiny_native()
    cfg = floor_stops(SamplingConfig(temperature=0.0, max_new_tokens=10, min_tokens=2), frozenset({0}))
    assert isinstance(cfg.constraint, StopFloor)
    sess = TargetSession(model, PROMPT, cfg, get_rule("greedy"), seed=0)
    empty = Draft(tokens=torch.tensor([], dtype=torch.long), probs=None)
    sess.verify(empty)
    assert isinstance(sess.cfg.constraint, StopFloor)  # 1 of 2 generated: the floor still masks
    sess.verify(empty)
    assert sess.cfg.constraint is None


def test_tree_scores_on_a_chain_with_a_repeated_token_equal_the_chain_rows():
    """tree_scores' promise: on a chain it is exactly what the chain path computes (row i sees
    draft[:i]).  With a frequency penalty a token repeated on the path is counted each time:
    row 3 of the chain [5, 5, 5] sees token 5 three times."""
    from specdec.sampling import PenaltyState, penalised_logits
    from specdec.session import tree_scores

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, generator=g)
    cfg = SamplingConfig(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.2)
    tokens, parents = torch.tensor([5, 5, 5]), torch.tensor([-1, 0, 1])
    state = PenaltyState.start(torch.tensor([1, 2, 5]), 16)
    tree = tree_scores(logits, cfg, state, tokens, parents, probs=False)
    chain = penalised_logits(logits, cfg, PenaltyState.start(torch.tensor([1, 2, 5]), 16), tokens)
    assert torch.allclose(tree, chain)


def test_feature_taps_may_name_every_layer_count_up_to_the_last():
    """A tap is a layer count: 0 (the embeddings) .. n_layers (after the last layer) are all
    readable; n_layers + 1 is refused, naming the target's layer count."""
    from specdec.session import check_features

    model = tiny_native()  # 2 layers
    check_features(model, (0, 1, 2))
    sess = TargetSession(model, PROMPT, SHORT_GREEDY, get_rule("greedy"), seed=0, feature_taps=(2,))
    assert sess.prompt_features is not None and sess.prompt_features.shape[:2] == (len(PROMPT) - 1, 2)
    with pytest.raises(ConfigError, match="2 layers"):
        check_features(model, (3,))


def test_an_explicit_budget_of_zero_sizes_the_context_not_the_configs():
    """max_new_tokens given to the session wins over cfg.max_new_tokens even when it is 0 (the
    context is sized for it, not for the config's 1000)."""
    model = tiny_native()
    big = SamplingConfig(temperature=0.0, max_new_tokens=1000)

    def length(budget):
        return TargetSession(model, PROMPT, big, get_rule("greedy"), seed=0, max_new_tokens=budget).max_length

    assert length(0) == length(1) - 1  # the explicit budget, 0 included, sizes it
    assert length(0) < length(None)


def test_close_hands_a_keeping_target_every_committed_token_but_the_last():
    """close() gives keep_sequence the committed tokens whose keys/values the cache holds: all
    but the newest, which no pass has fed yet (the prefix cache must not claim a row it lacks)."""
    model = tiny_native()
    seen = []
    model.keep_sequence = lambda tokens, cache: seen.append((tokens.tolist(), cache.length))
    sess = TargetSession(model, PROMPT, SHORT_GREEDY, get_rule("greedy"), seed=0)
    sess.verify(Draft(tokens=torch.tensor([], dtype=torch.long), probs=None))
    sess.verify(Draft(tokens=torch.tensor([], dtype=torch.long), probs=None))
    sess.close()
    ctx = sess.context.tolist()
    assert seen == [(ctx[:-1], len(ctx) - 1)]


def test_a_one_token_prompt_has_empty_prompt_features_of_the_usual_row_shape():
    """With a single prompt token nothing is prefilled: prompt_features is [0, len(taps) + 1, D]
    (taps..., final hidden state), the shape a drafter concatenates later rows onto."""
    model = tiny_native()
    sess = TargetSession(model, [7], SHORT_GREEDY, get_rule("greedy"), seed=0, feature_taps=(1, 2))
    assert sess.prompt_features is not None
    assert tuple(sess.prompt_features.shape) == (0, 3, model.cfg.hidden_size)


def test_kv_peak_bytes_counts_the_positions_used_not_the_allocation():
    """kv_peak_bytes reports the bytes of the cache's peak positions (used_bytes), not the whole
    buffer; a fresh session copied no prompt rows from a prefix cache."""
    sess = TargetSession(tiny_native(), PROMPT, SHORT_GREEDY, get_rule("greedy"), seed=0)
    sess.verify(Draft(tokens=torch.tensor([], dtype=torch.long), probs=None))
    assert sess.kv_peak_bytes == len(PROMPT) * sess.cache.bytes_per_position < sess.cache.nbytes
    assert sess.cached_prompt_tokens == 0


def test_check_finite_refuses_an_infinite_logit_too():
    """A target whose raw logits are infinite (not only NaN) is a broken model: ModelError."""
    from specdec.errors import ModelError
    from specdec.session import check_finite

    check_finite(torch.tensor([[0.5, -3.0]]), torch.tensor([1]), 4)
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ModelError, match="not finite"):
            check_finite(torch.tensor([[0.5, bad]]), torch.tensor([1]), 4)


def test_a_tree_node_where_the_constraint_allows_nothing_is_a_config_error():
    """tree_constraint, like the chain path, refuses a row where the constraint allows no token
    (a ConfigError saying so), instead of handing the rule a row of -inf."""
    from specdec.session import tree_constraint

    class NothingAfterTwo:  # allows every token, except nothing at all after token 2
        def allowed(self, generated, vocab_size):
            return torch.full((vocab_size,), not (generated and generated[-1] == 2))

    logits = torch.zeros(3, 4)
    out = tree_constraint(logits, NothingAfterTwo(), [1], torch.tensor([0, 1]), torch.tensor([-1, 0]))
    assert torch.equal(out, logits)
    with pytest.raises(ConfigError, match="allows no token"):
        tree_constraint(logits, NothingAfterTwo(), [1], torch.tensor([0, 2]), torch.tensor([-1, 0]))


def test_scoring_a_prompt_that_fills_the_context_is_refused():
    """score_prompt refuses a prompt of max_length tokens as generation does (ContextLengthError
    naming both numbers); one of max_length - 1 is scored."""
    from specdec.session import score_prompt

    small = tiny_native(max_length=16)
    assert len(score_prompt(small, list(range(15)), 1)) == 14
    with pytest.raises(ContextLengthError, match="16 tokens but the model's context is 16"):
        score_prompt(small, list(range(16)), 1)


def test_the_sessions_seed_drives_its_sampling():
    """The rule's randomness comes from the session's seed: the same seed reproduces a sampled
    continuation, another seed (here 1 vs 0, 8 plain rounds at temperature 1 over 64 tokens)
    gives another one."""
    model = tiny_native()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10)

    def run(seed):
        sess = TargetSession(model, PROMPT, cfg, get_rule("token"), seed=seed)
        for _ in range(8):
            sess.verify(Draft(tokens=torch.tensor([], dtype=torch.long), probs=None))
        return sess.context.tolist()

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_a_tree_with_a_parent_count_that_is_not_one_per_token_is_refused_by_the_session():
    """verify() checks a tree's parents before any pass: one parent too few is a ConfigError saying
    so, and the session is left as it was."""

    sess = TargetSession(tiny_native(), PROMPT, SHORT_GREEDY, get_rule("greedy"), seed=0)
    with pytest.raises(ConfigError, match="one parent per draft token"):
        sess.verify(Draft(tokens=torch.tensor([1, 2, 3]), probs=None, parents=torch.tensor([-1, 0])))
    assert sess.context.tolist() == PROMPT and sess.cache.length == len(PROMPT) - 1


def test_a_tree_rounds_metrics_count_the_drafted_nodes():
    """Outcome.metrics['tree_nodes'] is the number of nodes the pass scored, not the accepted path."""
    sess = TargetSession(tiny_native(), PROMPT, SHORT_GREEDY, get_rule("greedy"), seed=0)
    out = sess.verify(Draft(tokens=torch.tensor([1, 2, 3, 4, 5]), probs=None, parents=torch.tensor([-1, -1, 0, 0, 1])))
    assert out.metrics["tree_nodes"] == 5
