"""The sandbox against a policy that optimises against it: a run dies with its caller and at its
own deadline, the seccomp filter refuses each dangerous system call, the session keyring is fresh, every
rlimit is set, a strict sandbox refuses degraded isolation, and the host name is the sandbox's. Each test is
an attack that worked before the hardening; tests that need an isolation this kernel refuses are skipped."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import wait_for

from plexrl.tools.sandbox import Sandbox, SandboxLimits
from plexrl.tools.seccomp import ARCHES, DENIED, RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS, evaluate, filter_program

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=2, memory_mb=256, max_processes=16, max_output_bytes=4096)
MACHINE = os.uname().machine
NR = ARCHES[MACHINE][1] if MACHINE in ARCHES else {}
PROJECT = Path(__file__).resolve().parent.parent
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17


@pytest.fixture
def temp_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "sandbox-root"
    root.mkdir()
    yield root
    assert list(root.iterdir()) == [], "the sandbox left files in its temporary root"


@pytest.fixture
def sandbox(temp_root: Path) -> Sandbox:
    return Sandbox(LIMITS, temp_root=temp_root)


def need_full(sandbox: Sandbox) -> None:
    if not sandbox.isolation.complete:
        pytest.skip(f"full isolation unavailable on this machine: {sandbox.isolation.summary()}")


def alive(procs: list[psutil.Process]) -> list[int]:
    found = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


# ------------------------------------------------------------------------------------- a run never outlives its caller

CALLER = """
import sys
from plexrl.tools.sandbox import Sandbox, SandboxLimits
limits = SandboxLimits(timeout_s=float(sys.argv[2]), cpu_s=60)
result = Sandbox(limits, temp_root=sys.argv[1]).run("import time\\nprint('started', flush=True)\\ntime.sleep(60)")
print(result.error, flush=True)
"""


def start_caller(temp_root: Path, timeout_s: float) -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    """A training process (another Python) whose sandboxed run sleeps; returns it and the run's processes
    once the program is running."""
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(temp_root), str(timeout_s)],
        cwd=PROJECT,
        stdout=subprocess.PIPE,
        text=True,
    )
    tree: list[psutil.Process] = []

    def program_running() -> bool:
        tree[:] = psutil.Process(caller.pid).children(recursive=True)
        return any("main.py" in " ".join(p.cmdline()) for p in tree if p.is_running())

    wait_for(program_running, "the sandboxed program never started", 30.0)
    return caller, tree


def test_a_killed_caller_takes_its_run_and_temp_dir_with_it(temp_root: Path) -> None:
    caller, tree = start_caller(temp_root, timeout_s=60.0)
    assert len(tree) >= 2  # launcher, init, program
    caller.kill()  # SIGKILL: the caller cannot clean up
    caller.wait()
    assert caller.stdout is not None
    caller.stdout.close()
    wait_for(lambda: not alive(tree), f"the run outlived its killed caller: {alive(tree)}", 5.0)
    wait_for(lambda: not list(temp_root.iterdir()), "the run's temporary directory was left behind", 5.0)


def test_the_launcher_enforces_the_deadline_while_the_caller_is_stopped(temp_root: Path) -> None:
    caller, tree = start_caller(temp_root, timeout_s=1.0)
    caller.send_signal(signal.SIGSTOP)  # a frozen trainer cannot enforce its timeout
    try:
        wait_for(lambda: not alive(tree), f"the run outlived its deadline: {alive(tree)}", 6.0)
    finally:
        caller.send_signal(signal.SIGCONT)
    out, _ = caller.communicate(timeout=30)
    assert out.startswith("timed out"), out


class Interrupted(Exception):
    pass


def test_an_exception_in_the_caller_kills_the_run(sandbox: Sandbox) -> None:
    """A KeyboardInterrupt, say, raised in the caller while its run sleeps."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sandbox.limits = LIMITS.model_copy(update={"timeout_s": 30.0, "cpu_s": 30})
    run: list[psutil.Process] = []

    def program_running() -> bool:
        run[:] = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        with contextlib.suppress(psutil.Error):
            return any("main.py" in " ".join(p.cmdline()) for p in run)
        return False

    def interrupt_once_running() -> None:
        with contextlib.suppress(AssertionError):  # not started: the test fails on `run` below
            wait_for(program_running, "the sandboxed program never started", 30.0)
        os.kill(os.getpid(), signal.SIGALRM)  # the handler raises in the main thread, inside `run`

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    watcher = threading.Thread(target=interrupt_once_running)
    try:
        watcher.start()
        with pytest.raises(Interrupted):
            sandbox.run("import time\ntime.sleep(60)")
    finally:
        watcher.join()
        signal.signal(signal.SIGALRM, previous)
    assert run, "the run had not started when the caller was interrupted"
    wait_for(lambda: not alive(run), f"the run outlived the interrupted call: {alive(run)}", 5.0)


