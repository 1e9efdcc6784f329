"""Token-tree rounds from the edge: ids + parent indices (+ sparse q rows) over the wire.

Exactness is checked as for chains: token-for-token equality with plain decoding (greedy; coupled
with the same seed), equality with local tree decoding under the same seed (sparse q: the very
same arithmetic on both sides), and a chi-square test of the output law: 2,000 independent
generations (seed = index) of 3 tokens from the 4-token toy target (64 outcomes), each through
its own server session, sampled trees verified by the token-level tree rule; p < 1e-4 fails.  The
negative control misreports q (both top-2 ids equally likely) and must fail the same test.
"""

from __future__ import annotations

import httpx
import pytest

from serverproc import ServerProcess
from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.engine import make_tree
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.remote.client import RemoteTarget, RemoteVerifier
from specdec.remote.edge import generate_remote
from specdec.remote.gating import Gate, GateConfig
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule
from stats import ALPHA, chi_square_pvalue, exact_law

from .conftest import API_KEY
from .test_client import DRAFT, TARGET, _cfg, _Flaky, _local, _MisreportedQ


def _remote_tree(url: str, prompt: list[int], cfg: SamplingConfig, tree, *, drafter=None, client=None, **kw):
    return generate_remote(prompt, cfg, _cfg(url, **kw), drafter=drafter or ModelDrafter(DRAFT), gamma=3, tree=tree,
                           q_top_k=2, client=client)


def _local_tree(prompt: list[int], cfg: SamplingConfig, method: str, nodes: int, *, q_top_k=None) -> list[int]:
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule(method), gamma=FixedGamma(nodes), tree=TreeSpec(),
                             q_top_k=q_top_k)
    return dec.generate(prompt, cfg).tokens


def test_greedy_tree_rounds_equal_plain_greedy(toy_server):
    with httpx.Client(timeout=60) as client:
        cfg = SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_new_tokens=30)
        for prompt in ([1], [2, 3, 0]):
            plain = _local(prompt, cfg, "greedy", drafter=None)
            for tree in (4, 8, "auto"):
                out = _remote_tree(toy_server.url, prompt, cfg, tree, client=client)
                assert out.token_ids == plain and out.lossless
            out = _remote_tree(toy_server.url, prompt, cfg, 8, drafter=NgramDrafter(), client=client)
            assert out.token_ids == plain
    st = _remote_tree(toy_server.url, [2, 3, 0], cfg, 8).summary()
    assert st["tree_rounds"] > 0 and st["tokens_per_target_call"] > 1.0 and st["bytes_up"] > 0


def test_coupled_tree_rounds_equal_plain_seeded_sampling(toy_server):
    with httpx.Client(timeout=60) as client:
        for seed in range(4):
            cfg = SamplingConfig(temperature=1.0, top_p=0.95, seed=seed, max_new_tokens=25)
            plain = _local([1, 2], cfg, "coupled", drafter=None)
            out = _remote_tree(toy_server.url, [1, 2], cfg, 6, client=client)
            assert out.remote["wire"] == "coupled" and out.token_ids == plain


@pytest.mark.parametrize("method", ["token", "block"])
def test_sparse_q_tree_rounds_equal_local_tree_decoding(toy_server, method):
    """Sampled trees (siblings drawn from q, reported as sparse rows): the cloud runs the same tree
    rule with the same seed as local tree decoding with the same q truncation."""
    with httpx.Client(timeout=60) as client:
        for seed in range(8):
            cfg = SamplingConfig(temperature=0.9, seed=seed, max_new_tokens=20)
            out = _remote_tree(toy_server.url, [1, 2], cfg, 6, wire="sparse-q", method=method, client=client)
            assert out.token_ids == _local_tree([1, 2], cfg, method, 6, q_top_k=2)


#: generations per law test (seeded, so deterministic); the negative control draws N_CONTROL and
#: fails at p = 2e-68 with them (ALPHA = 1e-4)
N_LAW = 2000
N_CONTROL = 1000


def _law_samples(url: str, verifier_cls=RemoteVerifier, n: int = N_LAW) -> list[tuple[int, ...]]:
    out = []
    spec, _ = make_tree(6, FixedGamma(6))
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            cfg = SamplingConfig(temperature=1.0, seed=i, max_new_tokens=3)
            v = verifier_cls(_cfg(url, wire="sparse-q", method="token"), [1, 2], cfg, client=client)
            dec = SpeculativeDecoder(RemoteTarget(4, v.max_context), ModelDrafter(DRAFT), v.rule, gamma=FixedGamma(6),
                                     q_top_k=2, tree=spec)
            out.append(tuple(dec.generate([1, 2], cfg, verifier=v).tokens))
    return out


def test_tree_output_law_over_the_wire(toy_server):
    law = exact_law(TARGET, [1, 2], SamplingConfig(temperature=1.0, max_new_tokens=3), 3)
    assert chi_square_pvalue(_law_samples(toy_server.url), law) > ALPHA


def test_negative_control_a_misreported_tree_q_fails_the_law_test(toy_server):
    law = exact_law(TARGET, [1, 2], SamplingConfig(temperature=1.0, max_new_tokens=3), 3)
    assert chi_square_pvalue(_law_samples(toy_server.url, _MisreportedQ, n=N_CONTROL), law) < ALPHA


def test_a_lost_tree_response_is_retried_with_the_same_seq(toy_server):
    cfg = SamplingConfig(temperature=1.0, seed=7, max_new_tokens=30)
    transport = _Flaky(every=3)
    with httpx.Client(transport=transport, timeout=60) as client:
        out = _remote_tree(toy_server.url, [1, 2], cfg, 6, wire="sparse-q", method="block", client=client)
    assert transport.lost >= 2 and out.remote["retries"] == transport.lost
    assert out.token_ids == _local_tree([1, 2], cfg, "block", 6, q_top_k=2)


def test_tree_options_that_cannot_work_are_refused(toy_server):
    cfg = SamplingConfig(temperature=1.0, seed=1, max_new_tokens=5)
    with pytest.raises(ConfigError, match="lossy-scalar"):
        _remote_tree(toy_server.url, [1, 2], cfg, 4, wire="lossy-scalar")
    gate = Gate(GateConfig(policy="shape"))
    with pytest.raises(ConfigError, match="--tree chain"):
        generate_remote([1, 2], cfg, _cfg(toy_server.url), drafter=ModelDrafter(DRAFT), tree=4, gate=gate)


def test_the_edge_drafts_no_more_than_the_servers_max_gamma():
    """A server started with ``--max-gamma 2`` refuses a longer draft (a 400 that ended the edge's
    run mid-reply); the edge reads the bound from the session's reply and drafts no more, chains
    and trees alike, so asking for γ 6 or 8-node trees still gives plain greedy's tokens."""
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30)
    plain = _local([2, 3, 0], cfg, "greedy", drafter=None)
    with ServerProcess.toy("--api-key", API_KEY, "--vocab", "4", "--order", "2", "--seed", "0", "--max-gamma", "2") as srv:
        for tree in ("chain", 8, "auto"):
            out = generate_remote([2, 3, 0], cfg, _cfg(srv.url), drafter=ModelDrafter(DRAFT), gamma=6, tree=tree)
            assert out.token_ids == plain, tree
            drafted = [r.gamma for r in out.result.rounds]
            assert max(drafted) == 2 and sum(drafted) > 10, (tree, drafted)  # drafted up to the bound, never past it
