"""Self-speculative drafter names through the CLI (tiny random Llama with SmolLM2's tokenizer)."""

from __future__ import annotations

import json

import pytest

from specdec.cli import main
from tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("target"), seed=0, max_positions=64, layers=3))


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line and not line.startswith("[specdec]")]
    assert len(lines) == 1 and lines[0].startswith("specdec: error:") and "Traceback" not in err, err
    return lines[0]


def test_generate_search_and_use_a_skip_set(capsys, tiny_target, tmp_path):
    outs = {}
    for draft in ("none", "layerskip:2"):
        code, out, err = _run(capsys, "generate", "-p", "abc abc", "--target", tiny_target, "--draft", draft, "-n", "12", "--json")
        assert code == 0, err
        outs[draft] = json.loads(out)
    assert outs["layerskip:2"]["token_ids"] == outs["none"]["token_ids"]
    assert outs["layerskip:2"]["stats"]["drafter"] == "layerskip:2"
    skip_file = tmp_path / "skip.json"
    code, _, err = _run(capsys, "train", "skip", "--target", tiny_target, "--out", str(skip_file), "--prompts", "2",
                        "--new-tokens", "4", "--max-steps", "2")
    assert code == 0, err
    saved = json.loads(skip_file.read_text())
    assert saved["plan"]["n_layers"] == 3 and {"alpha_t0", "speedup_t0"} <= set(saved["expected"])
    assert saved["draft_vocab"] == "full"  # no reduced vocabulary for this target
    polished = tmp_path / "polished.json"
    code, _, err = _run(capsys, "train", "skip", "--target", tiny_target, "--out", str(polished), "--prompts", "2",
                        "--new-tokens", "4", "--from", str(skip_file), "--polish", "1", "--cost", "params")
    assert code == 0, err
    got = json.loads(polished.read_text())  # the start scored, then one pass toggling each of the 6 sub-layers
    assert got["evaluations"] == 1 + 2 * 3 and got["command"].endswith(f"--from {skip_file} --polish 1 --cost params")
    other = tmp_path / "other.json"
    other.write_text('{"plan": {"n_layers": 5, "skip_attn": [1], "skip_mlp": []}}')
    code, _, err = _run(capsys, "train", "skip", "--target", tiny_target, "--out", str(polished), "--from", str(other))
    assert code == 2 and "5 layers, the target has 3" in _one_error_line(err)
    code, out, err = _run(capsys, "generate", "-p", "abc abc", "--target", tiny_target, "--draft", f"self-skip:{skip_file}",
                          "-n", "12", "--json")
    assert code == 0, err
    assert json.loads(out)["token_ids"] == outs["none"]["token_ids"]


def test_a_view_drafts_over_the_target_folder_s_reduced_vocabulary(tiny_target, tmp_path):
    """A target folder's ``draft_vocab.json`` is the vocabulary its views draft over (the head cut to
    those rows), unless ``--draft-vocab full``; greedy output stays plain greedy's either way."""
    import shutil

    import torch

    from specdec.engine import Engine, EngineConfig
    from specdec.sampling import SamplingConfig

    folder = tmp_path / "t"
    shutil.copytree(tiny_target, folder)
    ids = list(range(0, 49152, 3))
    (folder / "draft_vocab.json").write_text(json.dumps({"ids": ids}))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12)
    outs = {}
    for vocab in ("auto", "full"):
        engine = Engine.build(EngineConfig(target=str(folder), draft="layerskip:2", dtype="float32", draft_vocab=vocab))
        view = engine.drafter.view
        assert (view.vocab_ids is not None) == (vocab == "auto"), vocab
        if vocab == "auto":
            assert torch.equal(view.vocab_ids, torch.tensor(ids))
        outs[vocab] = engine.generate("abc abc", cfg).token_ids
    plain = Engine.build(EngineConfig(target=str(folder), draft="none", dtype="float32")).generate("abc abc", cfg).token_ids
    assert outs["auto"] == outs["full"] == plain


