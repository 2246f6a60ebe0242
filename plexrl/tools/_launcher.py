"""Sandbox launcher: the trusted first process of one sandboxed run. Standard library only.

Started by `plexrl.tools.sandbox.Sandbox` as `python -I -S _launcher.py` with a scrubbed environment, in its
own session; it reads one JSON job from stdin and reports on the status file descriptor named in the job, one
JSON object per line: {"isolation": {...}} once, then {"exit": n}, {"signal": n}, {"deadline": s},
{"refused": "..."} (strict mode) or {"error": "..."}.

What it does, each step only where the job asks for it and the kernel allows it (failures degrade and are
reported in the isolation line, never hidden; a strict job refuses to run instead):
0. ties its life to the caller (PR_SET_PDEATHSIG: SIGTERM when the caller's thread dies) and arms its own
   wall-clock alarm at the job's timeout, so a run never outlives a dead, stopped or interrupted caller;
1. unshare(2) network, pid, ipc and uts namespaces (with a user namespace when not root) and names the host
   "sandbox"; the launcher itself stays in the caller's mount namespace, so it can remove the temp dir;
2. forks the run's first process, which unshares a mount namespace and pivot_roots into a fresh read-only
   tmpfs that holds only the Python installation, /usr (shared libraries) and the extra read-only paths, all
   bind-mounted read-only and nosuid, four device nodes (null, zero, random, urandom) and a size-limited tmpfs
   at /tmp, the work directory; with a pid namespace that process is its init (pid 1), which forks the user
   process, reaps every orphan, reports the user process's exit and exits: the kernel then kills whatever is
   left in the pid namespace;
3. in the user process: rlimits (all of them set, none inherited), an unprivileged uid of its own (1_000_000
   + the launcher's pid) when root, a fresh session keyring, no_new_privs, the seccomp filter built by
   `plexrl.tools.seccomp`, then execve Python;
4. when everything has exited: kills what is left of the run's uid (no pid namespace), reaps, and removes the
   run's temporary directory when the caller is gone (otherwise the caller does).

SIGTERM (from the caller, or as the death signal of a dead caller) and the alarm kill the run (its first
process, hence the namespace) and still report; the caller falls back to SIGKILL of the process group. This
module is not imported by the library; it is executed as a script.
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
from typing import Any, NoReturn

CLONE = {"mount": 0x00020000, "uts": 0x04000000, "ipc": 0x08000000, "pid": 0x20000000, "network": 0x40000000}
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_GET_SECCOMP, PR_SET_SECCOMP = 1, 4, 21, 22
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
SECCOMP_MODE_FILTER = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 280, "s390x": 280}
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = 1, 7, -4, -5
UID_BASE = 1_000_000
HOSTNAME = b"sandbox"
DEVICES = ("null", "zero", "random", "urandom")
ROOT_LINKS = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")
STACK_BYTES = 8 << 20
SIGPENDING = 64

libc = ctypes.CDLL(None, use_errno=True)
state = {"child": 0, "deadline": False}


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


class Refused(Exception):
    """Strict mode: the isolation the job requires is not available."""


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def bind_readonly(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def unshare(names: list[str], user_ns: bool) -> tuple[list[str], list[str], bool]:
    """Unshare as many of `names` as the kernel allows: (those that worked, notes on the others, user ns made)."""
    flags = CLONE_NEWUSER if user_ns else 0
    if libc.unshare(flags | sum(CLONE[n] for n in names)) == 0:
        return list(names), [], user_ns
    if user_ns and libc.unshare(CLONE_NEWUSER) != 0:
        return [], [f"user namespace refused ({os.strerror(ctypes.get_errno())}): no namespaces without it"], False
    done: list[str] = []
    notes: list[str] = []
    for name in names:
        if libc.unshare(CLONE[name]) == 0:
            done.append(name)
        else:
            notes.append(f"{name} namespace refused: {os.strerror(ctypes.get_errno())}")
    return done, notes, user_ns


def map_user(inside_id: int) -> None:
    uid, gid = os.getuid(), os.getgid()
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inside_id} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inside_id} {gid} 1")


def build_root(job: dict[str, Any], uid: int) -> str:
    """Populate a tmpfs at job["root_dir"] and pivot_root into it. Work dir: /tmp (tmpfs owned by uid)."""
    root = job["root_dir"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=512,mode=755")
    done: list[str] = []
    for path in ["/usr", job["python_prefix"], *job["readonly_paths"]]:
        if not os.path.isdir(path) or path == "/" or any(path.startswith(d + "/") or path == d for d in done):
            continue
        done.append(path)
        os.makedirs(root + path, exist_ok=True)
        bind_readonly(path, root + path)
    for name in ROOT_LINKS:
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{name}")
        elif os.path.isdir(host):
            os.makedirs(f"{root}/{name}")
            bind_readonly(host, f"{root}/{name}")
    os.makedirs(f"{root}/dev")
    for dev in DEVICES:
        open(f"{root}/dev/{dev}", "w").close()
        mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    work = f"{root}/tmp"
    os.makedirs(work)
    size = job["limits"]["work_dir_bytes"]
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes=1024,mode=700,uid={uid},gid={uid}")
    os.makedirs(f"{root}/.old")
    check(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], root.encode(), f"{root}/.old".encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return "/tmp"


def set_limits(limits: dict[str, Any]) -> None:
    """Every rlimit that matters, so that nothing is inherited from the caller."""
    cpu = limits["cpu_s"]
    _, stack_hard = resource.getrlimit(resource.RLIMIT_STACK)
    stack = STACK_BYTES if stack_hard == resource.RLIM_INFINITY else min(stack_hard, STACK_BYTES)
    for res, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
        (resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2),
        (resource.RLIMIT_NPROC, (limits["max_processes"],) * 2),
        (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_STACK, (stack, stack)),
        (resource.RLIMIT_MEMLOCK, (0, 0)),
        (resource.RLIMIT_MSGQUEUE, (0, 0)),
        (resource.RLIMIT_RTPRIO, (0, 0)),
        (resource.RLIMIT_NICE, (0, 0)),
        (resource.RLIMIT_SIGPENDING, (SIGPENDING, SIGPENDING)),
    ):
        resource.setrlimit(res, value)


def keyctl(*args: int | None) -> int:
    return int(libc.syscall(SYS_KEYCTL[os.uname().machine], *args))


def load_filter(program: list[list[int]]) -> None:
    """Install the seccomp filter on this process (and all it will start). Needs no_new_privs."""
    insns = (SockFilter * len(program))(*(SockFilter(*ins) for ins in program))
    prog = SockFprog(len(program), insns)
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def run_user(job: dict[str, Any], work: str, uid: int, drop_uid: bool) -> NoReturn:
    """In the forked user process: limits, credentials, keyring, filter, execve. Never returns."""
    try:
        os.chdir(work)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        set_limits(job["limits"])
        if drop_uid:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a change of uid cleared it
        if os.uname().machine in SYS_KEYCTL and keyctl(KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
            err = ctypes.get_errno()
            if err != 38:  # ENOSYS: a kernel without keyrings has nothing to read
                raise OSError(err, f"cannot join a fresh session keyring: {os.strerror(err)}")
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        if job["seccomp"]:
            load_filter(job["seccomp"])
        os.execve(job["python"], [job["python"], "-I", "-B", "main.py"], job["env"])
    except PermissionError as exc:
        hint = " (the run's unprivileged uid cannot reach the interpreter: allow mount namespaces, or install Python"
        hint += " where every user can read it)" if drop_uid else ""
        os.write(2, f"plexrl-sandbox: cannot start the program: {exc}{hint}\n".encode())
    except BaseException as exc:
        os.write(2, f"plexrl-sandbox: cannot start the program: {exc}\n".encode())
    os._exit(125)


def wait_status(pid: int) -> dict[str, Any]:
    """Wait for `pid`, reaping any other child (orphans) on the way; return the status record."""
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return {"error": "lost track of the program"}
        if got == pid:
            if os.WIFSIGNALED(status):
                return {"signal": os.WTERMSIG(status)}
            return {"exit": os.waitstatus_to_exitcode(status)}


def sweep(uid: int, clear_keys: bool) -> None:
    """Kill every process left with the run's own uid (kill(-1) from that uid spares only the caller) and, when
    asked, empty that uid's user keyrings, so that a later run that gets the same uid finds nothing."""
    sweeper = os.fork()
    if sweeper == 0:
        try:
            os.setresuid(uid, uid, uid)
            with contextlib.suppress(ProcessLookupError):  # nothing left to kill
                os.kill(-1, signal.SIGKILL)
            if clear_keys and os.uname().machine in SYS_KEYCTL:
                keyctl(KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING)
                keyctl(KEYCTL_CLEAR, KEY_SPEC_USER_SESSION_KEYRING)
        finally:
            os._exit(0)
    os.waitpid(sweeper, 0)


