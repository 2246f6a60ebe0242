"""What the planner reads from a runtime section (`PlannerSettings`), and the one function that turns those
settings into its policies (`policies_of`). `plexrl.runtime.config.RuntimeConfig` has every field; the planner
names them by a Protocol so that it imports nothing above itself. `Planner.from_config` builds a planner from
one such section: the runner receives the planner built, nothing is copied field by field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from plexrl.planner.policies import ORDERINGS, FairShare, OrderingPolicy, PlacementPolicy, placement_policy
from plexrl.planner.shares import Usage

INLINE_BELOW_S = 0.01  # on Dask, a cpu node observed shorter than this runs next to its inputs (a round trip)


class PlannerSettings(Protocol):
    """The runtime section's fields the planner's policies come from."""

    @property
    def driver(self) -> str: ...  # "dask": round trips cost milliseconds (lookahead, inline cpu nodes)

    @property
    def placement(self) -> str: ...

    @property
    def max_load(self) -> float: ...

    @property
    def ordering(self) -> str: ...

    @property
    def fair_share(self) -> bool: ...

    @property
    def share_half_life_s(self) -> float: ...

    @property
    def lookahead(self) -> bool: ...

    @property
    def hold_ahead(self) -> bool | None: ...

    @property
    def batch_rollouts(self) -> bool: ...

    @property
    def validate_state(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Policies:
    """A planner's policies, resolved from settings (the keyword arguments of `Planner`)."""

    placement: PlacementPolicy
    ordering: OrderingPolicy
    usage: Usage
    lookahead: bool
    hold_ahead: bool | None
    inline_below: float | None
    batch_rollouts: bool
    validate: bool


def policies_of(section: PlannerSettings) -> Policies:
    """`placement` (capped at `max_load` where it is load-aware), `ordering` (by user first with `fair_share`,
    service seconds decayed over `share_half_life_s`); on Dask, where the round trip costs milliseconds, each
    service gets its next node early (`lookahead`, held back as `hold_ahead` says) and cpu nodes shorter than
    a round trip run next to their inputs. On the in-process driver neither: nothing is gained."""
    order = ORDERINGS[section.ordering]()
    if section.fair_share:
        order = FairShare(order)
    dask = section.driver == "dask"
    return Policies(
        placement=placement_policy(section.placement, section.max_load),
        ordering=order,
        usage=Usage(section.share_half_life_s),
        lookahead=dask and section.lookahead,
        hold_ahead=section.hold_ahead,
        inline_below=INLINE_BELOW_S if dask else None,
        batch_rollouts=section.batch_rollouts,
        validate=section.validate_state,
    )


__all__ = ["INLINE_BELOW_S", "PlannerSettings", "Policies", "policies_of"]