@pytest.mark.parametrize(
    "draft,needle",
    [("layerskip:3", "1 <= K < 3"), ("layerskip:x", "layer count"), ("self-skip", "no searched skip set"),
     ("self-skip:/nonexistent/skip.json", "does not exist"), ("kangaroo", "no kangaroo adapter"),
     ("kangaroo:/nonexistent/k.safetensors", "does not exist")],
)
def test_bad_self_spec_names(capsys, tiny_target, draft, needle):
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", tiny_target, "--draft", draft, "-n", "4")
    assert code == 2 and needle in _one_error_line(err)


@pytest.mark.parametrize("draft,needle", [("self-skip", "no searched skip set ships for 'gemma-3-270m'"),
                                           ("kangaroo", "no kangaroo adapter ships for 'gemma-3-270m'")])
def test_nothing_shipped_for_a_registry_target_fails_before_it_loads(capsys, monkeypatch, draft, needle):
    """A registry target with no shipped skip set / adapter: refused from the names alone (the target
    is never loaded, and need not be installed); a target that has one is let through to its load."""
    import specdec.engine as engine_mod

    monkeypatch.setattr(engine_mod.registry, "load", lambda *a, **k: pytest.fail("the target loaded"))
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "gemma-3-270m", "--draft", draft, "-n", "4")
    assert code == 2 and needle in _one_error_line(err)
    monkeypatch.setattr(engine_mod.registry, "load", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("loading")))
    with pytest.raises(RuntimeError, match="loading"):
        engine_mod.Engine.build(engine_mod.EngineConfig(target="smollm2-135m", draft=draft))


def test_hf_backend_refuses_clearly(capsys, tiny_target):
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", tiny_target, "--backend", "hf", "--draft", "layerskip:1")
    errors = [line for line in err.splitlines() if "specdec: error:" in line]  # after transformers' progress bar
    assert code == 2 and len(errors) == 1 and "native backend" in errors[0] and "Traceback" not in err


def test_models_lists_the_families_and_bench_refuses_draft_model_modes(capsys):
    code, out, _ = _run(capsys, "models", "--json")
    names = {row["name"] for row in json.loads(out)}
    assert {"layerskip:K", "self-skip", "swift", "kangaroo"} <= names
    code, _, err = _run(capsys, "bench", "--draft", "layerskip:8", "--modes", "plain,edge_only")
    assert code == 2 and "edge_only" in _one_error_line(err)


def test_train_kangaroo_resumes_and_its_adapter_drafts(capsys, tiny_target, tmp_path):
    out_file = tmp_path / "k.safetensors"
    args = ("train", "kangaroo", "--target", tiny_target, "--out", str(out_file), "--layers", "1", "--prompts", "3",
            "--new-tokens", "4", "--steps", "3", "--batch", "2", "--positions", "8", "--top-k", "4")
    code, _, err = _run(capsys, *args)
    assert code == 0, err
    card = json.loads((tmp_path / "k.json").read_text())
    assert card["steps"] == 3 and {"kangaroo", "layerskip:1"} <= set(card["held_out"])
    code, _, err = _run(capsys, *args)  # everything is on disk: data reused, training resumed at its end
    assert code == 0 and "from " in err and "resuming from step 3" in err, err
    outs = {}
    for draft in ("none", f"kangaroo:{out_file}"):
        code, out, err = _run(capsys, "generate", "-p", "abc abc", "--target", tiny_target, "--draft", draft, "-n", "12",
                              "--json", "-g", "3")
        assert code == 0, err
        outs[draft] = json.loads(out)
    assert outs[f"kangaroo:{out_file}"]["token_ids"] == outs["none"]["token_ids"]
    code, _, err = _run(capsys, "train", "kangaroo", "--target", tiny_target, "--out", str(out_file), "--layers", "3")
    assert code == 2 and "1 <= layers < 3" in _one_error_line(err)