def reap_all(block: bool) -> None:
    """Reap the orphans this launcher inherited as child subreaper (all dead after a sweep: block)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def report(fd: int, record: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())


def on_stop(signum: int, frame: object) -> None:
    """SIGTERM (caller's request, or the caller died) or SIGALRM (the launcher's own deadline)."""
    state["deadline"] = state["deadline"] or signum == signal.SIGALRM
    if state["child"]:
        with contextlib.suppress(ProcessLookupError):  # already exited and reaped
            os.kill(state["child"], signal.SIGKILL)
    else:
        raise TimeoutError("stopped during set-up")


def first_process(job: dict[str, Any], isolation: dict[str, Any], uid: int, root_user: bool) -> NoReturn:
    """The forked first process of the run: mount namespace and root, report, strict check, then either the
    pid namespace's init (forks the user process, reports its exit) or, without one, the user process."""
    try:
        status_fd = job["status_fd"]
        work = job["work_dir"]
        if "mount" in job["namespaces"]:
            if libc.unshare(CLONE["mount"]) == 0:
                isolation["namespaces"].append("mount")
                try:
                    work = build_root(job, uid)
                    isolation["filesystem"] = True
                except OSError as exc:
                    isolation["notes"].append(f"filesystem not isolated: {exc}")
            else:
                isolation["notes"].append(f"mount namespace refused: {os.strerror(ctypes.get_errno())}")
        if not isolation["filesystem"]:
            os.chmod(work, 0o700)
            if root_user:
                os.chown(work, uid, uid)
        report(status_fd, {"isolation": isolation})
        missing = [n for n in job["all_namespaces"] if n not in isolation["namespaces"]]
        missing += [w for w in ("filesystem", "unprivileged", "syscall_filter") if not isolation[w]]
        if job["strict"] and missing:
            raise Refused(f"strict mode: refusing to run without {', '.join(missing)} isolation")
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(job["code"])
        if "pid" not in isolation["namespaces"]:
            run_user(job, work, uid, root_user)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        user = os.fork()
        if user == 0:
            run_user(job, work, uid, root_user)
        report(status_fd, wait_status(user))
        if root_user and not isolation["syscall_filter"]:
            sweep(uid, clear_keys=True)  # from inside: the launcher cannot fork into a pid namespace without init
        os._exit(0)
    except Refused as exc:
        report(job["status_fd"], {"refused": str(exc)})
    except BaseException as exc:
        os.write(2, f"plexrl-sandbox: setup failed: {type(exc).__name__}: {exc}\n".encode())
    os._exit(125)


