"""The sandbox against hostile code: every attack returns a clear error, the caller goes on, and the machine
stays clean (no stray processes, nothing left in the temporary root). Tests that need an isolation this
kernel refuses are skipped with the reason (see `Sandbox.isolation`)."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from plexrl.tools.sandbox import Sandbox, SandboxLimits, SandboxResult

LIMITS = SandboxLimits(timeout_s=1.5, cpu_s=1, memory_mb=256, max_processes=16, max_output_bytes=4096)
UID_FIRST = "import os, sys\nprint('uid', os.getuid(), flush=True)\n"


@pytest.fixture
def temp_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "sandbox-root"
    root.mkdir()
    yield root
    assert list(root.iterdir()) == [], "the sandbox left files in its temporary root"


@pytest.fixture
def sandbox(temp_root: Path) -> Sandbox:
    return Sandbox(LIMITS, temp_root=temp_root)


_EARLIER_CHILDREN: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before_the_test() -> None:
    """Children that existed before the test (e.g. a multiprocessing helper started by earlier tests in the
    same pytest process) are not the sandbox's."""
    _EARLIER_CHILDREN.clear()
    _EARLIER_CHILDREN.update(p.pid for p in psutil.Process().children(recursive=True))


def _strays(uid: int | None) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info["uids"]
        if uid is not None and uids is not None and uids.real == uid:
            found.append(proc)
    return found + [p for p in psutil.Process().children(recursive=True) if p.pid not in _EARLIER_CHILDREN]


def assert_clean(result: SandboxResult, deadline_s: float = 3.0) -> None:
    """No process of the run's own uid (printed first by UID_FIRST code) and no child of ours is left."""
    match = re.search(r"^uid (\d+)$", result.stdout, re.MULTILINE)
    uid = int(match.group(1)) if match else None
    if uid is not None:
        assert uid != os.getuid(), "the program ran with the caller's uid"
    deadline = time.monotonic() + deadline_s
    while strays := _strays(uid):
        if time.monotonic() > deadline:
            raise AssertionError(f"stray processes after the run: {[p.pid for p in strays]}")
        time.sleep(0.02)  # polling with a deadline, not waiting for a fixed time


def need(sandbox: Sandbox, what: str) -> None:
    isolation = sandbox.isolation
    have = isolation.filesystem if what == "filesystem" else what in isolation.namespaces
    if not have:
        pytest.skip(f"{what} isolation unavailable on this machine: {isolation.summary()}")


def test_runs_code_and_reports_what_it_printed(sandbox: Sandbox) -> None:
    ok = sandbox.run("import sys\nprint('hello')\nprint('warn', file=sys.stderr)")
    assert ok.ok and ok.error is None and ok.exit_code == 0
    assert ok.stdout == "hello\n" and ok.stderr == "warn\n"
    bad = sandbox.run("print('before')\nraise ValueError('boom')")
    assert not bad.ok and bad.exit_code == 1 and bad.stdout == "before\n"
    assert bad.error == "the program exited with status 1: ValueError: boom"
    assert 'main.py", line 2' in bad.stderr


def test_isolation_is_reported_and_full_on_a_capable_kernel(sandbox: Sandbox) -> None:
    isolation = sandbox.isolation
    assert isolation.unprivileged, isolation.summary()
    if isolation.namespaces:
        assert isolation.summary().startswith("network ")
    if not isolation.filesystem:
        pytest.skip(f"namespaces unavailable: {isolation.summary()}")
    assert set(isolation.namespaces) == {"network", "mount", "pid", "ipc", "uts"} and isolation.network
    assert isolation.syscall_filter and isolation.complete and "syscall filter yes" in isolation.summary()


def test_infinite_loop_is_killed_at_the_wall_clock_limit(temp_root: Path) -> None:
    sandbox = Sandbox(LIMITS.model_copy(update={"timeout_s": 1.0, "cpu_s": 30}), temp_root=temp_root)
    result = sandbox.run(UID_FIRST + "while True:\n    pass")
    assert result.timed_out and not result.ok
    assert result.error is not None and result.error.startswith("timed out")
    assert 1.0 <= result.wall_s < 4.0
    assert_clean(result)


