"""When a session's reply goes out (`plexrl/runtime/runner.py`): before the runner carries out the next instruction,
not after. On the inline executor (`driver: local`, what `plexrl serve` runs by default) a node runs inside the
runner's loop: a reply kept until the instructions of the same events were carried out waited for the node the
planner started next, another user's whole call; the client then sent its next call only once that call had
ended, and that next call waited for one more of the other user's calls (two in all, where the bound is the one
call already running). Deterministic: the order of what ran and what was told, on the runner's one thread; and,
pure, the planner's side of that bound: under another user's endless calls a session's call runs right after the
call running when it came."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from conftest import Clock
from test_session_engine import datum, spec

from plexrl.planner import CallArrived, JobPlan, JobSubmitted, NodeFinished, NodePlan, Planner, RunNode, ServiceJoined
from plexrl.planner.policies import FairShare, Hrrs
from plexrl.runtime import InlineExecutor, Runner
from plexrl.runtime.calls import CallBoard
from plexrl.sessions.calls import ForwardBackward


def test_a_calls_reply_goes_out_before_the_next_users_node_runs(smol_tiny: Path, tmp_path: Path) -> None:
    call = ForwardBackward((datum([1, 2, 3, 4]),), "cross_entropy")
    board = CallBoard()
    executor = InlineExecutor(services=1, validate=True)
    runner = Runner(executor, Planner(clock=executor.clock, validate=True), calls=board)
    order: list[tuple[str, str]] = []  # ("run", job) as each node starts, ("told", job) as each reply goes out
    errors: list[str] = []
    lock = threading.Lock()
    submit = executor.submit

    def logged(task: Any) -> Any:
        order.append(("run", task.job_id))
        return submit(task)

    executor.submit = logged  # type: ignore[method-assign]
    left = {"ann": 1, "bob": 3}  # bob's calls queue behind each other: one runs right after ann's

    def told(job: str) -> Any:
        def done(reply: dict[str, Any] | None, error: str | None) -> None:
            with lock:
                order.append(("told", job))
                if reply is None or reply.get("error"):
                    errors.append(f"{job}: {error or reply}")
                left[job] -= 1
                last = left[job] == 0
            if last:
                runner.close_session(job)

        return done

    for job, n in left.items():
        board.open(job)
        for _ in range(n):
            board.put(job, call.kind, call, told(job))
    specs = [dataclasses.replace(spec(smol_tiny, job, tmp_path / "runs"), user=job) for job in left]
    runs = runner.run(specs)
    assert [r.status for r in runs] == ["done", "done"], [r.error for r in runs]
    assert not errors, errors
    ran = order.index(("run", "ann"))
    after = [i for i, e in enumerate(order) if e == ("run", "bob") and i > ran]
    assert after, f"no call of bob's ran after ann's: {order}"
    assert order.index(("told", "ann")) < after[0], f"ann's reply waited for bob's next call: {order}"


def test_under_another_users_endless_calls_a_sessions_call_waits_for_the_one_running() -> None:
    """Pure, the server's ordering (fair share over HRRS): bob always has his next call queued (announced as his
    previous one ends); ann sends hers while one of bob's runs. Each of ann's calls runs as soon as that call of
    bob's ends: never two of bob's calls between ann's call coming and running."""
    clock = Clock()
    p = Planner(clock=clock, validate=True, ordering=FairShare(Hrrs()))
    p.handle(ServiceJoined("s0"))
    nodes = {"forward_backward": NodePlan("service"), "sample": NodePlan("service")}
    for job in ("ann", "bob"):
        p.handle(JobSubmitted(job, JobPlan(nodes, 10**9, tuple(nodes), open=True, state_bytes=1, user=job)))

    def ran(instructions: list[Any]) -> list[str]:
        return [i.job_id for i in instructions if isinstance(i, RunNode)]

    assert ran(p.handle(CallArrived("bob", "sample"))) == ["bob"]
    for k in range(6):  # (round k: bob's call k runs, then ann's call k)
        clock.t += 0.01  # ann's next call comes while bob's runs: it waits
        assert ran(p.handle(CallArrived("ann", "forward_backward"))) == []
        clock.t += 5.0  # bob's call (5 s) ends; his next one is announced at once, after it
        after_bob = ran(p.handle(NodeFinished("bob", k, "sample", duration=5.0)))
        after_bob += ran(p.handle(CallArrived("bob", "sample")))
        assert after_bob == ["ann"], f"round {k}: ann's call waits for another of bob's calls"
        clock.t += 0.02  # ann's call (20 ms) ends: bob's next call runs
        assert ran(p.handle(NodeFinished("ann", k, "forward_backward", duration=0.02))) == ["bob"]
