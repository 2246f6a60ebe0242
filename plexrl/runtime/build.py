"""`build_runner`: THE builder of a `Runner` from plain settings, used by every entry point: `plexrl run JOB.yaml`
(`runtime/jobs.run_jobs`), a cluster (`cluster.make_runner`, from its config) and the server
(`server.api.server_runner`, through `make_runner`). Its defaults are a cluster config's (spread+backfill,
hrrs, no budgets); the runner is built whole: nothing is set on it afterwards."""

from __future__ import annotations

from typing import Any

from plexrl.hooks.base import Hook
from plexrl.planner.policies import ORDERINGS, FairShare, placement_policy
from plexrl.planner.shares import Usage
from plexrl.runtime.executor import Executor
from plexrl.runtime.records import Budgets
from plexrl.runtime.runner import Runner


def build_runner(
    executor: Executor,
    hooks: list[Hook],
    *,
    placement: str = "spread+backfill",
    max_load: float = 1.0,
    ordering: str = "hrrs",
    budgets: Budgets | None = None,
    validate: bool = False,
    dask: bool = False,
    lookahead: bool = True,
    hold_ahead: bool | None = None,
    fair_share: bool = False,
    share_half_life_s: float | None = None,
    batch_rollouts: bool = False,
    **options: Any,
) -> Runner:
    """The `Runner` over `executor` with these policies: `placement` (capped at `max_load` where it is
    load-aware), `ordering` (by user first with `fair_share`: `FairShare`, service seconds decayed over
    `share_half_life_s`), `budgets` per tier. `dask`: the executor's round trip costs milliseconds, so each
    service gets its next node early (`lookahead`; held back while a node the ordering prefers is due before
    the running one ends, `hold_ahead`) and cpu nodes shorter than a round trip run next to their
    inputs. `batch_rollouts`: co-scheduled rollouts (`planner/batches.py`: several LoRA jobs' rollouts in one
    vLLM call), on either driver but not on worker groups (`ranks` > 1). `options` (`forget_ended`, `on_closed`,
    `checkpoint_at`, `poll`) go to the `Runner` as they are."""
    if batch_rollouts and getattr(executor, "ranks", 1) > 1:
        raise ValueError("batch_rollouts (co-scheduled rollouts) does not run on worker groups (services.ranks > 1); "
                         "set services.ranks: 1 or batch_rollouts: false")  # fmt: skip
    order = ORDERINGS[ordering]()
    if fair_share:
        order = FairShare(order)
    usage = Usage(share_half_life_s) if share_half_life_s is not None else None
    return Runner(
        executor, hooks=hooks, placement=placement_policy(placement, max_load), ordering=order, budgets=budgets,
        validate=validate, usage=usage, lookahead=dask and lookahead, hold_ahead=hold_ahead,
        inline_below=0.01 if dask else None, batch_rollouts=batch_rollouts, **options,
    )  # fmt: skip


__all__ = ["build_runner"]