def test_cpu_limit(temp_root: Path) -> None:
    sandbox = Sandbox(LIMITS.model_copy(update={"timeout_s": 10.0}), temp_root=temp_root)
    result = sandbox.run(UID_FIRST + "while True:\n    pass")
    assert not result.ok and not result.timed_out
    assert result.error is not None and "CPU time limit" in result.error
    assert_clean(result)


def test_sleeping_program_is_killed_with_its_children(sandbox: Sandbox) -> None:
    code = UID_FIRST + "import time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        break\n"
    result = sandbox.run(code + "time.sleep(60)")
    assert result.timed_out and result.error is not None and "timed out" in result.error
    assert_clean(result)


def test_children_left_behind_are_killed_when_the_program_exits(sandbox: Sandbox) -> None:
    code = UID_FIRST + "import time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    result = sandbox.run(code)
    assert result.ok and result.stdout.endswith("done\n") and result.wall_s < 1.5
    assert_clean(result)


def test_fork_bomb(sandbox: Sandbox) -> None:
    code = UID_FIRST + "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = sandbox.run(code)
    assert not result.ok and result.error is not None
    assert "timed out" in result.error or "CPU time limit" in result.error
    assert_clean(result)
    assert sandbox.run("print(1)").ok, "the sandbox still works after a fork bomb"


def test_process_limit_refuses_forks_beyond_it(sandbox: Sandbox) -> None:
    code = UID_FIRST + (
        "import time\nkids = []\ntry:\n    for _ in range(100):\n        pid = os.fork()\n"
        "        if pid == 0:\n            time.sleep(60)\n        kids.append(pid)\nexcept OSError as exc:\n"
        "    print('refused after', len(kids), type(exc).__name__)\n"
    )
    result = sandbox.run(code)
    assert result.ok, result.error
    assert re.search(r"refused after (\d+) BlockingIOError", result.stdout)
    assert int(result.stdout.split("refused after ")[1].split()[0]) < LIMITS.max_processes
    assert_clean(result)


def test_memory_bomb(sandbox: Sandbox) -> None:
    for code in ("x = bytearray(10**10)", "chunks = []\nwhile True:\n    chunks.append(b'x' * 2**24)"):
        result = sandbox.run(UID_FIRST + code)
        assert not result.ok and result.error is not None
        assert result.error.startswith("memory limit"), result.error
        assert_clean(result)


def test_writing_outside_the_work_directory_fails(sandbox: Sandbox, temp_root: Path, tmp_path: Path) -> None:
    need(sandbox, "filesystem")
    project = Path(__file__).resolve().parent.parent
    targets = ["/evil", "/usr/evil", "/etc/evil", f"{sys.base_prefix}/evil", str(temp_root / "evil")]
    targets += [str(tmp_path / "evil"), str(project / "evil"), "/tmp/../evil", "/dev/evil"]
    code = (
        f"import os\nblocked = 0\nfor path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n"
        "    except OSError:\n        blocked += 1\nopen('inside.txt', 'w').write('fine')\n"
        "print(blocked, sorted(os.listdir('.')))"
    )
    result = sandbox.run(code)
    assert result.ok, result.error
    assert result.stdout == f"{len(targets)} ['inside.txt', 'main.py']\n"
    for target in targets:
        assert not os.path.exists(target), target


def test_file_size_limit(temp_root: Path) -> None:
    sandbox = Sandbox(LIMITS.model_copy(update={"file_size_mb": 1}), temp_root=temp_root)
    result = sandbox.run(
        "import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_DFL)\nopen('f', 'wb').write(b'x' * 2**21)"
    )
    assert not result.ok and result.error is not None and "file size limit" in result.error


