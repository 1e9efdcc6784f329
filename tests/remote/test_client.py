"""The edge: RemoteVerifier + the local decoding loop against a toy server process.

Exactness over the wire is checked three ways: token-for-token equality with local decoding
(greedy; coupled with the same seed; sparse-q with the same seed, which runs the very same
arithmetic), and a chi-square test of the output law in sparse-q mode with two negative controls.
"""

from __future__ import annotations

import gzip
import json
import time

import httpx
import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters.base import Draft
from specdec.drafters.hybrid import LookupThenModel
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.models.toy import ToyLM
from specdec.remote.client import (RemoteConfig, RemoteError, RemoteStats, RemoteTarget, RemoteVerifier, _error_message,
                                   derived_seed)
from specdec.remote.edge import generate_remote
from specdec.sampling import SamplingConfig
from specdec.token_filter import TokenFilter
from specdec.verify import get_rule
from clock import ModelledCostGamma
from stats import ALPHA, chi_square_pvalue, exact_law
from toy_drafters import FixedDrafter
from toy_server import LetterTokenizer

from .conftest import API_KEY

TARGET = ToyLM(4, order=2, seed=0)  # the server's model
DRAFT = TARGET.perturbed(1.0, seed=1)


def _cfg(url: str, **kw) -> RemoteConfig:
    return RemoteConfig(url=url, api_key=API_KEY, **kw)


def _remote(url: str, prompt: list[int], cfg: SamplingConfig, *, gamma: int = 3, drafter=None, q_top_k=2,
            client: httpx.Client | None = None, **remote_kw):
    return generate_remote(prompt, cfg, _cfg(url, **remote_kw), drafter=drafter or ModelDrafter(DRAFT), gamma=gamma,
                           q_top_k=q_top_k, client=client)


def _local(prompt: list[int], cfg: SamplingConfig, method: str, *, gamma: int = 3, drafter="model", q_top_k=None) -> list[int]:
    d = ModelDrafter(DRAFT) if drafter == "model" else drafter
    dec = SpeculativeDecoder(TARGET, d, get_rule(method), gamma=FixedGamma(gamma), q_top_k=q_top_k)
    return dec.generate(prompt, cfg).tokens


def test_remote_greedy_equals_local_greedy(toy_server):
    with httpx.Client(timeout=60) as client:
        for penalty in (1.0, 1.5):
            cfg = SamplingConfig(temperature=0.0, repetition_penalty=penalty, max_new_tokens=30)
            for prompt in ([1], [2, 3, 0], [3, 3, 1, 0]):
                plain = _local(prompt, cfg, "greedy", drafter=None)
                for gamma in (1, 3, 6):
                    out = _remote(toy_server.url, prompt, cfg, gamma=gamma, client=client)
                    assert out.token_ids == plain
                    assert out.remote["wire"] == "greedy" and out.lossless
                hybrid = LookupThenModel(ModelDrafter(DRAFT))  # DRAFT+lookup on the edge
                assert _remote(toy_server.url, prompt, cfg, gamma=3, drafter=hybrid, client=client).token_ids == plain
                assert hybrid.rounds["lookup"] > 0
    st = out.summary()
    assert st["generated_tokens"] == 30 and st["tokens_per_target_call"] > 1.0
    assert st["cloud_calls_per_token"] == pytest.approx(out.remote["verify_calls"] / 30)
    assert 0 < st["bytes_up"] < out.remote["wire_bytes_up"] and 0 < st["bytes_down"] < out.remote["wire_bytes_down"]
    assert st["rtt_ms"] > 0 and st["cloud_prefill_ms"] > 0 and st["edge_time_ms"] > 0


def test_remote_coupled_equals_local_seeded_sampling(toy_server):
    """Same seed => the same tokens as the target sampling alone, whatever the drafter and γ."""
    with httpx.Client(timeout=60) as client:
        for seed in range(6):
            cfg = SamplingConfig(temperature=1.0, top_p=0.95, repetition_penalty=1.2, seed=seed, max_new_tokens=30)
            plain = _local([1, 2], cfg, "coupled", drafter=None)
            for drafter, gamma in ((ModelDrafter(DRAFT), 2), (ModelDrafter(DRAFT), 5), (NgramDrafter(), 4),
                                   (LookupThenModel(ModelDrafter(DRAFT)), 2)):
                out = _remote(toy_server.url, [1, 2], cfg, gamma=gamma, drafter=drafter, client=client)
                assert out.remote["wire"] == "coupled" and out.token_ids == plain


@pytest.mark.parametrize("method", ["block", "token"])
def test_remote_sparse_q_equals_local_truncated_drafting(toy_server, method):
    """Same seed => the same tokens as local speculative decoding with the same top-k truncation."""
    with httpx.Client(timeout=60) as client:
        for seed in range(12):
            cfg = SamplingConfig(temperature=0.9, min_p=0.05, seed=seed, max_new_tokens=20)
            out = _remote(toy_server.url, [1, 2], cfg, gamma=3, q_top_k=2, wire="sparse-q", method=method, client=client)
            assert out.remote["method"] == method
            assert out.token_ids == _local([1, 2], cfg, method, gamma=3, q_top_k=2)


#: allowed ids and bad words on the toy vocabulary {0, 1, 2, 3}: 3 never; 1 never after 1 or 2
FILTER = TokenFilter(allowed_ids=(0, 1, 2), banned=((1, 1), (2, 1)))


def _obeys(tokens: list[int]) -> bool:
    return 3 not in tokens and all(tokens[i:i + 2] not in ([1, 1], [2, 1]) for i in range(len(tokens)))


def test_remote_bias_min_tokens_and_filters_equal_local(toy_server):
    """logit_bias, min_tokens (over the edge's stop ids) and allowed ids / bad words travel in the
    session body: greedy and coupled edges give the tokens the local target gives alone under the
    same options (same seed), which change them, chains and trees alike."""
    eos = frozenset({0})
    options = dict(logit_bias=((2, 1.5), (0, -1.0)), min_tokens=5, constraint=FILTER)
    changed = 0
    with httpx.Client(timeout=60) as client:
        for temperature, seeds in ((0.0, (0,)), (1.0, range(8))):
            for seed in seeds:
                cfg = SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=24, **options)
                method = "greedy" if temperature == 0 else "coupled"
                plain = SpeculativeDecoder(TARGET, None, get_rule(method), eos_ids=eos).generate([1, 2], cfg).tokens
                free = SpeculativeDecoder(TARGET, None, get_rule(method), eos_ids=eos).generate(
                    [1, 2], SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=24)).tokens
                assert _obeys(plain) and 0 not in plain[:5]
                changed += plain != free
                for tree in ("chain", 4):
                    out = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3,
                                          eos_ids=eos, tree=tree, client=client)
                    assert out.token_ids == plain, (temperature, seed, tree)
    assert changed >= 6


def test_a_constraint_the_wire_cannot_carry_is_refused(toy_server):
    """A constraint the session body cannot carry (neither allowed ids, bad words nor an llguidance
    grammar) is refused before any session exists: verifying without it would give the
    unconstrained target's law."""
    class NoRepeat:
        def allowed(self, generated, vocab_size):
            return torch.ones(vocab_size, dtype=torch.bool)

    for constraint in (NoRepeat(), FILTER.over(NoRepeat())):
        cfg = SamplingConfig(temperature=1.0, seed=1, max_new_tokens=4, constraint=constraint)
        with pytest.raises(ConfigError, match="not NoRepeat: run it locally"):
            generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=2)
    cfg = SamplingConfig(temperature=1.0, seed=1, max_new_tokens=4, constraint=TokenFilter(allowed_ids=(7,)))
    with pytest.raises(RemoteError, match="allowed token 7 is outside the vocabulary"):
        generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=2)


def test_logprobs_over_the_wire_are_the_targets(toy_server):
    """generate_remote(logprobs=K): each token's log-probability and best alternatives come with
    the verdicts, equal to a local target session's (a removed token as -9999.0), chains and trees."""
    from specdec.session import TargetSession

    with httpx.Client(timeout=60) as client:
        for seed, tree in ((0, "chain"), (1, "chain"), (2, 4)):
            cfg = SamplingConfig(temperature=1.0, top_k=3, seed=seed, max_new_tokens=20, constraint=FILTER)
            rule = get_rule("coupled")
            session = TargetSession(TARGET, [1, 2], cfg, rule, seed=seed, logprobs=4)
            local = SpeculativeDecoder(TARGET, None, rule).generate([1, 2], cfg, verifier=session).tokens
            want = [(max(lp, -9999.0), [(i, max(v, -9999.0)) for i, v in top]) for lp, top in session.emitted_logprobs]
            out = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3, tree=tree,
                                  logprobs=4, client=client)
            assert out.token_ids == local and len(out.logprobs) == len(local)
            for (lp, top), (lp_want, top_want) in zip(out.logprobs, want):
                assert lp == pytest.approx(lp_want, abs=1e-6) and [i for i, _ in top] == [i for i, _ in top_want]
                assert [v for _, v in top] == pytest.approx([v for _, v in top_want], abs=1e-6)
            assert any(lp == -9999.0 for _, top in out.logprobs for _, lp in top)  # the filter removed token 3
    with pytest.raises(ConfigError, match="no lossy local commits"):
        RemoteVerifier(_cfg(toy_server.url, lossy_timeout_commit_ms=50), [1, 2], SamplingConfig(seed=1), logprobs=1)


