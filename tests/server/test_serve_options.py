"""``specdec serve`` options clients see, spelled as vLLM spells them: ``--served-model-name``,
``--max-model-len``, ``--chat-template`` and ``--trust-request-chat-template``."""

from __future__ import annotations

import httpx
import openai
import pytest

from serverproc import DRAFT_MODEL, ServerProcess
from specdec.cli import build_parser
from specdec.errors import ConfigError
from specdec.server.command import is_loopback, settings_from_args

MODEL = DRAFT_MODEL
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"

pytestmark = pytest.mark.usefixtures("single_thread")


def test_names_context_limit_and_chat_template(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    with ServerProcess.draft_model("--served-model-name", "alpha", "beta", "--max-model-len", "48",
                                   "--chat-template", str(template), "--trust-request-chat-template") as srv:
        with srv.openai() as client:
            assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
            assert client.models.retrieve("beta").model_extra["max_model_len"] == 48
            out = client.completions.create(model="beta", prompt="def add(a, b):", max_tokens=8, temperature=0)
            assert out.model == "alpha" and out.choices[0].text  # any name, the first one in responses
            with pytest.raises(openai.NotFoundError, match="'alpha' or 'beta'"):
                client.completions.create(model=MODEL, prompt="x", max_tokens=2)  # the target's own name is not served
            with pytest.raises(openai.BadRequestError, match="context is 48 tokens"):
                client.completions.create(model="alpha", prompt="def add(a, b):", max_tokens=60)
            assert httpx.get(srv.url + "/health", timeout=60).json()["max_context"] == 48
            ids = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60).json()["tokens"]
            text = httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
            assert text == "<user>hi\n<assistant>"  # the template given, not the model's
            chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                                  temperature=0)
            assert chat.usage.prompt_tokens == len(ids)
            # a request's own template renders its conversation instead (the server trusts requests' templates)
            own = {"chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}{% if add_generation_prompt %}={% endif %}"}
            ids = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "def f():"}], **own}, timeout=60).json()["tokens"]
            assert httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"] == "[def f():]="
            chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "def f():"}], max_tokens=6,
                                                  temperature=0, extra_body=own)
            plain = client.completions.create(model="alpha", prompt="[def f():]=", max_tokens=6, temperature=0)
            assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == plain.choices[0].text
            with pytest.raises(openai.BadRequestError, match="chat template rejected"):
                client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                               extra_body={"chat_template": "{% for m in messages %}"})


def test_a_model_without_a_chat_template_says_so_at_start_and_on_chat(tmp_path):
    """A base model (no chat template): the start-up log says chat gets a 400 and how to serve it,
    a chat request's 400 names --chat-template, and plain completions are served."""
    from tiny import make_tiny, without_chat_template

    folder = without_chat_template(make_tiny(tmp_path / "base", max_positions=64))
    with ServerProcess.cli("--target", str(folder), "--draft", "none", "--dtype", "float32") as srv:
        with srv.openai() as client:
            with pytest.raises(openai.BadRequestError, match="--chat-template"):
                client.chat.completions.create(model=folder.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert client.completions.create(model=folder.name, prompt="abc", max_tokens=2).usage.completion_tokens == 2
        srv.proc.terminate()
        err = srv.proc.stderr.read()
    assert "this model has no chat template: chat requests get a 400 (start with --chat-template" in err


def test_a_drafter_without_a_tree_pass_says_so_at_start_and_drafts_chains(tmp_path):
    """``serve --tree 4`` with a self-speculative view (no tree pass): the start-up log says it
    drafts chains, as ``generate --tree`` says, and a request's own tree is drafted as a chain
    whose greedy output is a ``tree: chain`` request's."""
    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m", layers=4, max_positions=64)
    with ServerProcess.cli("--target", str(folder), "--draft", "layerskip:2", "--dtype", "float32", "--tree", "4") as srv:
        with srv.openai() as client:
            answers = [client.completions.create(model=folder.name, prompt="abc abc abc", max_tokens=12, temperature=0,
                                                 extra_body={"tree": tree, "gamma": 3}) for tree in (8, "chain")]
        srv.proc.terminate()
        err = srv.proc.stderr.read()
    assert "the drafter layerskip:2 has no tree pass: it drafts chains (--tree 4 is not used), and so do requests" in err, err
    tree, chain = (a.model_extra["specdec"] for a in answers)
    assert tree["tree_rounds"] == 0 and tree["draft_tokens_proposed"] > 0, tree
    assert answers[0].choices[0].text == answers[1].choices[0].text and answers[0].usage.completion_tokens == 12


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)


def _settings(*argv: str) -> dict:
    # port 0: no port is bound by the check
    return settings_from_args(build_parser().parse_args(["serve", "--port", "0", *argv]))


def test_loopback_names_are_case_insensitive():
    """'LOCALHOST' is a loopback name as 'localhost' is (no key needed to listen there)."""
    assert is_loopback("LOCALHOST") and is_loopback(" Localhost ")


def test_port_above_65535_is_refused():
    """--port 65536 is refused before anything loads; 65535 is the largest port."""
    args = build_parser().parse_args(["serve", "--port", "65536"])
    with pytest.raises(ConfigError, match="port must be between 0 and 65535, got 65536"):
        settings_from_args(args)