def test_reading_system_and_project_files_fails(sandbox: Sandbox) -> None:
    need(sandbox, "filesystem")
    paths = ["/etc/passwd", "/etc/shadow", "/proc/1/environ", str(Path(__file__).resolve()), "/root/.bashrc"]
    result = sandbox.run(
        f"import os\nfor p in {paths!r}:\n    print(p, os.path.exists(p))\nprint(open('/etc/passwd').read())"
    )
    assert not result.ok and result.error is not None
    assert "FileNotFoundError" in result.error and "/etc/passwd" in result.error
    assert all(f"{p} False" in result.stdout for p in paths), result.stdout
    assert "root:" not in result.stdout + result.stderr


def test_the_callers_environment_is_not_visible(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLEXRL_TEST_SECRET", "s3cr3t-value")
    code = (
        "import os\nprint(sorted(os.environ))\nprint(os.environ.get('PLEXRL_TEST_SECRET'))\n"
        "for p in ('/proc/self/environ', f'/proc/{os.getppid()}/environ', '/proc/1/environ'):\n"
        "    try:\n        print(open(p, 'rb').read())\n    except OSError as exc:\n        print('no', p)\n"
    )
    result = sandbox.run(code)
    assert result.ok, result.error
    assert "s3cr3t-value" not in result.stdout + result.stderr
    assert "PLEXRL_TEST_SECRET" not in result.stdout


def test_no_network_connection_reaches_the_host(sandbox: Sandbox) -> None:
    need(sandbox, "network")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        result = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).send(b'x')")
        assert not result.ok and result.error is not None
        assert "OSError" in result.error or "ConnectionRefusedError" in result.error, result.error
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # the run is over: a connection would be queued by now


def test_killing_the_parent_fails_and_the_caller_goes_on(sandbox: Sandbox) -> None:
    me = os.getpid()
    code = UID_FIRST + (
        "import signal\n"
        f"attacks = [lambda: os.kill(os.getppid(), 9), lambda: os.kill({me}, 9), lambda: os.kill(1, 9),\n"
        f"           lambda: os.killpg(os.getpgid({me}), 9), lambda: os.kill(-1, 9), lambda: os.killpg(0, 9)]\n"
        "for attack in attacks:\n    try:\n        attack()\n    except OSError as exc:\n"
        "        print(type(exc).__name__, flush=True)\n"
    )
    result = sandbox.run(code)
    assert not result.ok and result.error == "the program was killed by SIGKILL"  # killpg(0) hit only itself
    assert psutil.pid_exists(me) and sandbox.run("print(2)").stdout == "2\n"
    assert_clean(result)


def test_huge_output_is_capped(sandbox: Sandbox) -> None:
    result = sandbox.run(UID_FIRST + "while True:\n    print('x' * 1000)")
    assert not result.ok and result.truncated
    assert result.error is not None and result.error.startswith("output limit")
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= LIMITS.max_output_bytes
    assert_clean(result)
    flood = sandbox.run("import sys\nsys.stderr.write('e' * 100_000)")
    assert flood.truncated and len(flood.stderr) <= LIMITS.max_output_bytes


def test_concurrent_runs_are_independent(sandbox: Sandbox) -> None:
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sandbox.run, [f"print({i} * {i})" for i in range(8)]))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]
    assert threading.active_count() >= 1


def test_degraded_isolation_is_reported_and_logged(temp_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    sandbox = Sandbox(LIMITS, namespaces=("mount",), temp_root=temp_root)
    with caplog.at_level(logging.WARNING, logger="plexrl.tools.sandbox"):
        isolation = sandbox.isolation
    assert not isolation.network and "pid" not in isolation.namespaces
    assert "network NOT isolated" in isolation.summary()
    assert any("network NOT isolated" in r.getMessage() for r in caplog.records)
    if not isolation.filesystem:
        pytest.skip(f"mount namespace unavailable: {isolation.summary()}")
    code = UID_FIRST + "import time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    result = sandbox.run(code)  # without a pid namespace the launcher sweeps the run's uid
    assert result.ok and result.stdout.endswith("done\n")
    assert_clean(result)


def test_bad_configuration_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValidationError, match="timeout"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValidationError, match="Extra inputs"):
        SandboxLimits(walltime=3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="unknown namespaces"):
        Sandbox(namespaces=("net",))
    assert Sandbox().run("x" * (2 << 20)).error == "program longer than 1048576 bytes"
