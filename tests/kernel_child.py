"""A quantised tiny model decoded in a child process with chosen environment variables (kernels
on / off / failing to build): what the kernel tests compare across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import json, sys, torch
from specdec.models import kernels
from specdec.models.linear import vnni_available
from specdec.models.native import NativeCausalLM
model = NativeCausalLM.from_folder(sys.argv[1], quant=sys.argv[2], batch_invariant=True, int8_kernel="fbgemm",
                                   gguf=sys.argv[3] if len(sys.argv) > 3 else None)
ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(1))
cache = model.new_cache(32)
logits = torch.cat([model.forward(ids[:6], cache)] + [model.forward(ids[i : i + 1], cache) for i in range(6, 12)])
print(json.dumps({"q8": vnni_available(), "q4": kernels.q4_available(), "logits": logits.flatten()[::97].tolist(),
                  "sum": float(logits.double().sum())}))
"""


def decode_in_child(folder: Path, quant: str, gguf: Path | None = None, **env: str) -> tuple[dict, str]:
    """({"q8", "q4": whether those kernels ran (q8: the few-row int8 product, VNNI or AVX2), "logits": a
    sample, "sum"}, the child's stderr):
    the ``quant`` target of ``folder`` (its layer blocks from ``gguf`` where given) scoring 12 tokens
    (a 6-token block, then one by one)."""
    args = [str(folder), quant] + ([str(gguf)] if gguf is not None else [])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPECDEC_KERNELS": "1", "SPECDEC_ATTENTION": "1", **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