# ------------------------------------------------------------------------------------------------------ seccomp filter


def test_seccomp_doctests() -> None:
    import doctest

    import plexrl.tools.seccomp as seccomp

    result = doctest.testmod(seccomp)
    assert result.attempted >= 2 and result.failed == 0


def test_the_filter_program_denies_each_call_on_both_machines() -> None:
    """The BPF program itself, run by a reference interpreter: no kernel needed."""
    for machine, (arch, nr) in ARCHES.items():
        prog = filter_program(machine)
        assert prog is not None and len(prog) < 4096
        for name in DENIED:
            assert evaluate(prog, nr[name], arch) == RET_ERRNO | errno.EPERM, (machine, name)
        for allowed in (0, 1, 3, 59, 60, 231) if machine == "x86_64" else (63, 64, 57, 221, 93, 94):
            assert evaluate(prog, allowed, arch) == RET_ALLOW, (machine, allowed)
        assert evaluate(prog, nr["clone"], arch, (SIGCHLD,)) == RET_ALLOW
        assert evaluate(prog, nr["clone"], arch, (CLONE_NEWUSER | SIGCHLD,)) == RET_ERRNO | errno.EPERM
        assert evaluate(prog, nr["clone3"], arch) == RET_ERRNO | errno.ENOSYS
        for family, verdict in ((1, RET_ALLOW), (2, RET_ALLOW), (10, RET_ALLOW), (40, RET_ERRNO | 97)):
            assert evaluate(prog, nr["socket"], arch, (family, 1, 0)) == verdict
            assert evaluate(prog, nr["socketpair"], arch, (family, 1, 0)) == verdict
        assert evaluate(prog, 0, 0x40000003) == RET_KILL_PROCESS  # i386 ABI
    x86 = filter_program("x86_64")
    assert x86 is not None and evaluate(x86, 0x40000000 | 272, ARCHES["x86_64"][0]) == RET_ERRNO | errno.ENOSYS


SYSCALL = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
args = [ctypes.c_long(a) if isinstance(a, int) else a for a in {args!r}]
ret = libc.syscall(ctypes.c_long({nr}), *args)
if ret == 0 and {forks!r}:
    os._exit(0)