# ----------------------------------------------------------------------------- output law over the wire

#: 2,000 independent generations (seed = index) of 3 tokens from the 4-token order-2 toy target
#: (64 outcomes), each through its own server session, chi-square against the exact law, failing
#: at p < ALPHA = 1e-4.  Measured at this size: sparse-q p = 0.99; the negative controls
#: lossy-scalar p = 3e-39 and misreported sparse q p = 2e-74 (all deterministic: seeded).  The
#: negative controls draw half as many (N_CONTROL), where they still fail far past the threshold
#: (p = 6e-22 and 5e-38): failing with fewer samples is the stronger result.
N_LAW = 2000
N_CONTROL = 1000
LAW_CFG = SamplingConfig(temperature=1.0, max_new_tokens=3)


class _MisreportedQ(RemoteVerifier):
    """A broken edge: samples from its top-2 q but reports both ids as equally likely."""

    def _q_payload(self, draft):
        rows = super()._q_payload(draft)
        return [{"ids": r["ids"], "probs": [1.0 / len(r["ids"])] * len(r["ids"])} for r in rows] if rows else rows


def _law_samples(url: str, wire: str, *, q_top_k: int | None, verifier_cls=RemoteVerifier,
                 n: int = N_LAW) -> list[tuple[int, ...]]:
    out = []
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            cfg = SamplingConfig(temperature=1.0, seed=i, max_new_tokens=3)
            v = verifier_cls(_cfg(url, wire=wire), [1, 2], cfg, client=client)
            dec = SpeculativeDecoder(RemoteTarget(4, v.max_context), ModelDrafter(DRAFT), v.rule, gamma=FixedGamma(2),
                                     q_top_k=q_top_k)
            out.append(tuple(dec.generate([1, 2], cfg, verifier=v).tokens))  # no DELETE: the server's LRU drops it
    return out


def test_sparse_q_output_law_matches_the_target(toy_server):
    law = exact_law(TARGET, [1, 2], LAW_CFG, 3)
    assert chi_square_pvalue(_law_samples(toy_server.url, "sparse-q", q_top_k=2), law) > ALPHA


def test_negative_controls_the_law_test_catches_a_wrong_q(toy_server):
    """The scalar-q protocol, and a sparse q that misreports the draft's distribution."""
    law = exact_law(TARGET, [1, 2], LAW_CFG, 3)
    assert chi_square_pvalue(_law_samples(toy_server.url, "lossy-scalar", q_top_k=None, n=N_CONTROL), law) < ALPHA
    assert chi_square_pvalue(_law_samples(toy_server.url, "sparse-q", q_top_k=2, verifier_cls=_MisreportedQ,
                                          n=N_CONTROL), law) < ALPHA


# ----------------------------------------------------------------------------- failures


class _Flaky(httpx.HTTPTransport):
    """Loses the response of every ``every``-th verify call (the server did process it)."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every
        self.calls = 0
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/verify"):
            self.calls += 1
            if self.calls % self.every == 0:
                response.read()
                self.lost += 1
                raise httpx.ReadTimeout("response lost", request=request)
        return response


def test_a_lost_response_is_retried_with_the_same_seq(toy_server):
    cfg = SamplingConfig(temperature=1.0, seed=5, max_new_tokens=40)
    transport = _Flaky(every=3)
    with httpx.Client(transport=transport, timeout=60) as client:
        out = _remote(toy_server.url, [1, 2], cfg, gamma=3, client=client, wire="sparse-q")
    assert transport.lost >= 3 and out.remote["retries"] == transport.lost
    # the server answered each retry from its stored verdict, so the run is the undisturbed one
    assert out.token_ids == _local([1, 2], cfg, "block", gamma=3, q_top_k=2)
    assert out.remote["verify_calls"] == out.stats.target_calls and out.lossless


def test_server_killed_and_restarted_mid_session(toy_server):
    """Killed right after a 1 was committed: the re-created session must count what was committed as
    generated (penalties, and the bad words' history: no 1 may follow that 1)."""
    from serverproc import ServerProcess

    cfg = SamplingConfig(temperature=1.0, top_k=3, frequency_penalty=0.3, seed=9, max_new_tokens=120,
                         constraint=TokenFilter(banned=((1, 1), (1, 2))))
    srv = ServerProcess.toy("--api-key", API_KEY, "--vocab", "4", "--order", "2", "--seed", "0").start()
    restarted = []

    def crash(tokens: list[int]) -> None:
        seen.extend(tokens)
        if len(seen) >= 30 and seen[-1] == 1 and not restarted:
            srv.kill()
            srv.start(wait=False)  # the edge's retries wait for it
            restarted.append(len(seen))

    seen: list[int] = []
    try:
        out = generate_remote([1, 2], cfg, _cfg(srv.url), drafter=ModelDrafter(DRAFT), gamma=3, on_tokens=crash)
    finally:
        srv.stop()
    assert restarted and out.remote["session_recreates"] >= 1 and out.remote["retries"] >= 1
    assert out.token_ids == _local([1, 2], cfg, "coupled", drafter=None)  # = the uninterrupted run
    assert out.lossless and len(out.token_ids) == 120


class _Slow(httpx.HTTPTransport):
    """The cloud does not answer verify calls number ``slow`` (1-based) before the client's read timeout."""

    def __init__(self, slow: set[int]) -> None:
        super().__init__()
        self.slow = slow
        self.calls = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/verify"):
            self.calls += 1
            if self.calls in self.slow:
                time.sleep(float(request.extensions["timeout"]["read"]))
                raise httpx.ReadTimeout("no answer in time", request=request)
        return super().handle_request(request)


def test_lossy_timeout_fallback_commits_the_first_draft_token_and_is_counted(toy_server):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    with httpx.Client(transport=_Slow({2, 5}), timeout=60) as client:
        # 1.5 s: the deadline bounds every verify call, and on a loaded test machine a toy server's
        # answer can take more than the 0.3 s this test used to allow
        out = _remote(toy_server.url, [1, 2], cfg, gamma=4, client=client, lossy_timeout_commit_ms=1500)
    r = out.remote
    assert r["timeout_commits"] == 2 and r["unverified_tokens"] == 2
    assert r["session_creates"] == 3  # the session is re-synced after each fallback
    assert not out.lossless and out.summary()["lossless"] is False and "lossy_timeout_commit" in r["lossy_options"]
    assert len(out.token_ids) == 40
    # without the fallback the same slow calls are simply retried: exact output
    with httpx.Client(transport=_Slow({2, 5}), timeout=60) as client:
        out = _remote(toy_server.url, [1, 2], cfg, gamma=4, client=client, timeout_s=0.1)
    assert out.lossless and out.token_ids == _local([1, 2], cfg, "greedy", drafter=None)


def test_lossy_local_commit_travels_to_the_server_and_is_counted(toy_server):
    from specdec.remote.gating import Gate, GateConfig

    gate = Gate(GateConfig(policy="lossy-local-commit", t_entropy_bits=None, t_margin=None, rules=frozenset(), max_local_rounds=2))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    out = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3, gate=gate)
    r = out.remote
    assert r["local_commits"] > 0 and r["unverified_tokens"] == 3 * r["local_commits"] and not out.lossless
    assert out.gate["local_commits"] == r["local_commits"] and out.gate["lossless"] is False
    assert len(out.token_ids) == 40  # every cloud round agreed with the edge's context (checked per round)


def test_errors_are_one_line_messages(toy_server):
    cfg = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=5)
    with pytest.raises(RemoteError, match="HTTP 401: missing or invalid API key"):
        RemoteVerifier(RemoteConfig(url=toy_server.url, api_key="wrong"), [1], cfg)
    with pytest.raises(RemoteError, match="outside the vocabulary"):
        RemoteVerifier(_cfg(toy_server.url), [9], cfg)
    with pytest.raises(ConfigError, match="temperature 0"):
        RemoteVerifier(_cfg(toy_server.url, wire="greedy"), [1], SamplingConfig(temperature=1.0, seed=1))
    with pytest.raises(ConfigError, match="not available in wire mode"):
        RemoteVerifier(_cfg(toy_server.url, wire="coupled", method="block"), [1], SamplingConfig(temperature=1.0, seed=1))
    with pytest.raises(ConfigError, match="http://"):
        RemoteConfig(url="ftp://x")
    from serverproc import free_port

    with pytest.raises(RemoteError, match="cannot connect to .* is `specdec serve` running there"):
        RemoteVerifier(RemoteConfig(url=f"http://127.0.0.1:{free_port()}", retry_budget_s=0.3), [1], cfg)


