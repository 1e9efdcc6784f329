"""Token-tree bookkeeping shared by the models, the target session and the drafters.

A tree of N nodes is given by ``parents`` [N] int64 in topological order: ``parents[i] == -1``
for a child of the last committed token, else ``parents[i] < i`` (SpecInfer, Miao et al. 2024;
Medusa, Cai et al. 2024).  These helpers are pure functions of ``parents``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.errors import ConfigError


def check_parents(parents: Tensor, n: int) -> None:
    """Raise :class:`ConfigError` unless ``parents`` is a valid topological tree of ``n`` nodes."""
    if parents.dim() != 1 or parents.numel() != n:
        raise ConfigError(f"a tree needs one parent per draft token: {parents.numel()} parents for {n} tokens")
    if n and (parents.min() < -1 or bool((parents >= torch.arange(n)).any())):
        raise ConfigError("tree parents must be -1 (root level) or the index of an earlier node")


def depths(parents: Tensor) -> Tensor:  # [N] -> [N] int64, root level = 0
    out = torch.empty_like(parents)
    for i, p in enumerate(parents.tolist()):
        out[i] = 0 if p < 0 else out[p] + 1
    return out


def path(parents: Tensor, i: int) -> list[int]:
    """Node indices from the root level down to node ``i`` (inclusive)."""
    par = parents.tolist()
    out = []
    while i >= 0:
        out.append(i)
        i = par[i]
    return out[::-1]


def paths(parents: Tensor) -> list[list[int]]:
    """``path(parents, i)`` for every node (one pass)."""
    out: list[list[int]] = []
    for p in parents.tolist():
        out.append((out[p] if p >= 0 else []) + [len(out)])
    return out


def ancestor_mask(parents: Tensor) -> Tensor:  # [N] -> [N, N] bool: [i, j] = j is i or an ancestor of i
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def is_chain(parents: Tensor) -> bool:
    return bool(torch.equal(parents, torch.arange(-1, parents.numel() - 1, dtype=parents.dtype)))


def with_root(parents: Tensor) -> Tensor:  # [N] -> [N+1]
    """The tree of ``[pending] + nodes``: the pending token is node 0 and the old roots hang below it."""
    return torch.cat([torch.tensor([-1], dtype=torch.long), torch.where(parents < 0, 0, parents + 1)])
