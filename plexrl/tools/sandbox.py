"""Run untrusted, model-written Python in a throw-away, locked-down process. See docs/security.md.

`Sandbox.run(code)` starts `_launcher.py` (a trusted stdlib-only script) in a new session with a scrubbed
environment and an empty temporary directory; the launcher isolates the run (namespaces, a read-only root
with only the Python installation, an unprivileged uid, every rlimit, a fresh session keyring, a seccomp
filter from `plexrl.tools.seccomp`) and execs Python on the code. This module enforces the wall-clock timeout
and the output cap, kills the whole run when either is hit or when anything goes wrong in the caller (any
exception, KeyboardInterrupt included), and removes the temporary directory. The launcher enforces the same
deadline itself and dies with the calling thread, so a run never outlives a killed or stopped caller. What
the kernel actually allowed is reported as `Isolation` on every result and logged once per Sandbox when it is
less than complete; a `strict` Sandbox refuses to run the code at all then.

Contract: `run` never raises because of what the code does (crash, hang, fork bomb, memory bomb, huge output,
attacks on the caller); it returns `SandboxResult(ok=False, error=...)`. It does NOT defend against kernel
exploits outside the filtered system calls or side channels, and without namespaces it cannot hide the file
system or the network (see `Isolation.notes`). Thread-safe: runs are independent processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from plexrl.tools.seccomp import filter_program

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("_launcher.py")
NAMESPACES = ("network", "mount", "pid", "ipc", "uts")
SETUP_FAILED = 125
MAX_CODE_BYTES = 1 << 20
KILL_GRACE_S = 2.0
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
}


class SandboxLimits(BaseModel):
    """Limits of one sandboxed run; each enforced as described in docs/security.md."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(default=5.0, gt=0, description="wall-clock limit; the whole run is killed when it passes")
    cpu_s: int = Field(default=5, gt=0, description="CPU seconds (RLIMIT_CPU); SIGXCPU then SIGKILL a second later")
    memory_mb: int = Field(default=512, ge=64, description="address space of each process (RLIMIT_AS), MiB")
    file_size_mb: int = Field(default=8, ge=0, description="largest file the code may write (RLIMIT_FSIZE), MiB")
    work_dir_mb: int = Field(default=32, ge=1, description="size of the tmpfs work directory /tmp, MiB")
    max_processes: int = Field(default=16, ge=1, description="processes and threads of the run's uid (RLIMIT_NPROC)")
    max_open_files: int = Field(default=64, ge=16, description="open file descriptors per process (RLIMIT_NOFILE)")
    max_output_bytes: int = Field(default=16_384, ge=1, description="stdout + stderr kept; the run is killed past it")


@dataclass(frozen=True, slots=True)
class Isolation:
    """What one run actually got. `namespaces` ⊆ network, mount, pid, ipc, uts; `filesystem`: the root is the
    read-only minimal tree (no project files, no /etc); `unprivileged`: an uid of its own (or a user
    namespace); `syscall_filter`: the seccomp filter is loaded; `notes`: every requested protection that the
    kernel refused, in words."""

    namespaces: tuple[str, ...] = ()
    filesystem: bool = False
    unprivileged: bool = False
    syscall_filter: bool = False
    notes: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """True when every protection is in place: all namespaces, the minimal root, an unprivileged uid, the
        system-call filter. A strict Sandbox runs code only then."""
        complete = set(self.namespaces) == set(NAMESPACES) and self.filesystem and self.unprivileged
        return complete and self.syscall_filter

    @property
    def network(self) -> bool:
        """True when the run has no network (an empty network namespace)."""
        return "network" in self.namespaces

    def summary(self) -> str:
        """One line for logs: what is isolated and what is not."""
        parts = [
            f"network {'isolated' if self.network else 'NOT isolated'}",
            f"filesystem {'isolated' if self.filesystem else 'NOT isolated'}",
            f"pid namespace {'yes' if 'pid' in self.namespaces else 'NO'}",
            f"unprivileged uid {'yes' if self.unprivileged else 'NO'}",
            f"syscall filter {'yes' if self.syscall_filter else 'NO'}",
        ]
        return "; ".join(parts) + "".join(f"; {n}" for n in self.notes)


@dataclass(slots=True)
class SandboxResult:
    """Outcome of one run. ok: exited 0 within every limit. `error` says why not, in words; `exit_code` /
    `signal` are the program's own (None when it never ran or was killed by the sandbox); `refused`: a strict
    sandbox did not run the code because the isolation was incomplete (a property of the machine, not of
    the code)."""

    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    error: str | None
    timed_out: bool
    truncated: bool
    wall_s: float
    isolation: Isolation = field(default_factory=Isolation)
    refused: bool = False