def test_an_openai_style_base_url_reaches_the_session_api(toy_server):
    """``--remote http://host:port/v1`` (how OpenAI clients spell a server) drafts against the same
    session API as ``http://host:port``, not ``/v1/v1/sessions``."""
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=6)
    a = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=2)
    b = generate_remote([1, 2], cfg, _cfg(toy_server.url + "/v1/"), drafter=ModelDrafter(DRAFT), gamma=2)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6


def test_a_refused_first_connection_fails_without_retrying(monkeypatch):
    from serverproc import free_port

    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    cfg = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=5)
    with pytest.raises(RemoteError, match="cannot connect"):
        RemoteVerifier(RemoteConfig(url=f"http://127.0.0.1:{free_port()}", timeout_s=5, retry_budget_s=5), [1], cfg)
    assert sleeps == []


class _Silent(httpx.HTTPTransport):
    """Verify calls never answer: each one "takes" its whole read timeout on a fake clock."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock
        self.attempts = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/verify"):
            self.attempts += 1
            self.clock[0] += float(request.extensions["timeout"]["read"])
            raise httpx.ReadTimeout("no answer", request=request)
        return super().handle_request(request)


@pytest.mark.parametrize("timeout_s, attempts", [(5, 1), (4, 2)])
def test_the_timeout_bounds_the_whole_retry_window(toy_server, monkeypatch, timeout_s, attempts):
    """On a fake clock, with a per-request timeout as long as the retry window or shorter: a retry
    may only have what is left of the window."""
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    cfg = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=20)
    transport = _Silent(clock)
    with httpx.Client(transport=transport, timeout=60) as client:
        verifier = RemoteVerifier(_cfg(toy_server.url, timeout_s=timeout_s, retry_budget_s=5), [1, 2], cfg,
                                  client=client)
        monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
        monkeypatch.setattr(time, "sleep", sleep)

        with pytest.raises(RemoteError, match="did not answer within 5 s"):
            verifier.verify(Draft(tokens=torch.tensor([1, 2]), probs=None))
    assert clock[0] <= 5.0 and transport.attempts >= attempts


def test_concurrent_edges_get_independent_sessions(toy_server):
    """Several edges at once (threads): each output equals its own local run."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(seed, SamplingConfig(temperature=1.0, seed=seed, max_new_tokens=40)) for seed in range(6)]

    def run(job):
        seed, cfg = job
        wire = "coupled" if seed % 2 else "sparse-q"
        return _remote(toy_server.url, [1, 2], cfg, gamma=3, wire=wire).token_ids

    with ThreadPoolExecutor(max_workers=3) as pool:
        outs = list(pool.map(run, jobs))
    for (seed, cfg), out in zip(jobs, outs):
        ref = _local([1, 2], cfg, "coupled", drafter=None) if seed % 2 else _local([1, 2], cfg, "block", gamma=3, q_top_k=2)
        assert out == ref


class _Latency(httpx.HTTPTransport):
    """Adds ``delay`` seconds to every verify call (a longer network round trip)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/verify"):
            time.sleep(self.delay)
        return super().handle_request(request)


def test_auto_gamma_accounts_for_the_round_trip(toy_server):
    """The cost-based γ is handed each round's full round trip as the target's cost (every round
    of the 0.3 s arm reads at least 0.3 s), and a slow network makes longer drafts pay, so
    ``auto`` drafts more per cloud call.  It decides on a modelled clock (a drafted token 20 ms, a
    slow edge device's draft model; a verification 3 ms plus the delay): on the measured one the
    no-delay arm's choices followed how loaded the machine was, and the two arms came within 0.5
    of each other once in a full parallel run."""
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    mean_gamma = {}
    for delay in (0.0, 0.3):
        ctrl = ModelledCostGamma(draft_token_s=0.02, pass_s=0.003 + delay, row_s=0.0)
        with httpx.Client(transport=_Latency(delay), timeout=60) as client:
            out = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=ctrl, client=client)
        assert out.token_ids == _local([1, 2], cfg, "greedy", drafter=None)
        assert len(ctrl.seen) == out.stats.target_calls and min(ctrl.seen) >= delay
        mean_gamma[delay] = out.stats.mean_gamma
    assert mean_gamma[0.3] > mean_gamma[0.0] + 0.5, mean_gamma


def test_outcome_metrics_are_per_round(toy_server):
    cfg = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=20)
    with RemoteVerifier(_cfg(toy_server.url), [1, 2], cfg) as v:
        created_up = v.stats.bytes_up  # the session's creation request
        rounds = [v.verify(Draft(tokens=torch.tensor([1, 2, 3][:k]), probs=None)) for k in (3, 1, 2)]
        assert v.context.numel() == 2 + sum(o.verdict.tokens.numel() for o in rounds)
    for o in rounds:
        m = o.metrics
        assert m["bytes_up"] > 0 and m["wire_bytes_up"] > m["bytes_up"] and 0 < m["bytes_down"] < m["wire_bytes_down"]
        assert m["rtt_ms"] > 0 and m["retries"] == 0 and o.target_s * 1e3 == pytest.approx(m["rtt_ms"])
    assert sum(o.metrics["bytes_up"] for o in rounds) == v.stats.bytes_up - created_up
    assert v.stats.verify_calls == 3


def test_the_edge_follows_a_busy_servers_draft_cap():
    """A batching server that verifies only 1 token of each draft (its draft cap) answers with
    capped_from; the edge then drafts 2 (one more, to notice when the cap lifts) instead of its
    γ = 5, and the output is still plain greedy decoding's."""
    from fastapi.testclient import TestClient

    from specdec.server import ServerSettings, create_app
    from toy_server import FixedCap

    app = create_app(TARGET, settings=ServerSettings())
    app.state.ctx.draft_cap = FixedCap(1)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30)
    with TestClient(app, base_url="http://localhost") as client:
        out = generate_remote([2, 3, 0], cfg, RemoteConfig(url="http://localhost"), drafter=ModelDrafter(DRAFT), gamma=5,
                              client=client)
    assert out.token_ids == _local([2, 3, 0], cfg, "greedy", drafter=None)
    drafted = out.stats.proposed_per_position  # rounds that drafted >= k tokens
    assert out.stats.target_calls > 5 and drafted[1] == out.stats.target_calls - 1  # all but the last round: 2
    assert drafted[2] == 1  # only the first round drafted the full 5 (before the server said anything)


def test_the_edges_next_turn_reuses_its_ended_session():
    """An edge generates, closes its session, then generates after everything it had (a chat's next
    turn) on a server with a prefix cache: the new session copies all of the first sequence but its
    last token (``session_cached_tokens``), and both outputs are plain greedy decoding's."""
    from fastapi.testclient import TestClient

    from specdec.server import ServerSettings, create_app
    from tiny import tiny_native

    target, draft = tiny_native(vocab=40), tiny_native(vocab=40, seed=1)
    app = create_app(target, settings=ServerSettings(prefix_cache_bytes=16 << 20))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    first_prompt = list(range(3, 27))
    with TestClient(app, base_url="http://localhost") as client:
        first = generate_remote(first_prompt, cfg, RemoteConfig(url="http://localhost"), drafter=ModelDrafter(draft),
                                gamma=3, client=client)
        second_prompt = first_prompt + first.token_ids + [5, 6, 7]
        second = generate_remote(second_prompt, cfg, RemoteConfig(url="http://localhost"), drafter=ModelDrafter(draft),
                                 gamma=3, client=client)
    assert first.remote["session_cached_tokens"] == 0
    assert second.remote["session_cached_tokens"] == len(first_prompt) + len(first.token_ids) - 1
    for prompt, out in ((first_prompt, first), (second_prompt, second)):
        plain = SpeculativeDecoder(target, None, get_rule("greedy")).generate(prompt, cfg).tokens
        assert out.token_ids == plain


class _Forgetful(httpx.HTTPTransport):
    """Deletes the session on the server just before verify call number ``forget`` (1-based), so the
    server answers it 404 and the edge must re-create the session; records every creation body."""

    def __init__(self, forget: int) -> None:
        super().__init__()
        self.forget = forget
        self.calls = 0
        self.creations: list[dict] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/sessions" and request.method == "POST":
            self.creations.append(json.loads(request.content))
        elif path.endswith("/verify"):
            self.calls += 1
            if self.calls == self.forget:
                gone = httpx.Request("DELETE", request.url.copy_with(path=path.removesuffix("/verify")),
                                     headers={"Authorization": f"Bearer {API_KEY}"}, extensions=request.extensions)
                super().handle_request(gone).close()
        return super().handle_request(request)