print(ret, ctypes.get_errno())
"""

# name: (arguments, errno with the filter); each call succeeds, or fails otherwise, without the filter
CALLS: dict[str, tuple[tuple[int | bytes, ...], int]] = {
    "unshare": ((CLONE_NEWUSER,), errno.EPERM),  # a nested user namespace: CAP_NET_ADMIN over nf_tables
    "setns": ((-1, 0), errno.EPERM),  # EBADF without the filter
    "keyctl": ((1, 0), errno.EPERM),  # KEYCTL_JOIN_SESSION_KEYRING works without it
    "add_key": ((b"user", b"planted", b"v", 1, -4), errno.EPERM),  # into the uid's user keyring
    "request_key": ((b"user", b"absent", 0, 0), errno.EPERM),  # ENOKEY without the filter
    "bpf": ((1000, 0, 0), errno.EPERM),  # EINVAL without it
    "perf_event_open": ((0, 0, -1, -1, 0), errno.EPERM),  # EFAULT without it
    "userfaultfd": ((1,), errno.EPERM),  # UFFD_USER_MODE_ONLY: allowed to anyone without it
    "io_uring_setup": ((1, 0), errno.EPERM),  # EFAULT without it
    "memfd_create": ((b"ram", 0), errno.EPERM),  # memory outside RLIMIT_AS
    "shmget": ((0, 1 << 20, 0o1600), errno.EPERM),  # SysV shared memory outlives every process of the run
    "mount": ((0, 0, 0, 0, 0), errno.EPERM),  # EFAULT without it
    "ptrace": ((16, 0x7FFFFFFF), errno.EPERM),  # PTRACE_ATTACH: ESRCH without the filter
    "clone3": ((0, 0), errno.ENOSYS),  # EINVAL without it; the C library falls back to clone
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_filter_refuses(name: str, sandbox: Sandbox) -> None:
    need_full(sandbox)
    args, expected = CALLS[name]
    result = sandbox.run(SYSCALL.format(nr=NR[name], args=args, forks=False))
    assert result.ok, result.error
    assert result.stdout.split() == ["-1", str(expected)], f"{name}{args} -> {result.stdout}"


def test_the_filter_refuses_clone_into_a_new_user_namespace(sandbox: Sandbox) -> None:
    need_full(sandbox)
    code = SYSCALL.format(nr=NR["clone"], args=(CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0), forks=True)
    result = sandbox.run(code + "os.waitpid(ret, 0) if ret > 0 else None\n")
    assert result.ok, result.error
    assert result.stdout.split() == ["-1", str(errno.EPERM)], result.stdout


@pytest.mark.parametrize(
    ("family", "kind"),
    [("AF_VSOCK", 1), ("AF_NETLINK", 3), ("AF_PACKET", 3), ("AF_XDP", 3)],
)  # the families this kernel offers beyond unix and IP (the others fail with EAFNOSUPPORT anyway)
def test_the_filter_refuses_socket_families(family: str, kind: int, sandbox: Sandbox) -> None:
    need_full(sandbox)
    number = {"AF_VSOCK": 40, "AF_NETLINK": 16, "AF_PACKET": 17, "AF_XDP": 44}
    code = (
        f"import socket\ntry:\n    socket.socket({number[family]}, {kind}).close()\n    print('open')\n"
        "except OSError as exc:\n    print(exc.errno)\n"
    )
    result = sandbox.run(code + "a, b = socket.socketpair()\nprint('unix ok')\n")
    assert result.ok, result.error
    assert result.stdout.split() == [str(errno.EAFNOSUPPORT), "unix", "ok"], f"{family}: {result.stdout}"


def test_the_filter_cannot_be_bypassed_through_another_abi(sandbox: Sandbox) -> None:
    """x32 numbers and the i386 `int 0x80` entry run other system-call tables: refused and killed."""
    need_full(sandbox)
    if MACHINE != "x86_64":
        pytest.skip("x86-64 only")
    x32 = sandbox.run(SYSCALL.format(nr=0x40000000 | NR["unshare"], args=(CLONE_NEWUSER,), forks=False))
    assert x32.ok and x32.stdout.split() == ["-1", str(errno.ENOSYS)], x32.stdout
    # push rbx; mov eax, 310 (i386 unshare); mov ebx, CLONE_NEWUSER; int 0x80; pop rbx; ret
    machine_code = bytes.fromhex("53b836010000bb00000010cd805bc3")
    code = (
        "import ctypes, mmap\n"
        "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        f"page.write({machine_code!r})\n"
        "addr = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
        "print('unshare returned', ctypes.CFUNCTYPE(ctypes.c_int)(addr)(), flush=True)\n"
    )
    i386 = sandbox.run(code)
    assert "unshare returned 0" not in i386.stdout
    assert not i386.ok and i386.signal == signal.SIGSYS, (i386.error, i386.stdout)


# ------------------------------------------------------------------------------------------------------ kernel keyring

KEYCTL_SEARCH, KEYCTL_READ, KEYCTL_INVALIDATE, KEY_SPEC_SESSION_KEYRING = 10, 11, 21, -3
READ_KEY = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
key = libc.syscall(L({nr}), L(10), L(-3), b"user", b"plexrl-test-secret", L(0))
err = ctypes.get_errno()
buf = ctypes.create_string_buffer(64)
n = libc.syscall(L({nr}), L(11), L(key), buf, L(64)) if key > 0 else -1
print(key, err, buf.raw[: max(n, 0)])
"""


