"""The session-end check (tests/leaks.py, run by tests/conftest.py) finds what a test leaves running: its
children, and daemons that left the process tree but carry the session's mark."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import leaks
import psutil


def test_a_child_and_a_detached_daemon_are_found_and_ended() -> None:
    since = time.time() - 1.0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # a daemon: the shell forks it into a new session and exits, so it is no longer under this process
    out = subprocess.run(
        ["sh", "-c", f"setsid {sys.executable} -c 'import time; time.sleep(60)' >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    daemon = int(out.stdout)
    try:
        assert os.environ[leaks.MARK] == str(os.getpid())
        assert all(p.pid != os.getpid() for p in psutil.Process(daemon).parents())
        found = leaks.leftovers(since, grace_s=0.0)
        assert {child.pid, daemon} <= {p.pid for p in found}
        leaks.end([p for p in found if p.pid in (child.pid, daemon)])
        child.wait(timeout=10)
        assert not psutil.pid_exists(daemon) or psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE
        assert {child.pid, daemon}.isdisjoint(p.pid for p in leaks.leftovers(since, grace_s=0.0))
    finally:
        for pid in (child.pid, daemon):
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
        child.wait(timeout=10)


def test_a_process_started_before_the_session_or_without_its_mark_is_not_ours() -> None:
    env = {k: v for k, v in os.environ.items() if k != leaks.MARK}
    out = subprocess.run(
        ["sh", "-c", f"setsid {sys.executable} -c 'import time; time.sleep(60)' >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, timeout=30, check=True, env=env,
    )  # fmt: skip
    other = psutil.Process(int(out.stdout))
    try:
        assert other.pid not in {p.pid for p in leaks.leftovers(time.time() - 5.0, grace_s=0.0)}
        assert other.pid not in {p.pid for p in leaks.leftovers(time.time() + 60.0, grace_s=0.0)}
    finally:
        other.kill()


def test_the_check_waits_for_a_process_that_is_ending_and_no_longer() -> None:
    """A process already on its way out is not a leftover: the check waits for it to end (within its grace), and
    returns as soon as it has, not at the end of the grace."""
    since = time.time() - 0.5
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        start = time.monotonic()
        assert child.pid not in {p.pid for p in leaks.leftovers(since, grace_s=30.0)}
        assert time.monotonic() - start < 20.0
    finally:
        child.kill()
        child.wait(timeout=10)
