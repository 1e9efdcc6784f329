"""The wire protocol's own validation (no server needed)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from specdec import defaults
from specdec.remote.protocol import (
    MAX_SEQ,
    MAX_TOKEN_ID,
    ROW_SUM_SLACK,
    CreateSessionRequest,
    CreateSessionResponse,
    SparseRow,
    VerifyRequest,
    default_wire,
    wire_method,
)


def test_valid_bodies_parse():
    req = VerifyRequest.model_validate({"seq": 3, "draft_tokens": [1, 2], "q": [{"ids": [1, 5], "probs": [0.75, 0.25]}, {"ids": [2], "probs": [1.0]}]})
    assert isinstance(req.q[0], SparseRow) and req.q[1].probs == [1.0]
    scalar = VerifyRequest.model_validate({"seq": 0, "draft_tokens": [4], "q": [0.3]})
    assert scalar.q == [0.3]
    assert VerifyRequest.model_validate_json('{"seq": 0}').draft_tokens == []
    create = CreateSessionRequest.model_validate({"prompt_ids": [1, 2], "temperature": 0.7, "seed": 5, "wire": "sparse-q", "method": "token"})
    assert create.top_p is None and create.generated_ids == []


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"seq": -1, "draft_tokens": [1]}, "greater than or equal to 0"),
        ({"seq": 0, "draft_tokens": [-2]}, "greater than or equal to 0"),
        ({"seq": 0, "draft_tokens": [1.5]}, "valid integer"),
        ({"seq": 0, "draft_tokens": ["1"]}, "valid integer"),
        ({"seq": 0, "draft_tokens": list(range(defaults.MAX_GAMMA + 1))}, "at most"),
        ({"seq": 0, "draft_tokens": [1], "q": [math.nan]}, "finite"),
        ({"seq": 0, "draft_tokens": [1], "q": [-0.1]}, "greater than or equal to 0"),
        ({"seq": 0, "draft_tokens": [1], "q": [1.5]}, "less than or equal to"),
        ({"seq": 0, "draft_tokens": [1], "q": [0.0]}, "q = 0"),
        ({"seq": 0, "draft_tokens": [1, 2], "q": [0.5]}, "1 rows but there are 2"),
        ({"seq": 0, "draft_tokens": [1], "q": [{"ids": [1, 2], "probs": [0.7, 0.4]}]}, "sums to"),
        ({"seq": 0, "draft_tokens": [1], "q": [{"ids": [1, 1], "probs": [0.5, 0.5]}]}, "repeats"),
        ({"seq": 0, "draft_tokens": [1], "q": [{"ids": [1, 2], "probs": [0.5]}]}, "2 ids but 1 probs"),
        ({"seq": 0, "draft_tokens": [1], "q": [{"ids": [2], "probs": [1.0]}]}, "q = 0"),
        ({"seq": 0, "draft_tokens": [1], "q": [{"ids": [1], "probs": [math.inf]}]}, "finite"),
        ({"seq": 0, "draft_tokens": [1], "q": "0.5"}, "must be a list"),
        ({"seq": 0, "draft_tokens": [1], "extra": 1}, "Extra inputs"),
    ],
)
def test_bad_verify_bodies_are_rejected_with_a_reason(body, fragment):
    with pytest.raises(ValidationError) as err:
        VerifyRequest.model_validate(body)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({}, "exactly one of"),
        ({"prompt": "hi", "prompt_ids": [1]}, "exactly one of"),
        ({"prompt": "   "}, "empty"),
        ({"prompt_ids": []}, "at least 1"),
        ({"prompt_ids": [1], "temperature": -1.0}, "greater than or equal to 0"),
        ({"prompt_ids": [1], "temperature": math.nan}, "finite"),
        ({"prompt_ids": [1], "top_p": 0.0}, "greater than 0"),
        ({"prompt_ids": [1], "wire": "carrier-pigeon"}, "wire"),
        ({"prompt_ids": [1], "wire": "greedy", "temperature": 1.0}, "temperature 0"),
        ({"prompt_ids": [1], "wire": "coupled", "method": "block"}, "not available in wire mode"),
        ({"prompt_ids": [1], "wire": "lossy-scalar", "method": "block"}, "not available in wire mode"),
        ({"prompt_ids": [1], "seed": -5}, "greater than or equal to 0"),
    ],
)
def test_bad_session_bodies_are_rejected_with_a_reason(body, fragment):
    with pytest.raises(ValidationError) as err:
        CreateSessionRequest.model_validate(body)
    assert fragment in str(err.value)


def test_wire_defaults():
    assert default_wire(0.0) == "greedy" and default_wire(0.8) == "coupled"
    assert wire_method("sparse-q", None) == "block"
    assert wire_method("sparse-q", "token") == "token"
    assert wire_method("lossy-scalar", None) == "lossy_resample_p"
    assert wire_method("lossy-scalar", "lossy-strict-residual") == "lossy_strict_residual"
    with pytest.raises(ValueError, match="not available"):
        wire_method("greedy", "block")


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"seq": 0, "draft_tokens": [1, 2], "parents": [-1, 1]}, "earlier draft token"),  # its own parent
        ({"seq": 0, "draft_tokens": [1], "parents": [0]}, "earlier draft token"),
        ({"seq": 0, "draft_tokens": [1], "q": [{"ids": [1, 2], "probs": [0.5, 0.5 + 2 * ROW_SUM_SLACK]}]}, "sums to"),
    ],
)
def test_bad_verify_bodies_at_the_edge_are_rejected(body, fragment):
    with pytest.raises(ValidationError) as err:
        VerifyRequest.model_validate(body)
    assert fragment in str(err.value)


def test_a_row_within_the_slack_and_sparse_row_objects_parse():
    ok = VerifyRequest.model_validate({"seq": 0, "draft_tokens": [1], "q": [{"ids": [1, 2], "probs": [0.5, 0.5 + ROW_SUM_SLACK / 2]}]})
    assert isinstance(ok.q[0], SparseRow)
    # built in Python with SparseRow objects (as a Python edge may): still rows, not scalars
    req = VerifyRequest(seq=0, draft_tokens=[1, 2], q=[SparseRow(ids=[1], probs=[1.0]), SparseRow(ids=[2, 3], probs=[0.5, 0.5])])
    assert all(isinstance(row, SparseRow) for row in req.q)
    assert VerifyRequest.model_validate_json(req.model_dump_json()) == req


def test_generated_ids_need_prompt_ids():
    with pytest.raises(ValidationError) as err:
        CreateSessionRequest.model_validate({"prompt": "hello", "generated_ids": [1, 2]})
    assert "'generated_ids' needs 'prompt_ids'" in str(err.value)
    assert CreateSessionRequest.model_validate({"prompt_ids": [3], "generated_ids": [1, 2]}).generated_ids == [1, 2]


@pytest.mark.parametrize(
    "body, fragment",
    [
        # a tree needs one parent per draft token: fewer parents than tokens is refused too
        ({"seq": 0, "draft_tokens": [1, 2], "parents": [-1]}, "1 parents for 2 draft tokens"),
        # -1 is the only parent below 0 (the last committed token)
        ({"seq": 0, "draft_tokens": [1], "parents": [-2]}, "greater than or equal to -1"),
        # q rows with no draft tokens are as wrong as a missing row
        ({"seq": 0, "draft_tokens": [], "q": [0.5]}, "1 rows but there are 0"),
        ({"seq": 0, "draft_tokens": [], "q": [{"ids": [1], "probs": [1.0]}]}, "1 rows but there are 0"),
    ],
)
def test_more_bad_verify_bodies_are_rejected(body, fragment):
    with pytest.raises(ValidationError) as err:
        VerifyRequest.model_validate(body)
    assert fragment in str(err.value)


def test_unverified_tokens_are_bounded():
    bound = defaults.MAX_GAMMA * 8
    assert len(VerifyRequest.model_validate({"seq": 0, "unverified_tokens": [1] * bound}).unverified_tokens) == bound
    with pytest.raises(ValidationError, match="at most"):
        VerifyRequest.model_validate({"seq": 0, "unverified_tokens": [1] * (bound + 1)})


def test_a_full_tree_of_max_tree_nodes_parses():
    n = defaults.MAX_TREE_NODES
    req = VerifyRequest.model_validate({"seq": 0, "draft_tokens": [1] * n, "parents": [-1] * n})
    assert len(req.parents) == n


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"prompt_ids": [1], "logprobs": 21}, "less than or equal to 20"),
        ({"prompt_ids": [1], "top_k": 0}, "greater than or equal to 1"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, "greater than or equal to 1"),
        # the digest is lower-case hex (as hashlib's hexdigest writes it)
        ({"prompt_ids": [1], "vocab_digest": "A" * 64}, "pattern"),
        # an empty allow list or an empty bad word is a mistake, not "nothing" / "no word"
        ({"prompt_ids": [1], "allowed_token_ids": []}, "at least 1"),
        ({"prompt_ids": [1], "bad_token_ids": [[]]}, "at least 1"),
        # JSON integers only, as everywhere else
        ({"prompt_ids": [1], "min_tokens": "5"}, "valid integer"),
        ({"prompt_ids": [1], "seed": defaults.MAX_SEED + 1}, "less than or equal to"),
    ],
)
def test_more_bad_session_bodies_are_rejected(body, fragment):
    with pytest.raises(ValidationError) as err:
        CreateSessionRequest.model_validate(body)
    assert fragment in str(err.value)


def test_the_bounds_themselves_parse():
    ok = CreateSessionRequest.model_validate(
        {"prompt_ids": [1], "logprobs": 20, "top_k": 1, "max_new_tokens": 1, "vocab_digest": "0a" * 32}
    )
    assert ok.logprobs == 20 and ok.top_k == 1 and ok.max_new_tokens == 1


def test_method_names_are_trimmed_and_case_insensitive():
    assert wire_method("sparse-q", " Token ") == "token"


def test_default_wire_is_greedy_only_at_exactly_zero():
    assert default_wire(1e-9) == "coupled"


@pytest.mark.parametrize("body", [
    {"seq": 0, "draft_tokens": [1], "q": [{"ids": [1, 2], "probs": [0.5, 0.502]}]},  # 1.002 > 1 + slack
    {"seq": MAX_SEQ + 1},
    {"seq": 0, "draft_tokens": [MAX_TOKEN_ID + 1]},
    {"seq": 0, "draft_tokens": [1], "siblings": "bogus"},
])
def test_verify_bodies_past_other_bounds_are_rejected(body):
    with pytest.raises(ValidationError):
        VerifyRequest.model_validate(body)


@pytest.mark.parametrize("extra", [
    {"repetition_penalty": 0.0},
    {"chat": "true"},  # JSON booleans only
    {"chat": 1},
    {"vocab_digest": "ab"},  # a SHA-256 hex digest is 64 characters
    {"grammar": ""},
    {"min_p": 1.5},
    {"temperature": 1e5},
    {"floor_ids": [1] * 1025},
])
def test_session_bodies_past_other_bounds_are_rejected(extra):
    with pytest.raises(ValidationError):
        CreateSessionRequest.model_validate({"prompt_ids": [1], **extra})


def test_logprobs_zero_means_the_chosen_token_only():
    assert CreateSessionRequest.model_validate({"prompt_ids": [1], "logprobs": 0}).logprobs == 0


def test_bodies_are_frozen():
    req = VerifyRequest.model_validate({"seq": 0})
    with pytest.raises(ValidationError):
        req.seq = 1


def test_a_create_reply_without_cached_prompt_tokens_parses():
    """An older server's reply (no cached_prompt_tokens) still parses, as 0."""
    body = {"session_id": "s", "model": "m", "wire": "greedy", "method": "greedy", "lossless": True, "seed": 0,
            "vocab_size": 4, "max_context": 8, "max_length": 8, "max_gamma": 4, "prompt_ids": [1], "prefill_ms": 0.0}
    assert CreateSessionResponse.model_validate(body).cached_prompt_tokens == 0


