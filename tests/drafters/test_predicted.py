"""OpenAI's Predicted Outputs as a drafter (``specdec.drafters.predicted``): where its drafts come from.

The output law with a prediction in front of the draft model is a chi-square test in
``tests/test_decoder.py``; the server's answers with and without one in ``tests/server/test_openai.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.drafters.predicted import Predicted, predicted_ids
from specdec.gamma import FixedGamma
from specdec.verify import Verdict

ROOM = SimpleNamespace(room=None)  # a sampler as the prediction reads it: no server cap


def _verdict(accepted: int) -> Verdict:
    return Verdict(num_accepted=accepted, tokens=torch.zeros(accepted + 1, dtype=torch.long))


def test_drafts_follow_the_answer_through_the_prediction():
    """From the prediction's start; after a partial acceptance, from where the answer's last tokens
    occur at or after the last draft's end (not an earlier copy of the same n-gram); nothing where
    the answer left the prediction and there is no drafter behind it."""
    predicted = [5, 6, 7, 5, 6, 8, 9, 10]
    d = Predicted(predicted)
    prompt = torch.tensor([1, 2, 3])
    d.prepare(prompt)
    first = d.propose(prompt, 4, ROOM)
    assert first.tokens.tolist() == predicted[:first.tokens.numel()] and first.free and first.probs is None
    d.commit(_verdict(3))
    d.update_free(gamma=first.tokens.numel(), accepted=3, draft_s=0.0, target_s=0.01, other_s=0.0)
    context = torch.tensor([1, 2, 3, 5, 6, 7, 5, 6])  # the answer so far: 5 6 7 5 6 (its last two occur twice)
    again = d.propose(context, 4, ROOM)
    assert again.tokens.tolist()[0] == 8  # the later "5 6", the one at or after where the last draft ended
    d.commit(_verdict(0))
    off = d.propose(torch.tensor([1, 2, 3, 5, 6, 7, 5, 6, 4, 4]), 4, ROOM)
    assert off.tokens.numel() == 0 and d.proposed == first.tokens.numel() and d.accepted == 3


def test_usage_counts_the_prediction_tokens_the_answer_took():
    """OpenAI's ``accepted_prediction_tokens``: each accepted draft token, plus the round's own target
    token where the prediction has it next; ``rejected_prediction_tokens``: the rest of the prediction.
    A prediction position taken twice (an n-gram met again) counts once; ``prepare`` starts afresh."""
    predicted = [5, 6, 7, 8, 9, 10, 11, 12]
    d = Predicted(predicted)
    prompt = torch.tensor([1, 2])
    d.prepare(prompt)
    first = d.propose(prompt, 3, ROOM)
    n = first.tokens.numel()
    d.commit(Verdict(num_accepted=n, tokens=torch.tensor(predicted[:n + 1])))  # all kept, the target's token is the next one
    assert d.taken() == (n + 1, len(predicted) - n - 1)
    d.propose(torch.tensor([1, 2, *predicted[:n + 1]]), 2, ROOM)
    d.commit(Verdict(num_accepted=0, tokens=torch.tensor([99])))  # turned down at once, the target's token is elsewhere
    assert d.taken() == (n + 1, len(predicted) - n - 1)
    d.prepare(prompt)
    d.propose(prompt, 3, ROOM)
    d.commit(Verdict(num_accepted=1, tokens=torch.tensor([5, 7])))  # one kept; the target's token skips the prediction's 6
    assert d.taken() == (1, len(predicted) - 1)
    d.propose(torch.tensor([1, 2, 5, 7]), 3, ROOM)  # nothing found for "5 7": not a prediction round
    d.prepare(prompt)
    d.propose(prompt, 3, ROOM)
    d.commit(Verdict(num_accepted=2, tokens=torch.tensor([5, 6, 7])))
    d.propose(torch.tensor([1, 2, 5, 6, 7, 5, 6]), 3, ROOM)  # the answer repeats "5 6": drafted from 7 again
    d.commit(Verdict(num_accepted=1, tokens=torch.tensor([7, 8])))
    assert d.taken() == (4, len(predicted) - 4)  # positions 0-3, position 2 taken twice


class Inner:
    """A drafter behind the prediction that records what it is handed, asked and told (a model
    draft's: its drafts are not free, and it drafts trees too)."""

    free = False
    supports_trees = True

    def __init__(self) -> None:
        self.calls, self.commits, self.resets = 0, 0, 0
        self.prepared: list[list[int]] = []

    def prepare(self, prompt) -> None:  # noqa: ANN001
        self.prepared.append(prompt.tolist())

    def reset(self) -> None:
        self.resets += 1

    def propose(self, context, gamma, sampler):  # noqa: ANN001, ANN201
        self.calls += 1
        return SimpleNamespace(tokens=torch.tensor([42]), probs=None, free=self.free)

    def propose_tree(self, context, budget, sampler, spec, *, max_depth):  # noqa: ANN001, ANN201
        return self.propose(context, budget, sampler)

    def commit(self, verdict) -> None:  # noqa: ANN001
        self.commits += 1


class FreeInner(Inner):
    """Prompt lookup's shape behind the prediction: free drafts, a catch-up pass, and told the
    outcomes of its free rounds."""

    free = free_drafts = True
    catch_up_s = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.free_updates: list[dict] = []

    def update_free(self, **kw) -> None:  # noqa: ANN003
        self.free_updates.append(kw)


def test_the_inner_drafter_drafts_where_the_prediction_has_nothing():
    inner = Inner()
    d = Predicted([5, 6], inner)
    d.prepare(torch.tensor([1]))
    d.propose(torch.tensor([1]), 2, ROOM)
    d.commit(_verdict(2))  # the prediction's round: the inner drafter is not told
    assert inner.calls == 0 and inner.commits == 0
    assert d.propose(torch.tensor([1, 5, 6, 3]), 2, ROOM).tokens.tolist() == [42]
    d.commit(_verdict(1))
    assert inner.calls == 1 and inner.commits == 1
    assert d.propose(torch.tensor([1, 5, 6, 3, 4]), 0, ROOM).tokens.numel() == 0  # γ 0: the inner drafter is not asked
    assert inner.calls == 1


def test_the_request_field_is_read_as_openai_sends_it():
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    tok = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    whole = predicted_ids(tok, {"type": "content", "content": "def add(a, b):"})
    parts = predicted_ids(tok, {"type": "content", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]})
    assert whole == parts == tok.encode("def add(a, b):", add_special_tokens=False)
    for bad in ({"type": "text", "content": "x"}, {"type": "content", "content": 3}, {"type": "content", "content": [{"text": "x"}]}):
        try:
            predicted_ids(tok, bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")


def test_the_longest_matching_ngram_decides_where_the_answer_goes_on():
    """The answer ends "1 2 3": the prediction goes on after its "1 2 3" (9), not after the first
    "2 3" (8) a shorter n-gram would find."""
    d = Predicted([4, 2, 3, 8, 1, 2, 3, 9])
    d.prepare(torch.tensor([0]))
    assert d.propose(torch.tensor([0, 1, 2, 3]), 4, ROOM).tokens.tolist()[0] == 9


def test_an_occurrence_ending_where_the_last_draft_left_off_counts_as_at_or_after_it():
    """Two drafts kept of the prediction 5 6 7 5 6 8 (it left off at 2); the answer then ends "5 6":
    the occurrence ending at 2 is "at" where it left off, so the draft goes on with 7."""
    d = Predicted([5, 6, 7, 5, 6, 8])
    prompt = torch.tensor([1])
    d.prepare(prompt)
    d.propose(prompt, 4, ROOM)
    d.commit(Verdict(num_accepted=2, tokens=torch.tensor([5, 6, 9])))
    assert d.propose(torch.tensor([1, 5, 6, 9, 5, 6]), 4, ROOM).tokens.tolist()[0] == 7


def test_an_ngram_met_only_before_the_last_draft_is_still_followed():
    """The answer left the prediction and came back to an n-gram found only before where the last
    draft left off, and the prediction's last tokens repeat it with nothing after: the draft goes
    on from the earlier occurrence (anywhere), not from the end (nothing)."""
    d = Predicted([5, 6, 7, 5, 6])
    prompt = torch.tensor([1])
    d.prepare(prompt)
    d.propose(prompt, 4, ROOM)
    d.commit(Verdict(num_accepted=3, tokens=torch.tensor([5, 6, 7, 9])))
    assert d.propose(torch.tensor([1, 5, 6, 7, 9, 5, 6]), 4, ROOM).tokens.tolist()[:1] == [7]


def test_a_prediction_draft_keeps_within_the_room_and_gamma():
    """The server's room (or γ where there is no cap) bounds the prediction draft; room 0 or γ 0
    proposes nothing; a tree round drafts a chain no deeper than ``max_depth``."""
    d = Predicted(list(range(10, 30)))
    prompt = torch.tensor([1])
    d.prepare(prompt)
    assert d.propose(prompt, 4, SimpleNamespace(room=2)).tokens.numel() == 2
    assert d.propose(prompt, 1, ROOM).tokens.numel() == 1
    assert d.propose(prompt, 4, SimpleNamespace(room=0)).tokens.numel() == 0
    assert d.propose(prompt, 0, ROOM).tokens.numel() == 0
    assert d.propose_tree(prompt, 10, ROOM, None, max_depth=2).tokens.tolist() == [10, 11]


def test_a_free_drafter_behind_the_prediction_is_asked_at_gamma_zero_and_learns_its_rounds():
    """Prompt lookup behind the prediction (free drafts, ``update_free``): asked even at γ 0 where
    the prediction has nothing, told its own free rounds' outcomes, and its catch-up time is
    charged only in its own rounds; the wrapper's drafts are all free."""
    inner = FreeInner()
    d = Predicted([5, 6], inner)
    assert d.free_drafts
    d.prepare(torch.tensor([1]))
    d.propose(torch.tensor([1]), 2, ROOM)  # a prediction round
    assert d.catch_up_s == 0.0
    d.commit(Verdict(num_accepted=2, tokens=torch.tensor([5, 6, 3])))
    d.update_free(gamma=2, accepted=2, draft_s=0.0, target_s=0.01, other_s=0.0)
    assert inner.free_updates == [] and d.proposed == 2
    assert d.propose(torch.tensor([1, 5, 6, 3, 4]), 0, ROOM).tokens.tolist() == [42] and inner.calls == 1
    assert d.catch_up_s == 0.5
    d.update_free(gamma=1, accepted=0, draft_s=0.0, target_s=0.01, other_s=0.0)
    assert [u["gamma"] for u in inner.free_updates] == [1] and d.proposed == 2


def test_the_inner_drafter_is_prepared_with_the_prompt():
    inner = Inner()
    d = Predicted([5, 6], inner)
    d.prepare(torch.tensor([1, 2, 3]))
    assert inner.prepared == [[1, 2, 3]]


def test_a_tree_round_of_the_inner_drafter_is_committed_to_it():
    """Where the prediction has nothing, a tree round is the inner drafter's: its verdict goes to it
    (else its cache keeps the round's rejected nodes)."""
    inner = Inner()
    d = Predicted([5, 6], inner)
    d.prepare(torch.tensor([1]))
    d.propose_tree(torch.tensor([1, 9, 9]), 4, ROOM, None, max_depth=3)  # "9 9" is not in the prediction
    d.commit(Verdict(num_accepted=0, tokens=torch.tensor([3])))
    assert inner.commits == 1


def test_a_prediction_round_proposes_at_least_one_token():
    """Its length controller at 0 still drafts one prediction token (a probe that costs no model step)."""
    d = Predicted([5, 6, 7])
    d.prepare(torch.tensor([1]))
    d.length = FixedGamma(0)
    assert d.propose(torch.tensor([1]), 4, ROOM).tokens.tolist() == [5]


def test_reset_forgets_the_last_sequences_progress():
    """``reset`` (no prompt): nothing of the prediction taken yet, and the answer starts at 0."""
    inner = Inner()
    d = Predicted([5, 6, 7, 8], inner)
    d.prepare(torch.tensor([1, 2]))
    d.propose(torch.tensor([1, 2]), 2, ROOM)
    d.commit(Verdict(num_accepted=2, tokens=torch.tensor([5, 6, 7])))
    assert d.taken() == (3, 1)
    d.reset()
    assert inner.resets == 1 and d.taken() == (0, 4)
    assert d.propose(torch.tensor([5, 6]), 1, ROOM).tokens.tolist() == [7]  # "5 6" is the answer itself now


def test_trees_and_free_drafts_without_a_drafter_behind_the_prediction():
    """No inner drafter: no trees (chains only), and every round is free."""
    d = Predicted([5, 6])
    assert d.supports_trees is False and d.free_drafts is True
    assert Predicted([5, 6], Inner()).supports_trees is True


class _BosTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_the_prediction_is_encoded_without_special_tokens():
    """A tokenizer that adds a BOS: the prediction's ids are its text alone (a BOS would never match the answer)."""
    assert predicted_ids(_BosTokenizer(), {"type": "content", "content": "ab"}) == [97, 98]
    assert predicted_ids(_BosTokenizer(), {"type": "content", "content": ""}) == []


def test_a_round_the_inner_drafter_sat_out_is_not_committed_to_it():
    """γ 0 where the prediction has nothing: a model draft behind it is not asked, so the round's
    verdict is not its to commit (its cache holds nothing of that round)."""
    inner = Inner()
    inner.propose = lambda *a: pytest.fail("asked at γ 0")  # noqa: E731
    d = Predicted([5, 6], inner)
    d.prepare(torch.tensor([1]))
    assert d.propose(torch.tensor([1, 9, 9]), 0, ROOM).tokens.numel() == 0
    d.commit(Verdict(num_accepted=0, tokens=torch.tensor([3])))
    assert inner.commits == 0


def test_a_four_token_match_outranks_an_earlier_three_token_one():
    """The answer ends "1 2 3 4": the prediction goes on after its "1 2 3 4" (8), not after the first
    "2 3 4" (7): n-grams up to four tokens long are looked up, longest first."""
    d = Predicted([9, 2, 3, 4, 7, 1, 2, 3, 4, 8])
    d.prepare(torch.tensor([0]))
    assert d.propose(torch.tensor([0, 1, 2, 3, 4]), 4, ROOM).tokens.tolist()[0] == 8


def test_the_prediction_length_controller_learns_each_rounds_acceptance():
    """Ten prediction rounds all turned down at once (γ 4 each): the controller's estimate that a
    prediction draft's first token is kept falls well below even odds (deterministic, 10 rounds)."""
    d = Predicted(list(range(10, 30)))
    d.prepare(torch.tensor([1]))
    for _ in range(10):
        draft = d.propose(torch.tensor([1]), 4, ROOM)
        d.commit(Verdict(num_accepted=0, tokens=torch.tensor([99])))
        d.update_free(gamma=draft.tokens.numel(), accepted=0, draft_s=0.0, target_s=0.01, other_s=0.0)
    assert d.length.accept_profile()[0] < 0.5


def test_the_next_draft_starts_after_the_target_token_the_prediction_had_next():
    """Prediction 7 8 7 7 7 7 7 7 8; the answer so far 8 7 follows it at position 3; four drafts
    (7 7 7 7) are kept and the target's own token is 7, the prediction's next one too: the answer
    has taken positions 1 .. 7, so the prediction goes on with its 8 (position 8), not with
    another 7 (position 7, which the answer has already taken)."""
    d = Predicted([7, 8, 7, 7, 7, 7, 7, 7, 8])
    d.prepare(torch.tensor([1]))
    first = d.propose(torch.tensor([1, 8, 7]), 4, ROOM)
    assert first.tokens.tolist() == [7, 7, 7, 7]
    d.commit(Verdict(num_accepted=4, tokens=torch.tensor([7, 7, 7, 7, 7])))
    assert d.taken()[0] == 5  # positions 3 .. 7 taken, the target's token included
    assert d.propose(torch.tensor([1, 8, 7, 7, 7, 7, 7, 7]), 4, ROOM).tokens.tolist()[0] == 8


def test_an_ngram_met_only_before_the_last_draft_goes_on_from_its_latest_occurrence():
    """Prediction 5 6 1 5 6 2 9 9 9 9: the answer took its first eight tokens, left it (7) and came
    back with "5 6", which occurs only before where it left off (ending at 2 and at 5): the draft
    goes on from the latest of them (2, after position 5), the nearest to where the answer was."""
    predicted = [5, 6, 1, 5, 6, 2, 9, 9, 9, 9]
    d = Predicted(predicted)
    prompt = torch.tensor([0])
    d.prepare(prompt)
    d.length = FixedGamma(8)
    assert d.propose(prompt, 8, ROOM).tokens.tolist() == predicted[:8]
    d.commit(Verdict(num_accepted=8, tokens=torch.tensor(predicted[:8] + [7])))
    assert d.taken()[0] == 8
    assert d.propose(torch.tensor([0, *predicted[:8], 7, 5, 6]), 4, ROOM).tokens.tolist()[0] == 2


class _CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize("part", [{"type": "text", "text": 3}, {"type": "text", "text": None}, {"type": "text"}])
def test_a_content_part_whose_text_is_not_a_string_is_a_value_error(part):
    """A part ``{"type": "text"}`` whose ``text`` is missing or not a string is refused with the
    ValueError naming the parts' shape (the server's 400), not a TypeError from joining them."""
    with pytest.raises(ValueError, match="content parts"):
        predicted_ids(_CharTokenizer(), {"type": "content", "content": [{"type": "text", "text": "a"}, part]})


def test_before_any_prediction_round_the_answer_is_at_the_predictions_start():
    """No prediction round yet (the first rounds had no room for free drafts) and the answer so far
    is "5 6", which the prediction 5 6 1 5 6 2 holds twice: the draft goes on from the first
    occurrence (1), where an answer that has used nothing of the prediction yet stands, whatever
    the prompt's length (4 here: not a position in the prediction)."""
    d = Predicted([5, 6, 1, 5, 6, 2])
    prompt = torch.tensor([0, 0, 0, 0])
    d.prepare(prompt)
    assert d.propose(prompt, 4, SimpleNamespace(room=0)).tokens.numel() == 0  # a busy server's round
    d.commit(Verdict(num_accepted=0, tokens=torch.tensor([5])))
    assert d.propose(torch.tensor([0, 0, 0, 0, 5, 6]), 4, ROOM).tokens.tolist()[0] == 1
