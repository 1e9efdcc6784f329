"""γ auto on a modelled clock, for tests whose assertions must not follow the machine's timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.gamma import CostGamma


@dataclass
class ModelledCostGamma(CostGamma):
    """:class:`CostGamma` that notes the verification seconds each round hands it (``seen``) and
    decides on modelled ones instead: a drafted token costs ``draft_token_s``, a verification
    pass ``pass_s`` plus ``row_s`` per drafted row.  The real controller follows measured timings,
    so on a busy test machine it may rightly stop drafting (a CI run with another worker beside
    it once drafted in 3 of 93 rounds); on this clock its choices depend on acceptance alone."""

    draft_token_s: float = 0.12
    pass_s: float = 1.0
    row_s: float = 0.06
    seen: list[float] = field(default_factory=list)

    def update(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        self.seen.append(target_s)
        super().update(gamma=gamma, accepted=accepted, draft_s=self.draft_token_s * gamma,
                       target_s=self.pass_s + self.row_s * gamma, other_s=0.0)