def test_an_empty_method_is_refused_not_taken_as_the_default():
    """method "" is a mistake (a 400 naming the choices), not "use the mode's default" (null does that)."""
    with pytest.raises(ValueError, match="not available"):
        wire_method("sparse-q", "")


def test_a_q_row_with_more_probs_than_ids_is_refused():
    with pytest.raises(ValidationError, match="1 ids but 2 probs"):
        VerifyRequest.model_validate({"seq": 0, "draft_tokens": [1], "q": [{"ids": [1], "probs": [0.5, 0.5]}]})


def test_generated_ids_are_bounded_like_the_prompt():
    from specdec.remote.protocol import MAX_PROMPT_TOKENS

    with pytest.raises(ValidationError, match="at most"):
        CreateSessionRequest.model_validate({"prompt_ids": [1], "generated_ids": [1] * (MAX_PROMPT_TOKENS + 1)})


def test_a_scalar_q_within_the_row_slack_parses():
    """A lossy-scalar q may exceed 1 by the same float32 slack as a sparse row (a renormalised top-1)."""
    req = VerifyRequest.model_validate({"seq": 0, "draft_tokens": [1], "q": [1.0 + ROW_SUM_SLACK / 2]})
    assert req.q == [1.0 + ROW_SUM_SLACK / 2]


