import hashlib

import pytest

from specdec.errors import MissingPackageError, ModelNotFoundError
from specdec.models import registry


def test_bundled_draft_is_intact():
    spec = registry.REGISTRY["smollm2-135m-draft"]
    folder = registry.resolve("smollm2-135m-draft").folder
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert digest == spec.sha256


def test_unknown_and_missing(monkeypatch, tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        registry.resolve("definitely-not-a-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="neither"):
        registry.resolve(str(tmp_path / "empty"))
    spec = registry.ModelSpec("ghost", "x", registry.ChunkedGGUF("ghost-part{i}", "1.0", "g{i}/p.bin", 3, "g.gguf"))
    monkeypatch.setitem(registry.REGISTRY, "ghost", spec)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(MissingPackageError, match="ghost-part1==1.0 ghost-part2==1.0 ghost-part3==1.0"):
        registry.resolve("ghost")


def test_hub_ids_are_recognised():
    r = registry.resolve("HuggingFaceTB/SmolLM2-135M")
    assert r.hub_id == "HuggingFaceTB/SmolLM2-135M" and r.folder is None


def test_an_unreachable_hub_fails_at_once_and_only_the_cache_is_read(monkeypatch, tmp_path):
    """No name resolution for the hub: the hub client is asked for the local cache only (online
    it retries for ~50 s before failing), and the error says what happened."""
    from transformers import AutoTokenizer

    asked = []
    real = AutoTokenizer.from_pretrained.__func__

    def spy(cls, name, *args, **kwargs):  # noqa: ANN001, ANN202
        asked.append(kwargs.get("local_files_only"))
        return real(cls, name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.invalid")  # .invalid never resolves (RFC 2606)
    assert registry._hub_host() == "hub.example.invalid" and not registry._hub_reachable()
    with pytest.raises(ModelNotFoundError, match=r"hub \(hub.example.invalid\) cannot be reached .* not in the local cache"):
        registry.load("someorg/not-a-model")
    assert asked == [True]


def test_chunk_assembly_checks_size(tmp_path, monkeypatch):
    parts = []
    for i in (1, 2):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(bytes([i]) * 10)
        parts.append(p)
    spec = registry.ModelSpec("chunky", "x", registry.ChunkedGGUF("d{i}", "1", "r{i}", 2, "out.gguf"), size=20,
                              sha256=hashlib.sha256(bytes([1]) * 10 + bytes([2]) * 10).hexdigest())
    monkeypatch.setattr(registry, "_locate", lambda dist, rel, pip, model: parts[int(dist[1:]) - 1])
    out = registry._assemble(spec, spec.source, tmp_path / "gguf")
    assert out.read_bytes() == bytes([1]) * 10 + bytes([2]) * 10
    registry._check_sha(spec, out)  # passes and leaves a marker
    bad = registry.ModelSpec("chunky2", "x", spec.source, size=21)
    with pytest.raises(Exception, match="wrong size"):
        registry._assemble(bad, bad.source, tmp_path / "gguf2")
