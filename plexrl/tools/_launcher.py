"""Sandbox launcher: the trusted first process of one sandboxed run. Standard library only.

Started by `plexrl.tools.sandbox.Sandbox` as `python -I -S _launcher.py` with a scrubbed environment, in its
own session; it reads one JSON job from stdin and reports on the status file descriptor named in the job, one
JSON object per line: {"isolation": {...}} once, then {"exit": n} or {"signal": n}, or {"error": "..."}.

What it does, each step only where the job asks for it and the kernel allows it (failures degrade and are
reported in the isolation line, never hidden):
1. unshare(2) network, mount, pid, ipc and uts namespaces (with a user namespace when not root);
2. in the new mount namespace, pivot_root into a fresh read-only tmpfs that holds only the Python installation,
   /usr (shared libraries) and the extra read-only paths, all bind-mounted read-only and nosuid, four device
   nodes (null, zero, random, urandom) and a size-limited tmpfs at /tmp, the work directory;
3. fork the namespace's init (pid 1), which forks the user process, reaps every orphan, reports the user
   process's exit and exits: the kernel then kills whatever is left in the pid namespace;
4. in the user process: rlimits (CPU, address space, file size, processes, open files, no core dumps), an
   unprivileged uid of its own (1_000_000 + the launcher's pid) when root, no_new_privs, then execve Python.

SIGTERM to the launcher kills the run (its init, hence the namespace) and still reports; the caller falls back
to SIGKILL of the process group. This module is not imported by the library; it is executed as a script.
"""

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
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
UID_BASE = 1_000_000
DEVICES = ("null", "zero", "random", "urandom")
ROOT_LINKS = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")

libc = ctypes.CDLL(None, use_errno=True)
state = {"child": 0}


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


def run_user(job: dict[str, Any], work: str, uid: int, drop_uid: bool) -> NoReturn:
    """In the forked user process: limits, credentials, execve. Never returns."""
    try:
        limits = job["limits"]
        os.chdir(work)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        cpu = limits["cpu_s"]
        for res, value in (
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
            (resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2),
            (resource.RLIMIT_NPROC, (limits["max_processes"],) * 2),
            (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            resource.setrlimit(res, value)
        if drop_uid:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
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


def sweep(uid: int) -> None:
    """Kill every process left with the run's own uid: kill(-1) from that uid spares only the caller."""
    sweeper = os.fork()
    if sweeper == 0:
        os.setresuid(uid, uid, uid)
        os.kill(-1, signal.SIGKILL)
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


def on_term(signum: int, frame: object) -> None:
    if state["child"]:
        os.kill(state["child"], signal.SIGKILL)


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    status_fd = job["status_fd"]
    os.set_inheritable(status_fd, False)
    signal.signal(signal.SIGTERM, on_term)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root_user = os.geteuid() == 0
    uid = UID_BASE + os.getpid() if root_user else 1000
    isolation: dict[str, Any] = {"namespaces": [], "filesystem": False, "unprivileged": False, "notes": []}
    names = [n for n in CLONE if n in job["namespaces"]]
    user_ns = bool(names) and not root_user
    try:
        done, notes, user_made = unshare(names, user_ns)
        isolation["namespaces"], isolation["notes"] = done, notes
        if user_made:
            map_user(uid)
            isolation["unprivileged"] = True
    except OSError as exc:
        isolation["notes"].append(f"namespaces: {exc}")
    if not root_user and not isolation["unprivileged"]:
        uid = os.getuid()
        isolation["notes"].append("runs as the caller's own user: it can signal the caller's other processes")
    work = job["work_dir"]
    if "mount" in isolation["namespaces"]:
        try:
            work = build_root(job, uid)
            isolation["filesystem"] = True
        except OSError as exc:
            isolation["notes"].append(f"filesystem not isolated: {exc}")
    if not isolation["filesystem"]:
        os.chmod(work, 0o700)
        if root_user:
            os.chown(work, uid, uid)
    with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
        f.write(job["code"])
    isolation["unprivileged"] = isolation["unprivileged"] or root_user
    report(status_fd, {"isolation": isolation})
    pid_ns = "pid" in isolation["namespaces"]
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if not pid_ns:
            run_user(job, work, uid, root_user)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        user = os.fork()
        if user == 0:
            run_user(job, work, uid, root_user)
        report(status_fd, wait_status(user))
        os._exit(0)
    state["child"] = child
    _, status = os.waitpid(child, 0)
    if not pid_ns:
        exited = {"exit": os.waitstatus_to_exitcode(status)}
        report(status_fd, {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else exited)
    if root_user and not pid_ns:
        sweep(uid)
    reap_all(block=root_user or pid_ns)


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        sys.stderr.write(f"plexrl-sandbox: setup failed: {type(exc).__name__}: {exc}\n")
        sys.exit(125)