def test_key_file_alone_makes_a_public_address_allowed(tmp_path):
    """With --api-key-file and no --api-key, the file's first key is the server's key: a
    non-loopback --host is then allowed."""
    keys = tmp_path / "keys"
    keys.write_text("# ops\nk-one\nk-two\n")
    kw = _settings("--host", "0.0.0.0", "--api-key-file", str(keys))
    assert kw["api_key"] == "k-one" and kw["api_keys"] == ("k-two",)


def test_zero_kv_budget_is_refused_in_the_flags_own_words():
    """--max-kv-mib 0 is refused naming the flag (not the settings' internal byte budget)."""
    with pytest.raises(ConfigError, match=r"--max-kv-mib must be a finite number > 0, got 0"):
        _settings("--max-kv-mib", "0")


def test_zero_max_connections_is_refused():
    """--max-connections 0 is refused before any model loads; 1 is accepted."""
    with pytest.raises(ConfigError, match="max connections must be >= 1, got 0"):
        _settings("--max-connections", "0")
    _settings("--max-connections", "1")


def test_options_reach_the_settings():
    """--allowed-host, --metrics-need-key and --gather-gap-ms (ms -> s) are passed on to the settings."""
    kw = _settings("--allowed-host", "box.lan", "--allowed-host", "other.lan", "--metrics-need-key", "--gather-gap-ms", "5")
    assert kw["allowed_hosts"] == ("box.lan", "other.lan")
    assert kw["metrics_need_key"] is True
    assert kw["gather_gap_s"] == pytest.approx(0.005)
    assert _settings()["metrics_need_key"] is False


def test_a_bracketed_ipv6_loopback_is_loopback():
    """'[::1]' (an IPv6 address as URLs spell it) is loopback, as '::1' is: it may run without a key.
    Break: the brackets not stripped."""
    assert is_loopback("[::1]") and is_loopback("::1")
    assert not is_loopback("[2001:db8::1]")
    _settings("--host", "[::1]")  # no key needed


def test_a_blank_api_key_is_refused_before_the_other_options():
    """A blank --api-key is named as such, ahead of any other bad option.  Break: only '' counted as
    blank (a key of spaces then slips to a later check, and another option's error is reported)."""
    with pytest.raises(ConfigError, match="the API key is empty"):
        _settings("--api-key", "  ", "--max-connections", "0")


def test_a_zero_prefix_cache_turns_it_off_and_is_accepted():
    """--prefix-cache-mib 0 is the documented way to turn prefix caching off: accepted, 0 bytes.
    Break: 0 refused as --max-kv-mib 0 is."""
    assert _settings("--prefix-cache-mib", "0")["prefix_cache_bytes"] == 0


def test_a_kv_budget_under_one_mib_is_accepted():
    """--max-kv-mib takes fractions: 0.5 is 512 KiB (only a budget under one byte is refused).
    Break: anything under 1 MiB refused."""
    assert _settings("--max-kv-mib", "0.5")["max_kv_bytes"] == 1 << 19


def test_more_options_reach_the_settings():
    """--default-max-tokens, --no-draft-cap and --served-model-name's further names (the aliases,
    without the first) are passed on.  Breaks: an option dropped, the first name also an alias."""
    kw = _settings("--default-max-tokens", "7", "--no-draft-cap", "--served-model-name", "alpha", "beta", "gamma")
    assert kw["default_max_tokens"] == 7 and kw["draft_cap"] is False
    assert kw["model_name"] == "alpha" and kw["model_aliases"] == ("beta", "gamma")
    assert _settings()["draft_cap"] is True


@pytest.mark.parametrize("argv, says", [(["--replicas", "0"], "replicas must be >= 1, got 0"),
                                        (["--replica-cpus", "0"], "replica CPUs must be > 0, got 0")])
def test_zero_ray_replicas_or_cpus_are_refused(argv, says):
    """--replicas 0 and --replica-cpus 0 are refused before anything starts.  Breaks: the bound loosened to 0."""
    with pytest.raises(ConfigError, match=says):
        _settings(*argv)


def test_with_ray_the_port_is_not_bound_here():
    """With --ray the gateway listens in Ray Serve, not in this process: a port that this process
    could not bind is no reason to refuse (no bind is tried).  Break: the port check run with --ray too."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        with pytest.raises(ConfigError, match="cannot listen on"):
            _settings("--port", port)
        assert _settings("--port", port, "--ray")["api_key"] is None


def test_timeouts_template_trust_and_reasoning_reach_the_settings():
    """--session-ttl, --body-timeout, --trust-request-chat-template and --reasoning-parser are passed
    on (each was dropped by one break, leaving the settings' default)."""
    kw = _settings("--session-ttl", "12.5", "--body-timeout", "3", "--trust-request-chat-template",
                   "--reasoning-parser", "none")
    assert kw["session_ttl_s"] == 12.5 and kw["body_timeout_s"] == 3.0
    assert kw["trust_request_chat_template"] is True and kw["reasoning_parser"] == "none"


def test_a_chat_template_that_does_not_compile_is_refused_by_the_option_check():
    """A --chat-template that does not compile is refused by the option check itself, before any
    model loads.  Break: the template read only when the models load."""
    with pytest.raises(ConfigError, match="does not compile"):
        _settings("--chat-template", "{% for m in messages %}")