@pytest.fixture
def planted_key() -> Iterator[bytes]:
    """An `hf_...` token in this process's session keyring, as a training job's credentials would be."""
    if "keyctl" not in NR:
        pytest.skip(f"no keyctl numbers for {MACHINE}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    secret = b"hf_plexrlTestTokenDoNotUse"
    key = libc.syscall(
        ctypes.c_long(NR["add_key"]), b"user", b"plexrl-test-secret", secret, ctypes.c_long(len(secret)),
        ctypes.c_long(KEY_SPEC_SESSION_KEYRING),
    )  # fmt: skip
    if key < 0:
        pytest.skip(f"cannot plant a key here: {os.strerror(ctypes.get_errno())}")
    yield secret
    libc.syscall(ctypes.c_long(NR["keyctl"]), ctypes.c_long(KEYCTL_INVALIDATE), ctypes.c_long(key))


def test_the_run_has_a_fresh_session_keyring(planted_key: bytes, temp_root: Path) -> None:
    sandbox = Sandbox(LIMITS, temp_root=temp_root, syscall_filter=False)  # the keyring alone, without seccomp
    result = sandbox.run(READ_KEY.format(nr=NR["keyctl"]))
    assert result.ok, result.error
    assert planted_key.decode() not in result.stdout
    assert result.stdout.split()[:2] == ["-1", str(errno.ENOKEY)], result.stdout


def test_the_filter_refuses_the_keyring_altogether(planted_key: bytes, sandbox: Sandbox) -> None:
    need_full(sandbox)
    result = sandbox.run(READ_KEY.format(nr=NR["keyctl"]))
    assert result.ok and planted_key.decode() not in result.stdout
    assert result.stdout.split()[:2] == ["-1", str(errno.EPERM)], result.stdout


def keys_of(uid: str) -> int:
    """How many keys the kernel holds for `uid` (its user and user-session keyrings count as two)."""
    for line in Path("/proc/key-users").read_text().splitlines():
        owner, _, fields = line.partition(":")
        if owner.strip() == uid:
            return int(fields.split()[1].split("/")[0])
    return 0


def test_keys_planted_for_a_later_run_with_the_same_uid_are_cleared(temp_root: Path) -> None:
    """Without the filter (which refuses add_key), the launcher empties the run uid's keyrings afterwards."""
    if os.geteuid() != 0 or not Path("/proc/key-users").exists() or "add_key" not in NR:
        pytest.skip("needs root (a uid per run) and /proc/key-users")
    sandbox = Sandbox(LIMITS, temp_root=temp_root, syscall_filter=False)
    plant = "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
    plant += f"print(os.getuid(), libc.syscall({NR['add_key']}, b'user', b'planted', b'v', 1, -4))"
    result = sandbox.run(plant)
    assert result.ok, result.error
    uid, key = result.stdout.split()
    assert int(key) > 0, "the key was not planted"
    wait_for(lambda: keys_of(uid) <= 2, f"the planted key outlived the run: {keys_of(uid)} keys", 5.0)


# ------------------------------------------------------------------------------------- rlimits, strict mode, host name


def test_every_rlimit_is_set_not_inherited(sandbox: Sandbox) -> None:
    names = ["RLIMIT_RTPRIO", "RLIMIT_NICE", "RLIMIT_MEMLOCK", "RLIMIT_MSGQUEUE", "RLIMIT_SIGPENDING"]
    names += ["RLIMIT_CORE", "RLIMIT_STACK"]
    result = sandbox.run(
        f"import json, resource\nprint(json.dumps([resource.getrlimit(getattr(resource, n)) for n in {names!r}]))"
    )
    assert result.ok, result.error
    got = dict(zip(names, map(tuple, json.loads(result.stdout)), strict=True))
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    stack = 8 << 20 if hard == resource.RLIM_INFINITY else min(hard, 8 << 20)
    assert got == {
        "RLIMIT_RTPRIO": (0, 0),
        "RLIMIT_NICE": (0, 0),
        "RLIMIT_MEMLOCK": (0, 0),
        "RLIMIT_MSGQUEUE": (0, 0),
        "RLIMIT_SIGPENDING": (64, 64),
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_STACK": (stack, stack),
    }


def test_a_strict_sandbox_refuses_degraded_isolation(temp_root: Path) -> None:
    for degraded in (
        Sandbox(LIMITS, temp_root=temp_root, namespaces=("mount", "pid", "ipc", "uts"), strict=True),
        Sandbox(LIMITS, temp_root=temp_root, syscall_filter=False, strict=True),
    ):
        result = degraded.run("print('the code ran')")
        assert not result.ok and result.refused and "the code ran" not in result.stdout
        assert result.error is not None and result.error.startswith("strict mode: refusing to run without")
        assert not result.isolation.complete
    assert not Sandbox(LIMITS, temp_root=temp_root).strict  # the python tool's default
    full = Sandbox(LIMITS, temp_root=temp_root, strict=True)
    if full.isolation.complete:
        ran = full.run("print('ran')")
        assert ran.stdout == "ran\n" and not ran.refused


def test_the_host_name_is_the_sandboxs(sandbox: Sandbox) -> None:
    if "uts" not in sandbox.isolation.namespaces:
        pytest.skip(f"no uts namespace: {sandbox.isolation.summary()}")
    result = sandbox.run("import socket, os\nprint(socket.gethostname(), os.uname().nodename)")
    assert result.ok and result.stdout.split() == ["sandbox", "sandbox"]
    assert socket.gethostname() != "sandbox"