@pytest.mark.parametrize("wire, multinomial", [("sparse-q", True), ("coupled", False)])
def test_a_recreated_session_gets_a_derived_seed_and_the_remaining_budget(toy_server, wire, multinomial):
    """token/block verification restarts the server's generator on re-creation, so its seed must be
    derived from the session seed and the committed length (not the first seed, whose uniforms it
    would replay); coupled keeps the seed (its verdicts are a pure function of it). The re-created
    session is asked for what is left of the budget, not the whole of it."""
    cfg = SamplingConfig(temperature=1.0, seed=11, max_new_tokens=30)
    transport = _Forgetful(forget=4)
    with httpx.Client(transport=transport, timeout=60) as client:
        out = generate_remote([1, 2], cfg, _cfg(toy_server.url, wire=wire), drafter=ModelDrafter(DRAFT), gamma=3,
                              q_top_k=2, client=client)
    assert out.remote["session_recreates"] == 1 and len(transport.creations) == 2
    first, again = transport.creations
    committed = len(again["generated_ids"])
    assert first["seed"] == 11 and first["generated_ids"] == [] and first["max_new_tokens"] == 30
    assert 0 < committed < 30 and again["generated_ids"] == out.token_ids[:committed]
    assert again["seed"] == (derived_seed(11, committed) if multinomial else 11)
    assert again["seed"] != 11 or not multinomial
    assert again["max_new_tokens"] == 30 - committed
    assert out.lossless and len(out.token_ids) == 30


class _Busy(httpx.HTTPTransport):
    """Answers verify call number ``busy`` (1-based) with ``status`` without forwarding it (a busy or
    restarting proxy in front of the server): the edge must retry the same round."""

    def __init__(self, busy: int, status: int) -> None:
        super().__init__()
        self.busy, self.status = busy, status
        self.calls = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/verify"):
            self.calls += 1
            if self.calls == self.busy:
                return httpx.Response(self.status, json={"error": {"message": "busy"}}, request=request)
        return super().handle_request(request)


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_a_busy_verify_reply_is_retried_with_the_same_seq(toy_server, status):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    with httpx.Client(timeout=60) as client:
        plain = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3, client=client)
    with httpx.Client(transport=_Busy(2, status), timeout=60) as client:
        out = generate_remote([1, 2], cfg, _cfg(toy_server.url, backoff_s=0.001), drafter=ModelDrafter(DRAFT), gamma=3,
                              client=client)
    assert out.remote["retries"] == 1 and out.remote["session_recreates"] == 0
    assert out.token_ids == plain.token_ids and out.lossless


class _Counting(httpx.HTTPTransport):
    """Counts the JSON bodies of the session API's POSTs both ways, as they cross the transport."""

    def __init__(self) -> None:
        super().__init__()
        self.up = self.down = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method == "POST":
            self.up += len(request.read())
            self.down += len(response.read())
        return response


def test_bytes_up_and_down_are_the_json_bodies_sent_and_received(toy_server):
    cfg = SamplingConfig(temperature=1.0, seed=3, max_new_tokens=20)
    transport = _Counting()
    with httpx.Client(transport=transport, timeout=60) as client:
        out = generate_remote([1, 2], cfg, _cfg(toy_server.url, wire="sparse-q"), drafter=ModelDrafter(DRAFT), gamma=3,
                              q_top_k=2, client=client)
    r = out.remote
    assert transport.up > 0 and (r["bytes_up"], r["bytes_down"]) == (transport.up, transport.down)
    assert out.summary()["bytes_up"] == transport.up and out.summary()["bytes_down"] == transport.down


def test_remote_stats_summary_figures():
    st = RemoteStats(verify_calls=3, rtt_s=[0.004, 0.001, 0.003, 0.002], cloud_target_ms=30.0, unverified_tokens=0)
    s = st.summary()
    assert s["rtt_ms"] == pytest.approx(2.5)
    assert s["rtt_ms_p50"] == pytest.approx(3.0) and s["rtt_ms_p95"] == pytest.approx(4.0)
    assert s["cloud_prefill_ms"] == pytest.approx(10.0) and s["cloud_prefill_ms_total"] == pytest.approx(30.0)
    assert st.lossless
    one = RemoteStats(rtt_s=[0.005]).summary()
    assert one["rtt_ms_p50"] == pytest.approx(5.0) and one["rtt_ms_p95"] == pytest.approx(5.0)
    assert RemoteStats().summary()["rtt_ms_p95"] == 0.0 and RemoteStats().summary()["cloud_prefill_ms"] == 0.0
    assert not RemoteStats(unverified_tokens=1).lossless


def test_local_commits_stop_at_the_pending_limit_inclusive(toy_server, monkeypatch):
    """Locally committed tokens wait for the next cloud call up to MAX_PENDING_UNVERIFIED of them
    (inclusive); a block that would pass the limit goes to the cloud, which takes the pending ones."""

    monkeypatch.setattr("specdec.remote.client.MAX_PENDING_UNVERIFIED", 6)
    cfg = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=40)
    with RemoteVerifier(_cfg(toy_server.url), [1, 2], cfg, local_commit=lambda draft: True) as v:
        outcomes = [v.verify(Draft(tokens=torch.tensor([1, 2, 3]), probs=None)) for _ in range(3)]
        assert [o.metrics.get("local_commit", False) for o in outcomes] == [True, True, False]
        assert v.stats.local_commits == 2 and v.stats.unverified_tokens == 6 and v.stats.verify_calls == 1
        assert v._pending == []  # the cloud round took them
        assert v.context.tolist()[:8] == [1, 2, 1, 2, 3, 1, 2, 3]


def test_a_session_lost_with_local_commits_pending_is_recreated_with_them_once(toy_server):
    """The re-created session holds the locally committed tokens as generated ids, so they must not
    travel again as unverified tokens (the server would append them twice)."""

    cfg = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=40)
    answers = iter([True])
    transport = _Forgetful(forget=1)
    with httpx.Client(transport=transport, timeout=60) as client:
        with RemoteVerifier(_cfg(toy_server.url), [1, 2], cfg, client=client,
                            local_commit=lambda draft: next(answers, False)) as v:
            local = v.verify(Draft(tokens=torch.tensor([3, 1]), probs=None))
            cloud = v.verify(Draft(tokens=torch.tensor([2]), probs=None))
            assert local.metrics["local_commit"] and "local_commit" not in cloud.metrics
            assert v.stats.session_recreates == 1 and v.stats.verify_calls == 1
            assert transport.creations[1]["generated_ids"] == [3, 1]
            assert v.context.tolist()[:4] == [1, 2, 3, 1] and v.context.numel() == 4 + cloud.verdict.tokens.numel()


class _Recording(httpx.HTTPTransport):
    """Keeps every verify body the edge sends."""

    def __init__(self) -> None:
        super().__init__()
        self.verify_bodies: list[dict] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/verify"):
            self.verify_bodies.append(json.loads(request.read()))
        return super().handle_request(request)


def test_q_crosses_the_wire_as_the_drafts_own_probabilities(toy_server):
    """lossy-scalar sends q(x_i) of each draft token; sparse-q sends each row's non-zero ids and probabilities."""

    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.25, 0.0, 0.75]])
    draft = Draft(tokens=torch.tensor([0, 1]), probs=probs)
    cfg = SamplingConfig(temperature=1.0, seed=4, max_new_tokens=20)
    for wire in ("lossy-scalar", "sparse-q"):
        transport = _Recording()
        with httpx.Client(transport=transport, timeout=60) as client:
            with RemoteVerifier(_cfg(toy_server.url, wire=wire), [1, 2], cfg, client=client) as v:
                v.verify(draft)
        (body,) = transport.verify_bodies
        assert body["draft_tokens"] == [0, 1]
        if wire == "lossy-scalar":
            assert body["q"] == pytest.approx([0.1, 0.25])
        else:
            assert [row["ids"] for row in body["q"]] == [[0, 1, 2, 3], [1, 3]]
            assert body["q"][0]["probs"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
            assert body["q"][1]["probs"] == pytest.approx([0.25, 0.75])


class _SlowOnce(httpx.HTTPTransport):
    """Verify call 1 gets no answer within its read timeout; later ones need 20 ms of it (a server on
    a real network: an attempt given less times out)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/verify"):
            self.calls += 1
            read = float(request.extensions["timeout"]["read"])
            if self.calls == 1 or read < 0.02:
                time.sleep(read if self.calls == 1 else 0.0)
                raise httpx.ReadTimeout("no answer in time", request=request)
        return super().handle_request(request)


def _empty_round_under_lossy_timeout(url: str):
    cfg = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=10)
    # each attempt waits 0.3 s, the lossy deadline's length: the first one times out, the second is answered
    remote = _cfg(url, lossy_timeout_commit_ms=300, timeout_s=0.3, retry_budget_s=2.0, backoff_s=0.01)
    with httpx.Client(transport=_SlowOnce(), timeout=60) as client:
        with RemoteVerifier(remote, [1, 2], cfg, client=client) as v:
            try:
                outcome = v.verify(Draft(tokens=torch.tensor([], dtype=torch.long), probs=None))
            except RemoteError:
                outcome = None
            return v, outcome


def test_an_empty_draft_is_never_committed_by_the_lossy_timeout(toy_server):
    """The timeout fallback commits the first draft token; a round that drafted nothing has none to
    commit, so it must not count a timeout commit nor abandon the session."""
    v, _ = _empty_round_under_lossy_timeout(toy_server.url)
    assert v.stats.timeout_commits == 0 and v.stats.unverified_tokens == 0 and v.stats.lossless


def test_an_empty_round_past_the_lossy_deadline_is_retried_with_a_real_timeout(toy_server):
    v, outcome = _empty_round_under_lossy_timeout(toy_server.url)
    assert outcome is not None and outcome.verdict.tokens.numel() == 1 and v.stats.retries == 1


class _Hiccups(_Forgetful):
    """The first creation is answered 503 (a proxy in front of a server still loading); verify call
    ``forget`` finds its session gone; the re-creation's first attempt finds nothing listening."""

    def __init__(self, forget: int) -> None:
        super().__init__(forget)
        self.refused = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/sessions" and request.method == "POST":
            if not self.creations:
                self.creations.append(json.loads(request.content))
                return httpx.Response(503, json={"error": {"message": "loading"}}, request=request)
            if self.calls >= self.forget and not self.refused:
                self.refused += 1
                raise httpx.ConnectError("connection refused", request=request)
        return super().handle_request(request)


def test_creation_retries_are_counted_and_a_refused_recreation_is_retried(toy_server):
    """Only the very first connection fails at once when refused; a re-creation (the server
    restarting) waits for it, and every retried attempt is counted."""
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    with httpx.Client(timeout=60) as client:
        plain = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3, client=client)
    transport = _Hiccups(forget=3)
    with httpx.Client(transport=transport, timeout=60) as client:
        out = generate_remote([1, 2], cfg, _cfg(toy_server.url, backoff_s=0.001), drafter=ModelDrafter(DRAFT), gamma=3,
                              client=client)
    assert transport.refused == 1
    r = out.remote
    assert r["retries"] == 2 and r["session_creates"] == 2 and r["session_recreates"] == 1
    assert out.token_ids == plain.token_ids and out.lossless


