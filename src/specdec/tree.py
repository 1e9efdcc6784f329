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
    check_order(parents)


def check_order(parents: Tensor) -> None:  # parents: [N]
    """Raise :class:`ConfigError` unless every parent is -1 or an earlier node's index."""
    n = parents.numel()
    if n and (int(parents.min()) < -1 or bool((parents >= torch.arange(n)).any())):
        raise ConfigError("tree parents must be -1 (root level) or the index of an earlier node")


def depths(parents: Tensor) -> Tensor:  # [N] -> [N] int64, root level = 0
    out: list[int] = []  # a list, then one tensor: per-element tensor writes cost ~2 us each
    for p in parents.tolist():
        out.append(0 if p < 0 else out[p] + 1)
    return torch.tensor(out, dtype=parents.dtype)


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
    mask = torch.zeros((n, n), dtype=torch.bool)
    rows, cols = [], []  # every (node, node on its path) pair, set in one indexed write
    for i, p in enumerate(paths(parents)):
        rows += [i] * len(p)
        cols += p
    mask[rows, cols] = True
    return mask


def is_chain(parents: Tensor) -> bool:
    return bool(torch.equal(parents, torch.arange(-1, parents.numel() - 1, dtype=parents.dtype)))


def with_root(parents: Tensor) -> Tensor:  # [N] -> [N+1]
    """The tree of ``[pending] + nodes``: the pending token is node 0 and the old roots hang below it."""
    return torch.cat([torch.tensor([-1], dtype=torch.long), torch.where(parents < 0, 0, parents + 1)])


def attention_schedule(parents: Tensor, n: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """How exact tree attention visits the last ``n`` nodes of a tree region of ``m`` nodes.

    Each node's query attends to ``cache[:start + len(path)]`` with its root path laid out in
    the region's first slots, exactly as token-by-token decoding of that path would have it.
    The region starts in node order (slot k holds node k).  Nodes are visited depth-first
    (lexicographic order of their paths), so a node shares its ancestors' slots with the node
    visited before it and usually needs one key/value write (its own), not ``depth`` of them.

    Returns one step per node in visiting order: ``(j, length, writes)`` with ``j`` the node's
    index among the ``n`` scored nodes, ``length`` its path length (the attention covers
    ``start + length`` positions) and ``writes`` the ``(slot, node)`` pairs (region offsets) to
    copy from the saved region before attending.  Pure function of ``parents``.
    """
    m = parents.numel()
    all_paths = paths(parents)
    order = sorted(range(m - n, m), key=lambda i: all_paths[i])
    occupant = list(range(m))
    steps: list[tuple[int, int, list[tuple[int, int]]]] = []
    for i in order:
        p = all_paths[i]
        writes = [(k, v) for k, v in enumerate(p) if occupant[k] != v]
        for k, v in writes:
            occupant[k] = v
        steps.append((i - (m - n), len(p), writes))
    return steps