class Sandbox:
    """Runs Python code in isolated, resource-limited processes; one fresh process tree per `run`.

    namespaces: which of NAMESPACES to ask for (all by default; fewer only to test degraded modes).
    readonly_paths: extra host directories made visible read-only at the same path (e.g. a data set).
    temp_root: where the per-run temporary directory is made (default: the system's temp dir).
    strict: refuse to run code (`ok=False`, error "strict mode: ...") unless `Isolation.complete`; verifiers
        use it, because a reward computed in a leaky sandbox is one the policy can learn to forge.
    syscall_filter: load the seccomp filter (True; False only to test the other layers on their own).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        namespaces: Sequence[str] = NAMESPACES,
        readonly_paths: Sequence[str] = (),
        temp_root: str | os.PathLike[str] | None = None,
        strict: bool = False,
        syscall_filter: bool = True,
    ) -> None:
        unknown = set(namespaces) - set(NAMESPACES)
        if unknown:
            raise ValueError(f"unknown namespaces {sorted(unknown)}; choose from {', '.join(NAMESPACES)}")
        self.limits = limits or SandboxLimits()
        self.namespaces = tuple(namespaces)
        self.readonly_paths = tuple(os.path.abspath(p) for p in readonly_paths)
        self.temp_root = None if temp_root is None else os.fspath(temp_root)
        self.python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        self.strict = strict
        self.seccomp = filter_program(os.uname().machine) if syscall_filter else None
        self._isolation: Isolation | None = None
        self._warned = False

    @property
    def isolation(self) -> Isolation:
        """What this machine grants a run, found by running an empty program once (cached)."""
        if self._isolation is None:
            self._isolation = self.run("pass").isolation
        return self._isolation

    def run(self, code: str) -> SandboxResult:
        """Run `code` as a Python program; stdout/stderr decoded as UTF-8 (invalid bytes replaced)."""
        started = time.perf_counter()
        code = code.encode("utf-8", "replace").decode("utf-8")  # lone surrogates become "?"
        if len(code.encode()) > MAX_CODE_BYTES:
            return _refused(f"program longer than {MAX_CODE_BYTES} bytes", started)
        try:
            tmp = tempfile.mkdtemp(prefix="plexrl-sandbox-", dir=self.temp_root)
        except OSError as exc:
            return _refused(f"cannot create the temporary directory: {exc}", started)
        try:
            return self._run_in(tmp, code, started)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.exists(tmp):
                log.error("sandbox: could not remove %s", tmp)

    def _job(self, tmp: str, code: str, status_fd: int) -> bytes:
        limits = self.limits
        mib = 1 << 20
        job = {
            "code": code,
            "status_fd": status_fd,
            "caller_pid": os.getpid(),
            "temp_dir": tmp,
            "timeout_s": limits.timeout_s,
            "strict": self.strict,
            "seccomp": self.seccomp,
            "namespaces": list(self.namespaces),
            "all_namespaces": list(NAMESPACES),
            "root_dir": os.path.join(tmp, "root"),
            "work_dir": os.path.join(tmp, "work"),
            "python": self.python,
            "python_prefix": sys.base_prefix,
            "readonly_paths": list(self.readonly_paths),
            "env": ENV,
            "limits": {
                "cpu_s": limits.cpu_s,
                "memory_bytes": limits.memory_mb * mib,
                "file_size_bytes": limits.file_size_mb * mib,
                "work_dir_bytes": limits.work_dir_mb * mib,
                "max_processes": limits.max_processes,
                "max_open_files": limits.max_open_files,
            },
        }
        return json.dumps(job).encode()

    def _run_in(self, tmp: str, code: str, started: float) -> SandboxResult:
        os.chmod(tmp, 0o711)  # the unprivileged uid may traverse to its work dir (fallback mode), not list
        for sub in ("root", "work"):
            os.mkdir(os.path.join(tmp, sub))
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", "-B", str(LAUNCHER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                env=ENV,
                cwd=tmp,
                start_new_session=True,
            )
        except OSError as exc:
            os.close(status_r)
            return _refused(f"cannot start the sandbox launcher: {exc}", started)
        finally:
            os.close(status_w)
        try:
            with os.fdopen(status_r, "rb") as status:
                stdin = proc.stdin
                assert stdin is not None
                with contextlib.suppress(OSError):  # the launcher died at once: its stderr says why
                    stdin.write(self._job(tmp, code, status_w))
                with contextlib.suppress(OSError):
                    stdin.close()
                out, err, raw_status, timed_out, truncated = self._collect(proc, status, started)
        except BaseException:  # KeyboardInterrupt, an error here: the run must not outlive this call
            _terminate(proc)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            raise
        return self._result(proc.returncode, out, err, raw_status, timed_out, truncated, started)

    def _collect(
        self, proc: subprocess.Popen[bytes], status: object, started: float
    ) -> tuple[bytes, bytes, bytes, bool, bool]:
        """Read stdout, stderr and status until all close, the deadline passes or output exceeds the cap."""
        assert proc.stdout is not None and proc.stderr is not None
        streams: dict[object, bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray(), status: bytearray()}
        cap = self.limits.max_output_bytes
        deadline = started + self.limits.timeout_s
        timed_out = truncated = False
        with selectors.DefaultSelector() as selector:
            for stream in streams:
                selector.register(stream, selectors.EVENT_READ)  # type: ignore[arg-type]
            while selector.get_map():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(remaining):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    streams[key.fileobj] += chunk
                if len(streams[proc.stdout]) + len(streams[proc.stderr]) > cap:
                    truncated = True
                    break
        if timed_out or truncated:
            _terminate(proc)
            streams[status] += _drain(status)
        _terminate(proc)  # normal exit: kills stragglers left in the process group, then reaps
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        out, err = bytes(streams[proc.stdout]), bytes(streams[proc.stderr])
        if truncated:
            keep = max(cap - len(err[:cap]), cap // 2)
            out, err = out[:keep], err[: max(cap - len(out[:keep]), 0)]
        return out, err, bytes(streams[status]), timed_out, truncated

    def _result(
        self, returncode: int | None, out: bytes, err: bytes, raw: bytes, timed_out: bool, truncated: bool, t0: float
    ) -> SandboxResult:
        records = [json.loads(line) for line in raw.decode("utf-8", "replace").splitlines() if line.startswith("{")]
        info = next((r["isolation"] for r in records if "isolation" in r), None)
        isolation = _isolation(info)
        if info is not None and not self._warned and not isolation.complete:
            self._warned = True
            log.warning("sandbox isolation is degraded on this machine: %s", isolation.summary())
        final: dict[str, int] = next((r for r in records if "exit" in r or "signal" in r), {})
        exit_code, sig = final.get("exit"), final.get("signal")
        refused = next((str(r["refused"]) for r in records if "refused" in r), None)
        timed_out = timed_out or any("deadline" in r for r in records)  # the launcher's own alarm
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        limits = self.limits
        error: str | None = None
        if refused is not None:
            error = f"{refused} ({isolation.summary()})"
            exit_code = None
        elif timed_out:
            error = f"timed out: the program ran longer than {limits.timeout_s:g} s (wall clock) and was killed"
        elif truncated:
            error = f"output limit: the program wrote more than {limits.max_output_bytes} bytes and was stopped"
        elif info is None or returncode == SETUP_FAILED or exit_code == SETUP_FAILED:
            error = "sandbox setup failed: " + (_last_line(stderr) or f"launcher exited with {returncode}")
        elif sig is not None:
            error = _signal_error(sig, limits)
        elif exit_code is None:
            error = "the program's exit status was lost"
        elif exit_code != 0:
            last = _last_line(stderr)
            if "MemoryError" in last:
                error = f"memory limit: the program needed more than {limits.memory_mb} MiB ({last})"
            elif "File too large" in last:
                error = f"file size limit: the program wrote a file larger than {limits.file_size_mb} MiB ({last})"
            elif "No space left on device" in last:
                error = f"work directory full: the program wrote more than {limits.work_dir_mb} MiB ({last})"
            else:
                error = f"the program exited with status {exit_code}" + (f": {last}" if last else "")
        return SandboxResult(
            ok=error is None,
            stdout=stdout,
            stderr=stderr,
            exit_code=exit_code,
            signal=sig,
            error=error,
            timed_out=timed_out,
            truncated=truncated,
            wall_s=time.perf_counter() - t0,
            isolation=isolation,
            refused=refused is not None,
        )


def _isolation(info: dict[str, object] | None) -> Isolation:
    if info is None:
        return Isolation(notes=("the launcher reported nothing",))
    got = info.get("namespaces") or []
    notes = info.get("notes") or []
    assert isinstance(got, list) and isinstance(notes, list)
    isolation = Isolation(
        namespaces=tuple(str(n) for n in got),
        filesystem=bool(info.get("filesystem")),
        unprivileged=bool(info.get("unprivileged")),
        syscall_filter=bool(info.get("syscall_filter")),
        notes=tuple(str(n) for n in notes),
    )
    return isolation


def _signal_error(sig: int, limits: SandboxLimits) -> str:
    if sig == signal.SIGXCPU:
        return f"CPU time limit: the program used more than {limits.cpu_s} s of CPU and was killed"
    if sig == signal.SIGXFSZ:
        return f"file size limit: the program wrote a file larger than {limits.file_size_mb} MiB"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    return f"the program was killed by {name}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _refused(error: str, started: float) -> SandboxResult:
    return SandboxResult(False, "", "", None, None, error, False, False, time.perf_counter() - started)


def _terminate(proc: subprocess.Popen[bytes], grace_s: float = KILL_GRACE_S) -> None:
    """Stop the launcher (SIGTERM: it kills the run's init, hence the pid namespace, reports and removes the
    temporary directory), then SIGKILL the whole process group after `grace_s`; reap. Safe to call on a
    launcher that already exited."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _drain(stream: object) -> bytes:
    """What is left in a pipe whose writers are dead (non-blocking)."""
    fd = stream.fileno()  # type: ignore[attr-defined]
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks)