def _local_lossy(prompt: list[int], cfg: SamplingConfig, method: str, *, gamma: int = 3) -> list[int]:
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule(method), gamma=FixedGamma(gamma))
    return dec.generate(prompt, cfg).tokens


def test_q_top_k_truncates_only_sparse_q_drafts(toy_server):
    """``q_top_k`` is the sparse-q mode's: over lossy-scalar the edge drafts from its whole q, as a local
    run of the same lossy rule with the same seed does (token for token), and reports no top-k."""
    with httpx.Client(timeout=60) as client:
        for seed in (1, 2, 3):
            cfg = SamplingConfig(temperature=1.0, seed=seed, max_new_tokens=30)
            out = generate_remote([1, 2], cfg, _cfg(toy_server.url, wire="lossy-scalar"), drafter=ModelDrafter(DRAFT),
                                  gamma=3, q_top_k=1, client=client)
            assert out.token_ids == _local_lossy([1, 2], cfg, "lossy_resample_p")
            assert out.remote["q_top_k"] is None and out.remote["wire"] == "lossy-scalar"
            coupled = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3, q_top_k=1,
                                      client=client)
            assert coupled.remote["q_top_k"] is None and coupled.remote["wire"] == "coupled"


@pytest.mark.parametrize("kwargs, says", [
    ({"q_top_k": 0}, "q top-k must be >= 1, got 0"),
    ({"prompt": []}, "the prompt is empty"),
])
def test_bad_edge_arguments_fail_before_the_server_is_asked(kwargs, says):
    prompt = kwargs.pop("prompt", [1, 2])
    with pytest.raises(ConfigError, match=says):  # nothing listens on port 9: asking it would be a RemoteError
        generate_remote(prompt, SamplingConfig(temperature=0.0, max_new_tokens=5), RemoteConfig(url="http://127.0.0.1:9"),
                        drafter=ModelDrafter(DRAFT), **kwargs)


def test_only_a_lossy_gate_is_reported_as_a_lossy_option(toy_server):
    from specdec.remote.gating import Gate, GateConfig

    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12)
    shape = Gate(GateConfig(policy="shape", rules=frozenset()))
    out = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3, gate=shape)
    assert out.remote["lossy_options"] == [] and out.lossless and out.gate["policy"] == "shape"
    assert out.gate["rounds"] > 0 and out.gate["gated_tokens"] > 0  # the drafts went through the gate
    local = Gate(GateConfig(policy="lossy-local-commit", t_entropy_bits=None, t_margin=None, rules=frozenset()))
    out = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3, gate=local)
    assert out.remote["lossy_options"] == ["lossy_local_commit"]


def test_tree_min_prob_shapes_the_edges_trees(toy_server):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    with httpx.Client(timeout=60) as client:
        wide = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), tree=8, tree_min_prob=0.0,
                               client=client)
        narrow = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), tree=8,
                                 tree_min_prob=0.6, client=client)
    assert wide.token_ids == narrow.token_ids  # greedy: the same tokens whatever the trees
    assert max(r.gamma for r in wide.result.rounds) == 8 and max(r.gamma for r in narrow.result.rounds) == 1


@pytest.mark.parametrize("wire, method", [
    ("sparse-q", "block"), ("sparse-q", "token"), ("lossy-scalar", "lossy-resample-p"),
    ("lossy-scalar", "lossy-strict-residual"), ("lossy-scalar", "lossy-ratio-threshold"),
    ("lossy-scalar", "lossy-p-threshold"),
])
def test_every_wire_rule_runs_over_the_wire(toy_server, wire, method):
    cfg = SamplingConfig(temperature=1.0, seed=2, max_new_tokens=8)
    out = generate_remote([1, 2], cfg, _cfg(toy_server.url, wire=wire, method=method), drafter=ModelDrafter(DRAFT),
                          gamma=3, q_top_k=2)
    assert out.remote["wire"] == wire and out.remote["method"] == method.replace("-", "_")
    assert out.lossless is (wire == "sparse-q") and len(out.token_ids) == 8


def test_min_tokens_holds_back_the_stop_token_ids_too(toy_server):
    """min_tokens masks the end-of-sequence ids *and* ``stop_token_ids`` until then, on both ends:
    the edge's tokens are the local target's, which never stop early at a stop id (greedy and
    coupled, seeds 0-5)."""
    eos = frozenset({0})
    early = 0
    for temperature, seeds in ((0.0, (0,)), (1.0, range(6))):
        for seed in seeds:
            cfg = SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=12, min_tokens=6, stop_token_ids=(2,))
            method = "greedy" if temperature == 0 else "coupled"
            plain = SpeculativeDecoder(TARGET, None, get_rule(method), eos_ids=eos).generate([1, 2], cfg).tokens
            free = SpeculativeDecoder(TARGET, None, get_rule(method), eos_ids=eos).generate(
                [1, 2], SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=12, stop_token_ids=(2,))).tokens
            early += len(free) < 6  # without the floor this seed stops before min_tokens
            assert 2 not in plain[:6] and 0 not in plain[:6]
            out = generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), gamma=3, eos_ids=eos)
            assert out.token_ids == plain, (temperature, seed)
    assert early >= 1  # the floor mattered in at least one run


# ----------------------------------------------------------------------------- without a server


def test_a_derived_seed_is_never_the_session_seed_it_came_from():
    """A re-created token/block session must not replay the first generator's uniforms, even for
    seed 0 re-created before anything was committed."""
    for seed in (0, 1, 7, (1 << 63) - 1):
        for committed in (0, 1, 5):
            assert derived_seed(seed, committed) != seed
    assert derived_seed(0, 0) != derived_seed(0, 1)


@pytest.mark.parametrize("sid", ["a/b", "s\x1b[2K", ""])
def test_a_session_id_that_cannot_go_in_a_url_or_a_terminal_is_refused(sid):
    with _mock(session_id=sid)[0] as client, pytest.raises(RemoteError, match="bad 'session_id'"):
        _greedy(client)
    with _mock()[0] as client:  # unspoilt: accepted
        _greedy(client)


@pytest.mark.parametrize("row", [{"logprob": float("nan")}, {"logprob": -0.5, "top": [[3, float("-inf")]]}])
def test_a_log_probability_that_is_not_finite_is_refused(row):
    """A NaN or infinite log-probability would make the edge's --json output invalid JSON."""

    reply = {"seq": 0, "num_accepted": 0, "tokens": [3], "next_token": 3,
             "metrics": {"gamma": 0, "committed": 1}, "logprobs": [row]}  # NaN / -Infinity, as a lax server writes them
    with _mock(lambda body: (200, reply))[0] as client:
        verifier = _greedy(client, logprobs=1)
        with pytest.raises(RemoteError, match="malformed"):
            verifier.verify(Draft(tokens=torch.empty(0, dtype=torch.long), probs=None))


