"""What the planner reads from a runtime section (`PlannerSettings`), and the one function that turns those
settings into its policies (`policies_of`). `plexrl.runtime.config.RuntimeConfig` has every field; the planner
names them by a Protocol so that it imports nothing above itself. `Planner.from_config` builds a planner from
one such section: the runner receives the planner built, nothing is copied field by field."""

from __future__ import annotations

from typing import Any, Protocol

from plexrl.planner.admission import UserLimits
from plexrl.planner.placement import placement_policy
from plexrl.planner.policies import ORDERINGS, FairShare
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
    def batch_window_s(self) -> float: ...  # how long a session's sample waits for same-base partners (`batches.py`)

    @property
    def phase_window_s(self) -> float: ...  # how long it lets other work go first for busy partners (`batches.py`)

    @property
    def state_moves(self) -> str: ...  # "planned" (the StateManager's) or "exclusive" (time-slicing's)

    @property
    def validate_state(self) -> bool: ...

    @property
    def max_jobs_per_user(self) -> int | None: ...

    @property
    def max_share_per_user(self) -> float | None: ...


def policies_of(section: PlannerSettings) -> dict[str, Any]:
    """The keyword arguments of `Planner` for a runtime section: `placement` (capped at `max_load` where it is
    load-aware), `ordering` (by user first with `fair_share`, service seconds decayed over `share_half_life_s`);
    on Dask, where the round trip costs milliseconds, each service gets its next node early (`lookahead`, held
    back as `hold_ahead` says) and cpu nodes shorter than a round trip run next to their inputs (on the
    in-process driver neither: nothing is gained). Per user (`admission.py`): `max_jobs_per_user` and
    `max_share_per_user` hold a user's further queued jobs; with `fair_share` the queued jobs are weighed users
    first. `state_moves: exclusive` (implied by `ordering: time-slicing`): the StateManager's exclusive mode."""
    order = ORDERINGS[section.ordering]()
    # exclusive time-slicing (the llm-d / OpenRL design, `policies.TimeSlicing`): FIFO by ready time, whole-state
    # moves at each hand-over, nothing sent ahead: no fair share, no lookahead, whatever else the section says
    slicing = section.ordering == "time-slicing"
    if section.fair_share and not slicing:
        order = FairShare(order)
    dask = section.driver == "dask"
    return dict(
        placement=placement_policy(section.placement, section.max_load),
        ordering=order,
        usage=Usage(section.share_half_life_s),
        exclusive=slicing or section.state_moves == "exclusive",
        lookahead=dask and section.lookahead and not slicing,
        hold_ahead=section.hold_ahead,
        inline_below=INLINE_BELOW_S if dask else None,
        batch_rollouts=section.batch_rollouts,
        batch_window=section.batch_window_s,
        phase_window=section.phase_window_s,
        validate=section.validate_state,
        user_limits=UserLimits(section.max_jobs_per_user, section.max_share_per_user),
        fair_admission=section.fair_share,
    )


__all__ = ["INLINE_BELOW_S", "PlannerSettings", "policies_of"]
