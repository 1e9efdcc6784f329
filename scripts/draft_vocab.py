"""Write a draft model's reduced vocabulary (``draft_vocab.json``) from token counts.

The counts are how often each token occurs in the target's own replies (``specdec train online
--heads ...`` saves them as ``token_counts.pt``); the vocabulary is the ``--size`` most frequent
tokens plus the end-of-sequence ids, sorted.  A draft folder holding the file drafts over those
tokens only (``--draft-vocab auto``, the default): its LM head computes a third of the rows, the
other tokens get probability 0 in the draft — which no verification rule needs for exactness.

    python scripts/draft_vocab.py --counts token_counts.pt --size 16384 --out src/specdec/data/smollm2-135m-draft
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", required=True, help="a [V] int64 tensor of token counts (torch.save)")
    ap.add_argument("--size", type=int, default=16384, help="tokens kept (plus the end-of-sequence ids)")
    ap.add_argument("--eos", default="2", help="comma list of end-of-sequence ids always kept")
    ap.add_argument("--out", required=True, help="the draft model's folder")
    a = ap.parse_args()
    from specdec.train.heads import top_tokens

    counts = torch.load(a.counts, weights_only=True)
    eos = tuple(int(x) for x in a.eos.split(","))
    ids = top_tokens(counts, a.size, eos)
    share = float(counts[ids].sum()) / float(counts.sum())
    out = Path(a.out) / "draft_vocab.json"
    out.write_text(json.dumps({"ids": ids.tolist(), "size": int(ids.numel()), "vocab": int(counts.numel()),
                               "reply_tokens_counted": int(counts.sum()), "share_of_reply_tokens": round(share, 5),
                               "command": f"python scripts/draft_vocab.py --counts {Path(a.counts).name} --size {a.size} "
                                          f"--eos {a.eos} --out {a.out}"}) + "\n")
    print(f"{out}: {ids.numel()} tokens, {share:.4f} of the counted reply tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
