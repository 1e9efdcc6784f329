"""The edge-cloud wire modes and the rules each may run on the cloud.

Kept apart from :mod:`specdec.remote.protocol` (the request and response bodies, built on
pydantic) so that the command line can offer ``--wire`` without importing pydantic (~0.3 s).
"""

from __future__ import annotations

#: what crosses the wire besides the draft ids (see :mod:`specdec.remote.protocol`)
WIRE_MODES: tuple[str, ...] = ("greedy", "coupled", "sparse-q", "lossy-scalar")

#: rules each wire mode may run on the cloud, the first being the default
WIRE_METHODS: dict[str, tuple[str, ...]] = {
    "greedy": ("greedy",),
    "coupled": ("coupled",),
    "sparse-q": ("block", "token"),
    "lossy-scalar": ("lossy_resample_p", "lossy_strict_residual", "lossy_ratio_threshold", "lossy_p_threshold"),
}
