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
