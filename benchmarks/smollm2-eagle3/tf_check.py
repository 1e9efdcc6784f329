"""Why a head's held-out agreement and its benchmark acceptance differ: on the benchmark's own
16 prompts, the head's teacher-forced step-1 top-1 agreement with the target's greedy continuation
(128 tokens), next to the acceptance of live drafting with γ = 1 (float32 head, and the head as
`--draft-dtype auto` runs it). Usage: python tf_check.py HEAD_FOLDER"""
import sys, torch
from pathlib import Path
torch.set_num_threads(2)
from specdec.models.registry import load
from specdec.bench.workloads import BUILTIN
from specdec.text import encode_prompt
from specdec.train.data import features
from specdec.train.heads import Batch, step_outputs
from specdec.heads.modules import load_head
from specdec.drafters.heads import build
from specdec.decoder import SpeculativeDecoder
from specdec.verify import get_rule
from specdec.gamma import FixedGamma
from specdec.sampling import SamplingConfig
t = load("smollm2-135m")  # default dtype
m = t.model
folder = Path(sys.argv[1])
head = load_head(folder)
embed = m.embed.float()
agree = {}; n = {}; live = {}
for p in BUILTIN:
    ids = encode_prompt(t.tokenizer, p.text, chat=p.category == "chat")
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=128)
    plain = SpeculativeDecoder(m, None, get_rule("greedy")).generate(ids, cfg).tokens
    seq = torch.tensor(ids + plain)
    f = features(m, seq, (2, 15, 27)).float()  # [n, 4, D]
    b = Batch(seq[None], f[None], torch.tensor([seq.numel()]), torch.tensor([len(ids)]))
    with torch.no_grad():
        logits, off, mask, _ = step_outputs(head, b, embed)[0]
    pred = head.d2t[logits[0].argmax(-1)]  # row t predicts token t+2
    tgt = seq[2:]
    rows = torch.arange(len(ids) - 2, seq.numel() - 2)  # predictions of reply tokens
    a = (pred[rows] == tgt[rows]).float().sum().item()
    agree[p.category] = agree.get(p.category, 0) + a; n[p.category] = n.get(p.category, 0) + rows.numel()
    for label, kw in (("f32", {}), ("auto", dict(int8_head=True, dtype=torch.bfloat16))):
        dr, _ = build(folder, m, **kw)
        out = SpeculativeDecoder(m, dr, get_rule("greedy"), gamma=FixedGamma(1)).generate(ids, cfg)
        assert out.tokens == plain
        s = out.stats
        acc = live.setdefault((label, p.category), [0, 0])
        acc[0] += s.draft_tokens_accepted; acc[1] += s.draft_tokens_proposed
for c in agree:
    print(c, "teacher-forced top1", round(agree[c] / n[c], 3), n[c])
for k, (a, b) in live.items():
    print(k, "live γ=1 acceptance", round(a / b, 3), b)
