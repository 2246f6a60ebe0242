"""The accounting (plexrl/accounting.py) on hand-made timelines: each bucket counts what it is.

- a weight load into the generation engine inside a rollout node's span is part of that node's busy time,
  never added twice, and is reported as the `weights` breakdown;
- a job's first load on its service (engine build, vLLM import and start) is `startup`, not `swap`;
- busy + swap + startup + idle adds up to the allocated time, and the jobs' allocations to the service's.
"""

from __future__ import annotations

import pytest

from plexrl.accounting import JobFacts, account, format_report
from plexrl.hooks.timeline import Span


def span(job: str, kind: str, start: float, end: float, lane: str = "service-0") -> Span:
    return Span(job, 0, kind, lane, start, end, kind)


def two_jobs() -> list[JobFacts]:
    return [JobFacts("a", "service-0", 2, 0.0, 10.0, "done"), JobFacts("b", "service-0", 2, 0.0, 10.0, "done")]


def test_weight_loads_inside_a_rollout_are_busy_once() -> None:
    spans = [
        span("a", "load", 0.0, 2.0),  # engine build + vLLM start
        span("a", "node", 2.0, 4.0),  # rollout ...
        span("a", "weights", 2.0, 2.5),  # ... which first loads a's weights into the shared engine
        span("b", "swap", 4.0, 4.25),
        span("b", "node", 4.25, 6.0),
        span("b", "weights", 4.5, 5.0),
        span("a", "node", 6.0, 7.0, lane="cpu"),  # the CPU pool costs no accelerator time
    ]
    [svc] = account(spans, two_jobs(), ["service-0"], 10.0).services
    assert svc.busy == 2.0 + 1.75  # the two node spans, nothing more
    assert svc.weights == 0.5 + 0.5  # the breakdown: what part of busy went to weight loads
    assert svc.swap == 0.25
    assert svc.startup == 2.0
    assert svc.idle == 10.0 - 3.75 - 0.25 - 2.0
    assert svc.busy + svc.swap + svc.startup + svc.idle == pytest.approx(svc.allocated)


def test_first_load_is_startup_not_swap_and_jobs_pay_for_their_own() -> None:
    spans = [span("a", "load", 0.0, 3.0), span("b", "load", 3.0, 3.5), span("b", "swap", 5.0, 5.5)]
    spans += [span("a", "node", 3.5, 5.0), span("b", "node", 5.5, 7.0)]
    report = account(spans, two_jobs(), ["service-0"], 10.0)
    a, b = report.jobs
    assert (a.startup, a.swap) == (3.0, 0.0)
    assert (b.startup, b.swap) == (0.5, 0.5)
    [svc] = report.services
    idle_share = svc.idle / 2  # both jobs were placed for the whole run
    assert a.allocated == pytest.approx(1.5 + 3.0 + idle_share)
    assert b.allocated == pytest.approx(1.5 + 0.5 + 0.5 + idle_share)
    assert a.allocated + b.allocated == pytest.approx(svc.allocated)
    assert "startup s" in format_report(report)


def test_a_weight_load_outside_every_node_counts_as_busy() -> None:
    """Defensive: were an engine to load weights between nodes, the service was still working for the job."""
    spans = [span("a", "node", 1.0, 2.0), span("a", "weights", 2.5, 3.0), span("b", "node", 2.4, 3.2)]
    [svc] = account(spans, two_jobs(), ["service-0"], 10.0).services
    assert svc.busy == pytest.approx(1.0 + 0.5 + 0.8)  # b's node covers it, but it is a's weights
    assert svc.weights == 0.5


def test_bounds_of_a_mix() -> None:
    import doctest

    import plexrl.accounting
    from plexrl.accounting import cost_bound, slowdown_bound

    result = doctest.testmod(plexrl.accounting)
    assert result.attempted >= 3 and result.failed == 0
    # two jobs alone 10 s each, 6 s of service each: 12 s of demand cannot all fit before 10 s -> s >= 1.2
    assert slowdown_bound([6.0, 6.0], [10.0, 10.0]) == 1.2
    # a short job first: its deadline binds before the long one's
    assert slowdown_bound([4.0, 1.0], [4.0, 100.0]) == 1.0
    assert slowdown_bound([4.0, 1.0], [5.0, 2.0]) == 1.0 and slowdown_bound([1.0, 4.0], [2.0, 4.0]) == 1.25
    assert cost_bound([6.0, 6.0], [3, 3]) == 2.0