def main(job: dict[str, Any]) -> None:
    status_fd = job["status_fd"]
    os.set_inheritable(status_fd, False)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root_user = os.geteuid() == 0
    uid = UID_BASE + os.getpid() if root_user else 1000
    isolation: dict[str, Any] = {
        "namespaces": [],
        "filesystem": False,
        "unprivileged": False,
        "syscall_filter": False,
        "notes": [],
    }
    names = [n for n in CLONE if n in job["namespaces"] and n != "mount"]
    user_ns = bool(job["namespaces"]) and not root_user
    try:
        done, notes, user_made = unshare(names, user_ns)
        isolation["namespaces"], isolation["notes"] = done, notes
        if user_made:
            map_user(uid)
            isolation["unprivileged"] = True
    except OSError as exc:
        isolation["notes"].append(f"namespaces: {exc}")
    if "uts" in isolation["namespaces"] and libc.sethostname(HOSTNAME, len(HOSTNAME)) != 0:
        isolation["notes"].append(f"host name kept: {os.strerror(ctypes.get_errno())}")
    if not root_user and not isolation["unprivileged"]:
        uid = os.getuid()
        isolation["notes"].append("runs as the caller's own user: it can signal the caller's other processes")
    isolation["unprivileged"] = isolation["unprivileged"] or root_user
    if not job["seccomp"]:
        isolation["notes"].append(f"no system-call filter for this machine ({os.uname().machine})")
    elif libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) < 0:
        isolation["notes"].append(f"no system-call filter: seccomp unavailable ({os.strerror(ctypes.get_errno())})")
        job["seccomp"] = None
    isolation["syscall_filter"] = bool(job["seccomp"])
    pid_ns = "pid" in isolation["namespaces"]
    launcher = os.getpid()
    stops = {signal.SIGTERM, signal.SIGALRM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # no handler may run between fork and state["child"]
    child = os.fork()
    if child == 0:
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            for signum in stops:
                signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            if os.getppid() in (launcher, 0):  # 0: pid 1 of a new pid namespace does not see its parent
                first_process(job, isolation, uid, root_user)
        finally:
            os._exit(125)
    state["child"] = child
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    _, status = os.waitpid(child, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if state["deadline"]:
        report(status_fd, {"deadline": job["timeout_s"]})
    elif not pid_ns or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 125):
        exited = {"exit": os.waitstatus_to_exitcode(status)}  # with a pid namespace: init's set-up failed
        report(status_fd, {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else exited)
    if root_user and not pid_ns:
        sweep(uid, clear_keys=not isolation["syscall_filter"])
    reap_all(block=root_user or pid_ns)


if __name__ == "__main__":
    temp_dir = None
    try:
        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGALRM, on_stop)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        the_job = json.loads(sys.stdin.buffer.read())
        temp_dir = the_job["temp_dir"]
        if os.getppid() != the_job["caller_pid"]:
            raise RuntimeError("the caller died before the run started")
        signal.setitimer(signal.ITIMER_REAL, the_job["timeout_s"])
        main(the_job)
    except Exception as exc:
        sys.stderr.write(f"plexrl-sandbox: setup failed: {type(exc).__name__}: {exc}\n")
        sys.exit(125)
    finally:
        if temp_dir is not None and os.getppid() != the_job["caller_pid"]:  # the caller is gone: nobody else will
            import shutil

            shutil.rmtree(temp_dir, ignore_errors=True)