def test_the_draft_tokens_own_probability_is_read_from_its_row_not_the_first_entry():
    """q(x) is looked up at the draft token's id: a row that lists the draft token with probability 0
    (after another id) says it cannot have been sampled, whatever the row's first probability is."""
    body = {"seq": 0, "draft_tokens": [1], "q": [{"ids": [2, 1], "probs": [1.0, 0.0]}]}
    with pytest.raises(ValidationError, match="q = 0"):
        VerifyRequest.model_validate(body)
    ok = VerifyRequest.model_validate({"seq": 0, "draft_tokens": [1], "q": [{"ids": [2, 1], "probs": [0.0, 1.0]}]})
    assert ok.q[0].probs == [0.0, 1.0]


def test_a_row_sum_is_exact_not_a_rounded_running_sum():
    """The row-sum check adds exactly (math.fsum): many tiny probabilities after a row at the bound push
    it over, although a left-to-right float sum would round each of them away (1001 entries)."""
    n = 1000
    probs = [1.0 + ROW_SUM_SLACK] + [1e-17] * n
    assert sum(probs) <= 1.0 + ROW_SUM_SLACK < math.fsum(probs)  # the premise of this test
    with pytest.raises(ValidationError, match="sums to"):
        VerifyRequest.model_validate({"seq": 0, "draft_tokens": [0], "q": [{"ids": list(range(n + 1)), "probs": probs}]})


@pytest.mark.parametrize("extra", [
    {"top_p": 1.5},  # a probability mass
    {"frequency_penalty": 2e4},  # OpenAI-style penalties are bounded like the others
    {"frequency_penalty": -2e4},
    {"presence_penalty": 2e4},
    {"min_tokens": -1},  # a count
    {"logit_bias": [[1, math.nan]]},  # a NaN bias would poison the logits
    {"logit_bias": [[1, math.inf]]},
])
def test_sampling_fields_out_of_range_are_refused(extra):
    with pytest.raises(ValidationError):
        CreateSessionRequest.model_validate({"prompt_ids": [1], **extra})


def test_the_sampling_bounds_themselves_parse():
    ok = CreateSessionRequest.model_validate({"prompt_ids": [1], "top_p": 1.0, "frequency_penalty": -1e4,
                                              "presence_penalty": 1e4, "min_tokens": 0, "logit_bias": [[1, -1e4]]})
    assert ok.top_p == 1.0 and ok.min_tokens == 0
