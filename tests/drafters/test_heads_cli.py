"""Draft heads through the command line: --draft FOLDER on a tiny target, native or hf (greedy = plain),
the registry names in `specdec models`, and one-line errors where features cannot reach the head."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.cli import main
from specdec.heads.modules import save_head
from tiny import make_tiny, random_head


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = make_tiny(tmp_path_factory.mktemp("target"), seed=0, max_positions=64)
    head = tmp_path_factory.mktemp("head")
    save_head(random_head("eagle3", hidden=32, vocab=49152, draft_vocab=256, taps=(1, 2), heads=4, kv_heads=2,
                          head_dim=8, inter=64), head, dtype=torch.float32)
    return str(target), str(head)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_generate_with_a_head_folder_equals_plain_greedy(capsys, folders, backend):
    """On either backend (the hf one hands out transformers' hidden states, and layer 2's output,
    the final norm's input, through a hook): chains and trees equal plain greedy decoding."""
    target, head = folders
    common = ["generate", "-p", "def f(x):", "--target", target, "-n", "10", "--json", "-t", "0", "--backend", backend]
    code, out, err = _run(capsys, *common, "--draft", "none")
    assert code == 0, err
    plain = json.loads(out)["token_ids"]
    for extra in ([], ["--tree", "8", "--tree-min-prob", "0"]):  # a random head is flat: no node reaches the default floor
        code, out, err = _run(capsys, *common, "--draft", head, "-g", "3", *extra)
        assert code == 0, err
        payload = json.loads(out)
        assert payload["token_ids"] == plain and payload["stats"]["draft_tokens_proposed"] > 0


def test_heads_are_listed_and_refused_where_features_cannot_go(capsys, folders):
    """Over the wire the features stay on the server: the edge refuses a head in one line."""
    target, head = folders
    code, out, _ = _run(capsys, "models", "--json")
    names = {r["name"] for r in json.loads(out)}
    assert {"smollm2-135m-eagle3", "smollm2-135m-eagle1", "smollm2-135m-medusa", "smollm2-135m-mtp"} <= names
    code, _, err = _run(capsys, "generate", "-p", "x", "--remote", "http://127.0.0.1:9", "--draft", head)
    assert code == 2 and "does not send" in err and "Traceback" not in err


@pytest.mark.parametrize("batching", [False, True], ids=["serialised", "batching"])
def test_server_runs_a_head(folders, batching):
    """`specdec serve --draft HEAD`, serialised or batching (the head's verification passes then
    carry its features through the scheduler's batches, several requests' rows in one pass):
    OpenAI completions with the head, four choices side by side, chains and trees, = plain greedy."""
    import httpx

    from serverproc import ServerProcess
    from specdec.engine import Engine, EngineConfig
    from specdec.sampling import SamplingConfig

    target, head = folders
    key = "k-heads"
    prompts = ["def f(x):", "import os\n", "class A:", "x = [1, 2"]
    engine = Engine.build(EngineConfig(target=target, draft="none", dtype="float32"))
    refs = [engine.generate(p, SamplingConfig(temperature=0.0, max_new_tokens=12)).text for p in prompts]
    extra = [] if batching else ["--no-batching"]
    with ServerProcess.cli("--target", target, "--draft", head, *extra, "--dtype", "float32", "--api-key", key,
                           "--gamma", "3") as srv:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            bodies = []
            for tree in (None, 8):
                payload = {"model": model, "prompt": prompts, "max_tokens": 12, "temperature": 0}
                if tree is not None:
                    payload["tree"] = tree
                r = client.post("/v1/completions", json=payload)
                assert r.status_code == 200, r.text
                bodies.append(r.json())
            metrics = client.get("/metrics").text
    for body in bodies:
        assert [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] == refs
        assert body["specdec"]["draft_tokens_proposed"] > 0
    if batching:  # some pass held more than one sequence
        sizes = [line for line in metrics.splitlines()
                 if line.startswith("specdec_scheduler_batch_size_bucket") and 'model="target"' in line and 'le="1.0"' in line]
        count = [line for line in metrics.splitlines()
                 if line.startswith("specdec_scheduler_batch_size_count") and 'model="target"' in line]
        assert sizes and count and float(sizes[0].split()[-1]) < float(count[0].split()[-1])