def _mock(verify_reply=None, **created):
    """A mock session API: a correct session creation, changed by ``created`` (a callable value is
    called with the creation's number, from 1), then ``verify_reply(body)`` -> (status, reply).
    Returns the client and what it was sent: request bodies by kind, and every request.  Replies
    are written with json.dumps, not json=: a lax server writes Infinity / NaN, which json= refuses."""
    seen: dict[str, list] = {"create": [], "verify": [], "requests": []}

    def answer(status: int, reply: dict) -> httpx.Response:
        return httpx.Response(status, content=json.dumps(reply).encode(), headers={"Content-Type": "application/json"})

    def handler(request: httpx.Request) -> httpx.Response:
        seen["requests"].append(request)
        body = json.loads(request.content) if request.content else {}
        if request.method == "DELETE":
            return answer(200, {})
        if request.url.path == "/v1/sessions":
            seen["create"].append(body)
            n = len(seen["create"])
            reply = {"session_id": "s1", "model": "fake", "wire": body["wire"], "method": body["method"], "lossless": True,
                     "seed": body["seed"], "vocab_size": 8, "max_context": 64, "max_gamma": 8, "max_length": 64,
                     "prompt_ids": body["prompt_ids"], "prefill_ms": 1.0}
            reply.update({k: v(n) if callable(v) else v for k, v in created.items()})
            return answer(200, reply)
        seen["verify"].append(body)
        return answer(*verify_reply(body))

    return httpx.Client(transport=httpx.MockTransport(handler)), seen


def _greedy(client, **kw):
    return RemoteVerifier(RemoteConfig(url="http://edge.test", backoff_s=0.001), [1, 2],
                          SamplingConfig(temperature=0.0, seed=1), client=client, **kw)


@pytest.mark.parametrize("cached", [-3, "5", 1.5])
def test_a_bad_cached_prompt_token_count_is_refused(cached):
    client, _ = _mock(lambda body: (500, {}), cached_prompt_tokens=cached)
    with client, pytest.raises(RemoteError, match="bad 'cached_prompt_tokens'"):
        _greedy(client)


def test_a_tree_path_with_a_negative_index_is_inconsistent():
    """Root children 5 and 6 (parents -1, -1): a 'path' of [-1] names node 1 Python's way, not a node."""

    client, _ = _mock(lambda body: (200, {"seq": 0, "num_accepted": 1, "tokens": [6, 3], "next_token": 3, "path": [-1],
                                         "metrics": {"gamma": 2, "committed": 2}}))
    with client:
        verifier = _greedy(client)
        draft = Draft(tokens=torch.tensor([5, 6]), probs=None, parents=torch.tensor([-1, -1]))
        with pytest.raises(RemoteError, match="inconsistent with the draft"):
            verifier.verify(draft)


def test_a_server_that_keeps_losing_the_session_is_given_up_after_three_recreations():
    client, calls = _mock(lambda body: (404, {"error": {"message": "no such session"}}))
    with client:
        verifier = _greedy(client)
        with pytest.raises(RemoteError, match="keeps losing the session"):
            verifier.verify(Draft(tokens=torch.empty(0, dtype=torch.long), probs=None))
    assert len(calls["create"]) == 4 and len(calls["verify"]) == 4 and verifier.stats.session_recreates == 3


GREEDY = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=100)
EMPTY = Draft(tokens=torch.empty(0, dtype=torch.long), probs=None)


@pytest.mark.parametrize("field", ["timeout_s", "connect_timeout_s", "retry_budget_s"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_every_timeout_must_be_positive(field, value):
    """A zero or negative timeout (or retry window) is a ConfigError naming it, not a client that
    gives up at once or never."""
    with pytest.raises(ConfigError, match=f"{field} must be > 0"):
        RemoteConfig(url="http://edge.test", **{field: value})


def test_a_zero_lossy_timeout_is_refused():
    """0 ms would commit every round unverified before the cloud could answer."""
    with pytest.raises(ConfigError, match="lossy timeout must be > 0 ms"):
        RemoteConfig(url="http://edge.test", lossy_timeout_commit_ms=0.0)
    RemoteConfig(url="http://edge.test", lossy_timeout_commit_ms=0.5)  # any positive value is fine


def _resp(text: str) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": text}})


def test_error_messages_are_cut_past_300_characters_only():
    """A 300-character message is printed whole; a 301-character one is cut to 297 + '...'."""
    assert _error_message(_resp("x" * 300)) == "x" * 300
    cut = _error_message(_resp("x" * 301))
    assert cut == "x" * 297 + "..." and len(cut) == 300


def test_c1_control_characters_are_removed_from_error_messages():
    """U+009B is the one-character CSI: a terminal may read it as an escape sequence too."""
    assert _error_message(_resp("a\x9b2Kb\x85c")) == "a 2Kb c"


def test_twenty_logprobs_are_allowed_and_twenty_one_refused():
    client, seen = _mock()
    with client:
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client, logprobs=20)
        assert seen["create"][0]["logprobs"] == 20
        with pytest.raises(ConfigError, match="between 0 and 20"):
            RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client, logprobs=21)


def test_the_max_new_tokens_argument_is_the_sessions_budget():
    """``max_new_tokens=`` overrides the sampling config's budget in the creation body."""
    client, seen = _mock()
    with client:
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client, max_new_tokens=7)
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
    assert [b["max_new_tokens"] for b in seen["create"]] == [7, 100]


def test_min_tokens_without_stop_ids_sends_no_floor():
    """min_tokens masks only the given stop ids: with none there is nothing to hold back, and the
    session body carries no (empty) floor."""
    from specdec.remote.client import wire_options

    assert "min_tokens" not in wire_options(SamplingConfig(temperature=0.0, min_tokens=3), frozenset())
    assert wire_options(SamplingConfig(temperature=0.0, min_tokens=3), frozenset({2})) == {"min_tokens": 3,
                                                                                            "floor_ids": [2]}


def test_backoff_starts_at_backoff_s_doubles_and_never_sleeps_past_the_retry_window(monkeypatch):
    """On a fake clock, a server that is always busy (503): the edge sleeps 0.25 s, then 0.5 s, and
    gives up rather than sleep 1 s past its 1 s retry window."""

    clock, sleeps = [0.0], []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock[0] += s

    monkeypatch.setattr(time, "sleep", sleep)
    client, _ = _mock(lambda body: (503, {"error": {"message": "busy"}}))
    cfg = RemoteConfig(url="http://edge.test", backoff_s=0.25, max_backoff_s=1.0, retry_budget_s=1.0, timeout_s=1.0)
    with client:
        v = RemoteVerifier(cfg, [1, 2], GREEDY, client=client)
        with pytest.raises(RemoteError, match="did not answer within 1 s"):
            v.verify(Draft(tokens=torch.tensor([3]), probs=None))
    assert sleeps == [0.25, 0.5] and v.stats.retries == 3


def test_the_connect_timeout_is_cut_to_the_attempts_timeout():
    """A 2 s request timeout bounds the connect too, though connect_timeout_s is 5 s."""
    client, seen = _mock()
    with client:
        RemoteVerifier(RemoteConfig(url="http://edge.test", timeout_s=2.0, connect_timeout_s=5.0), [1, 2], GREEDY,
                       client=client)
    timeout = seen["requests"][0].extensions["timeout"]
    assert timeout["connect"] == pytest.approx(2.0, abs=0.1) and timeout["read"] == pytest.approx(2.0, abs=0.1)


def _verdict(token: int, committed: int):
    return 200, {"seq": 0, "num_accepted": 0, "tokens": [token], "next_token": token,
                 "metrics": {"gamma": 0, "committed": committed}}


def test_a_server_behind_the_edge_on_committed_tokens_is_an_error():
    """The server says it holds 0 committed tokens after a round that committed 1: the mirror and
    the session disagree, which must be an error (not only when the server is ahead)."""
    client, _ = _mock(lambda body: _verdict(3, 0))
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
        with pytest.raises(RemoteError, match="holds 0 committed tokens but the edge has 1"):
            v.verify(EMPTY)


def test_a_sequence_past_the_sessions_max_length_is_a_remote_error():
    """max_length 3 holds prompt [1, 2] and one token; a second round's token does not fit: a
    RemoteError, not a tensor shape error."""
    replies = iter([_verdict(3, 1), (200, {"seq": 1, "num_accepted": 0, "tokens": [4], "next_token": 4,
                                           "metrics": {"gamma": 0, "committed": 2}})])
    client, _ = _mock(lambda body: next(replies), max_length=3)
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
        v.verify(EMPTY)
        with pytest.raises(RemoteError, match="outgrew the session's context"):
            v.verify(EMPTY)


