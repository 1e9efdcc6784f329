"""The edge: RemoteVerifier + the local decoding loop against a toy server process.

Exactness over the wire is checked three ways: token-for-token equality with local decoding
(greedy; coupled with the same seed; sparse-q with the same seed, which runs the very same
arithmetic), and a chi-square test of the output law in sparse-q mode with two negative controls.
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters.hybrid import LookupThenModel
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.models.toy import ToyLM
from specdec.remote.client import RemoteConfig, RemoteError, RemoteTarget, RemoteVerifier
from specdec.remote.edge import generate_remote
from specdec.sampling import SamplingConfig
from specdec.token_filter import TokenFilter
from specdec.verify import get_rule
from clock import ModelledCostGamma
from stats import ALPHA, chi_square_pvalue, exact_law

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


def test_the_timeout_bounds_the_whole_retry_window(toy_server, monkeypatch):
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    cfg = SamplingConfig(temperature=0.0, seed=1, max_new_tokens=20)
    transport = _Silent(clock)
    with httpx.Client(transport=transport, timeout=60) as client:
        verifier = RemoteVerifier(_cfg(toy_server.url, timeout_s=5, retry_budget_s=5), [1, 2], cfg, client=client)
        monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
        monkeypatch.setattr(time, "sleep", sleep)
        from specdec.drafters.base import Draft

        with pytest.raises(RemoteError, match="did not answer within 5 s"):
            verifier.verify(Draft(tokens=torch.tensor([1, 2]), probs=None))
    assert clock[0] <= 5.0 and transport.attempts >= 1


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
    import torch

    from specdec.drafters.base import Draft

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