def test_a_recreated_session_without_room_for_the_committed_tokens_is_refused():
    """After one committed token the session is lost (404); a re-created session whose max_length
    holds the prompt but not the committed token is refused by name."""
    answers = iter([_verdict(3, 1), (404, {"error": {"message": "gone"}})])
    client, _ = _mock(lambda body: next(answers, _verdict(4, 2)), session_id=lambda n: f"s{n}",
                      max_length=lambda n: 64 if n == 1 else 3)  # the second: prompt (2) + 1, no room for more
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
        v.verify(EMPTY)
        with pytest.raises(RemoteError, match="bad 'max_length'"):
            v.verify(EMPTY)


def _accept_all(body):
    """Accepts every drafted token and adds 5, with a log-probability row per token."""
    tokens = body["draft_tokens"] + [5]
    return 200, {"seq": body["seq"], "num_accepted": len(body["draft_tokens"]), "tokens": tokens, "next_token": 5,
                 "metrics": {"gamma": len(body["draft_tokens"])},
                 "logprobs": [{"logprob": -0.5, "top": [[t, -0.5]]} for t in tokens]}


def test_logprobs_stop_with_the_output_when_the_last_round_overshoots():
    """A round of 3 tokens [3, 4, 5] with 4 an end-of-sequence id: the output stops at 4 and the
    log-probabilities with it (one per output token, not one per token the server sent)."""

    client, _ = _mock(_accept_all)
    with client:
        out = generate_remote([1, 2], SamplingConfig(temperature=0.0, seed=1, max_new_tokens=4),
                              RemoteConfig(url="http://edge.test"), drafter=FixedDrafter((3, 4)), gamma=2, client=client,
                              logprobs=1, eos_ids=frozenset({4}))
    assert out.token_ids == [3, 4] and len(out.logprobs) == 2


def test_the_vocab_size_argument_bounds_the_ids_the_edge_accepts():
    """``vocab_size=4`` (the edge's draft vocabulary) under a server of 8 ids: the server's token 4
    is refused, though the server's vocabulary holds it."""

    client, _ = _mock(_accept_all)
    with client, pytest.raises(RemoteError, match=r"token id 4 in round 0, outside the vocabulary \[0, 4\)"):
        generate_remote([1, 2], SamplingConfig(temperature=0.0, seed=1, max_new_tokens=4),
                        RemoteConfig(url="http://edge.test"), drafter=FixedDrafter((3, 4)), gamma=2, client=client, vocab_size=4)


def test_a_verdict_with_more_tokens_than_accepted_plus_one_is_inconsistent():
    """num_accepted 0 with tokens [3, 4]: the extra token would be committed as if verified."""
    client, _ = _mock(lambda body: (200, {"seq": 0, "num_accepted": 0, "tokens": [3, 4], "next_token": 4,
                                            "metrics": {"gamma": 0}}))
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
        with pytest.raises(RemoteError, match="inconsistent with the draft"):
            v.verify(EMPTY)
        assert v.context.tolist() == [1, 2]


def test_more_logprob_rows_than_tokens_are_refused():
    """Two rows for one token would shift every later token's log-probability."""
    row = {"logprob": -0.5, "top": []}
    client, _ = _mock(lambda body: (200, {"seq": 0, "num_accepted": 0, "tokens": [3], "next_token": 3,
                                            "metrics": {"gamma": 0}, "logprobs": [row, row]}))
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client, logprobs=0)
        with pytest.raises(RemoteError, match="no log-probabilities"):
            v.verify(EMPTY)


def test_a_session_id_of_256_characters_is_accepted_and_257_refused():
    client, _ = _mock(session_id="s" * 256)
    with client:
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
    client, _ = _mock(session_id="s" * 257)
    with client, pytest.raises(RemoteError, match="bad 'session_id'"):
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)


def test_an_infinite_prefill_time_is_refused():
    """Infinity (which Python's json writes and reads) would make the edge's --json output invalid."""
    client, _ = _mock(prefill_ms=float("inf"))
    with client, pytest.raises(RemoteError, match="bad 'prefill_ms'"):
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)


def test_prefill_and_cached_tokens_add_up_over_recreated_sessions():
    """The session is lost once (404) and re-created: both creations' prefill_ms and cached prompt
    tokens count in the stats (totals over the session's life)."""
    answers = iter([(404, {"error": {"message": "gone"}})])
    client, seen = _mock(lambda body: next(answers, _verdict(3, 1)), cached_prompt_tokens=1, prefill_ms=2.0)
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
        v.verify(EMPTY)
    assert len(seen["create"]) == 2 and v.stats.session_recreates == 1
    assert v.stats.session_prefill_ms == 4.0 and v.stats.session_cached_tokens == 2


def test_a_local_commit_reports_every_unverified_token_in_its_metrics():
    client, _ = _mock(lambda body: _verdict(3, 4))
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client,
                           local_commit=lambda draft: True)
        out = v.verify(Draft(tokens=torch.tensor([3, 4, 5]), probs=None))
    assert out.metrics == {"unverified": 3, "local_commit": True} and v.stats.unverified_tokens == 3


class _EightLetters(LetterTokenizer):
    """A letter tokenizer of 8 ids (more than the edge's 4-id draft vocabulary)."""

    def __len__(self) -> int:
        return 8


def test_the_vocab_size_argument_wins_over_the_tokenizers_length():
    """``vocab_size=4`` with a tokenizer of 8 ids (a draft model with a smaller vocabulary than its
    tokenizer): the edge's bound is 4, so the server's token 4 is refused."""
    client, _ = _mock(_accept_all)
    with client, pytest.raises(RemoteError, match=r"token id 4 in round 0, outside the vocabulary \[0, 4\)"):
        generate_remote([1, 2], SamplingConfig(temperature=0.0, seed=1, max_new_tokens=4),
                        RemoteConfig(url="http://edge.test"), drafter=FixedDrafter((3, 4)), gamma=2, client=client,
                        tokenizer=_EightLetters(), vocab_size=4)


def _one_token_run():
    """One round against the mock: no drafter, the server's next token 5 (an end-of-sequence id)."""
    client, _ = _mock(_accept_all)
    with client:
        return generate_remote([1, 2], SamplingConfig(temperature=0.0, seed=1, max_new_tokens=4),
                               RemoteConfig(url="http://edge.test"), drafter=FixedDrafter((3, 4)), gamma=2,
                               client=client, eos_ids=frozenset({5}))


def test_the_summary_reports_edge_time_in_milliseconds():
    out = _one_token_run()
    assert out.stats.draft_s > 0
    assert out.summary()["edge_time_ms"] == pytest.approx(out.stats.draft_s * 1e3)


def test_the_summary_of_a_run_that_generated_nothing_has_no_division_by_zero():
    """A run that ends before any token (e.g. a stop string at once) still summarises: calls per
    token divide by at least one token."""
    from dataclasses import replace

    out = _one_token_run()
    empty = replace(out, result=replace(out.result, stats=replace(out.stats, generated_tokens=0)))
    assert empty.summary()["cloud_calls_per_token"] == out.remote["verify_calls"]


def test_a_gate_with_a_token_tree_is_refused_before_the_server_is_asked():
    """The edge gate judges chain drafts token by token: a tree with an active gate is a ConfigError
    naming the fix, and no request is sent."""
    from specdec.remote.gating import Gate, GateConfig

    client, seen = _mock(_accept_all)
    with client, pytest.raises(ConfigError, match="use --tree chain with --gate"):
        generate_remote([1, 2], SamplingConfig(temperature=0.0, seed=1, max_new_tokens=4),
                        RemoteConfig(url="http://edge.test"), drafter=FixedDrafter((3, 4)), tree=4, client=client,
                        gate=Gate(GateConfig(policy="shape")))
    assert seen["requests"] == []


def _seq_verdict(body: dict, committed_before: int) -> tuple[int, dict]:
    """A correct verdict for an empty draft in round ``body['seq']``: the target's token is 3."""
    return 200, {"seq": body["seq"], "num_accepted": 0, "tokens": [3], "next_token": 3,
                 "metrics": {"gamma": 0, "committed": committed_before + 1}}


def test_the_rtt_percentiles_index_by_the_whole_count():
    """p50 of 4 round trips is the 3rd smallest (index int(0.5 * 4)), p95 of 20 is the largest."""
    four = RemoteStats(rtt_s=[0.001, 0.002, 0.003, 0.004]).summary()
    assert four["rtt_ms_p50"] == pytest.approx(3.0)
    twenty = RemoteStats(rtt_s=[i / 1000 for i in range(1, 21)]).summary()
    assert twenty["rtt_ms_p95"] == pytest.approx(20.0)


def test_an_empty_api_key_sends_no_authorization_header():
    """api_key='' means no key (as an empty SPECDEC_API_KEY does): no 'Bearer ' header with nothing after it."""
    client, seen = _mock()
    with client:
        RemoteVerifier(RemoteConfig(url="http://edge.test", api_key=""), [1, 2], GREEDY, client=client)
        RemoteVerifier(RemoteConfig(url="http://edge.test", api_key="k"), [1, 2], GREEDY, client=client)
    assert "authorization" not in seen["requests"][0].headers
    assert seen["requests"][1].headers["authorization"] == "Bearer k"


def test_an_empty_draft_is_never_committed_locally():
    """A local-commit predicate that says yes to everything still cannot commit a round that drafted
    nothing (there is no token to keep): the round goes to the cloud."""
    client, seen = _mock(lambda body: _seq_verdict(body, 0))
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client, local_commit=lambda d: True)
        out = v.verify(EMPTY)
    assert len(seen["verify"]) == 1 and out.verdict.tokens.tolist() == [3]
    assert v.stats.local_commits == 0 and v.stats.unverified_tokens == 0 and v.lossless


def test_closing_twice_deletes_the_session_once():
    """close() forgets the session it deleted: a second close (or __exit__ after close) sends nothing."""
    client, seen = _mock()
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
        v.close()
        v.close()
    assert [r.method for r in seen["requests"]].count("DELETE") == 1


def test_close_leaves_a_client_it_was_given_open():
    """The caller's httpx client is the caller's: closing the verifier must not close it (a chat
    reuses one client for every turn's session)."""
    client, seen = _mock()
    with client:
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client).close()
        assert not client.is_closed
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client).close()  # still usable
    assert len(seen["create"]) == 2


def test_a_round_reports_only_its_own_retries():
    """Outcome.metrics['retries'] is this round's: a busy answer in round 1 is not counted again in round 2."""
    answers = iter([(503, {"error": {"message": "busy"}})])

    def reply(body):
        return next(answers, None) or _seq_verdict(body, body["seq"])

    client, _ = _mock(reply)
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test", backoff_s=0.001), [1, 2], GREEDY, client=client)
        first, second = v.verify(EMPTY), v.verify(EMPTY)
    assert first.metrics["retries"] == 1 and second.metrics["retries"] == 0 and v.stats.retries == 1


def test_a_gzip_encoded_reply_is_read_once():
    """A server (or a proxy in front of it) that gzips its replies: the edge decodes the body once and
    must not try to decode the decoded bytes again."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        reply = {"session_id": "s1", "model": "fake", "wire": body["wire"], "method": body["method"], "lossless": True,
                 "seed": body["seed"], "vocab_size": 8, "max_context": 64, "max_gamma": 8, "max_length": 64,
                 "prompt_ids": body["prompt_ids"], "prefill_ms": 1.0}
        return httpx.Response(200, content=gzip.compress(json.dumps(reply).encode()),
                              headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client)
        assert v.model_name == "fake" and v.vocab_size == 8


def test_an_html_error_page_keeps_its_text_after_long_markup():
    """A non-JSON error page: tags are stripped from its first 2000 characters, so the words after a
    long <head> still reach the one-line message."""
    page = "<html><head>" + "<meta name='x' content='" + "y" * 400 + "'>" + "</head><body>Bad gateway upstream</body></html>"
    resp = httpx.Response(502, content=page.encode(), headers={"Content-Type": "text/html"})
    assert _error_message(resp) == "Bad gateway upstream"


def test_an_empty_error_body_falls_back_to_the_reason_phrase():
    """A refusal with no body still says something: the HTTP reason phrase."""
    assert _error_message(httpx.Response(503, content=b"")) == "Service Unavailable"


def test_an_explicit_zero_budget_is_not_the_sampling_configs():
    """``max_new_tokens=0`` is a budget (of nothing; the session is asked for its minimum of 1), not
    'unset': the sampling config's 100 must not be used."""
    client, seen = _mock()
    with client:
        RemoteVerifier(RemoteConfig(url="http://edge.test"), [1, 2], GREEDY, client=client, max_new_tokens=0)
    assert seen["create"][0]["max_new_tokens"] == 1


def test_an_empty_sparse_q_round_sends_no_q():
    """A round that drafted nothing sends no q at all over sparse-q (not an empty list)."""

    client, seen = _mock(lambda body: _seq_verdict(body, 0))
    with client:
        v = RemoteVerifier(RemoteConfig(url="http://edge.test", wire="sparse-q"), [1, 2],
                           SamplingConfig(temperature=1.0, seed=1), client=client)
        v.verify(Draft(tokens=torch.empty(0, dtype=torch.long), probs=torch.empty(0, 8)))
    assert "q" not in seen["verify"][0] and seen["verify"][0]["draft_tokens"] == []


def test_tokens_committed_without_a_session_do_not_count_as_pending(monkeypatch):
    """After a lossy timeout commit the session is abandoned: tokens committed while there is none go
    to the re-created session as generated ids, so they do not use up the pending limit of later
    local commits (MAX_PENDING_UNVERIFIED set to 3 here)."""
    monkeypatch.setattr("specdec.remote.client.MAX_PENDING_UNVERIFIED", 3)
    monkeypatch.setattr(httpx, "request", lambda *a, **kw: None)  # the abandoned session's background DELETE

    def reply(body):
        raise httpx.ReadTimeout("no answer in time")

    client, seen = _mock(reply)
    with client:
        cfg = RemoteConfig(url="http://edge.test", backoff_s=0.001, lossy_timeout_commit_ms=50)
        answers = iter([False, True])
        v = RemoteVerifier(cfg, [1, 2], GREEDY, client=client, local_commit=lambda d: next(answers))
        timed_out = v.verify(Draft(tokens=torch.tensor([3]), probs=None))
        local = v.verify(Draft(tokens=torch.tensor([4, 5, 6]), probs=None))
    assert timed_out.metrics.get("timeout_commit") and local.metrics.get("local_commit")
    assert v.stats.unverified_tokens == 4 and v.context.tolist() == [1, 2, 3, 4, 5, 6]


def test_a_busy_recreation_under_the_lossy_timeout_does_not_end_the_run():
    """With --lossy-timeout-commit-ms, a session lost mid-run is re-created against the round's
    deadline.  A busy answer (503) to that re-creation must be treated like any other hiccup inside
    the deadline (retried, or the round falls back to the timeout commit), as it is without the
    lossy option and as a 503 to a verify call is; it used to end the whole generation with
    'the server refused the session: HTTP 503'."""
    state = {"creates": 0, "verifies": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        if request.url.path == "/v1/sessions":
            state["creates"] += 1
            if state["creates"] == 2:  # the re-creation's first attempt: the server is busy
                return httpx.Response(503, json={"error": {"message": "busy"}})
            return httpx.Response(200, json={
                "session_id": f"s{state['creates']}", "model": "fake", "wire": body["wire"], "method": body["method"],
                "lossless": True, "seed": body["seed"], "vocab_size": 8, "max_context": 64, "max_gamma": 8,
                "max_length": 64, "prompt_ids": body["prompt_ids"], "prefill_ms": 1.0})
        state["verifies"] += 1
        if state["verifies"] == 1:  # the first verify finds its session gone (evicted)
            return httpx.Response(404, json={"error": {"message": "no such session"}})
        return httpx.Response(200, json={"seq": body["seq"], "num_accepted": 1, "tokens": [3, 4], "next_token": 4,
                                         "metrics": {"gamma": 1, "committed": 2}})

    cfg = RemoteConfig(url="http://edge.test", backoff_s=0.001, lossy_timeout_commit_ms=10_000)
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        v = RemoteVerifier(cfg, [1, 2], GREEDY, client=client)
        out = v.verify(Draft(tokens=torch.tensor([3]), probs=None))
    assert out.verdict.tokens.tolist() == [3, 4] and v.stats.session_recreates == 1
    assert v.stats.timeout_commits == 0 and v.lossless  # the deadline was 10 s away: nothing committed unverified


def test_a_server_that_stays_busy_gets_the_lossy_timeout_commit_without_a_wait_past_the_deadline(monkeypatch):
    """--lossy-timeout-commit-ms 50 against a server that answers every verify call 503 at once: the
    backoff (here 2 s) never sleeps past the round's deadline, and once the deadline has passed the
    round commits its first draft token, as it does when the calls time out."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        if request.url.path == "/v1/sessions":
            return httpx.Response(200, json={
                "session_id": "s1", "model": "fake", "wire": body["wire"], "method": body["method"], "lossless": True,
                "seed": body["seed"], "vocab_size": 8, "max_context": 64, "max_gamma": 8, "max_length": 64,
                "prompt_ids": body["prompt_ids"], "prefill_ms": 1.0})
        return httpx.Response(503, json={"error": {"message": "busy"}})

    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s) or real_sleep(s))
    cfg = RemoteConfig(url="http://edge.test", backoff_s=2.0, max_backoff_s=2.0, retry_budget_s=5.0,
                       lossy_timeout_commit_ms=50)
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        v = RemoteVerifier(cfg, [1, 2], GREEDY, client=client)
        out = v.verify(Draft(tokens=torch.tensor([3, 5]), probs=None))
    assert out.verdict.tokens.tolist() == [3] and v.stats.timeout_commits == 1 and not v.lossless
    assert all(s <= 0.05 for s in slept), slept  # (none at all where the first call alone outlasts 50 ms)
