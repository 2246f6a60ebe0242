"""The sandbox's system-call filter: a classic-BPF seccomp program, built here and installed by the launcher.

`filter_program(machine)` returns the program as a list of `(code, jt, jf, k)` instructions (struct
sock_filter), which `_launcher.py` loads with `prctl(PR_SET_SECCOMP)` in the user process after every other
set-up step and right before `execve`; the filter then holds for the program and everything it starts.

What it does, in order:
1. a system call made with another ABI than the machine's own (i386 `int 0x80` on x86-64) kills the process
   (SIGSYS): the tables below would not apply to it; x32 calls (`nr | 0x40000000`) fail with ENOSYS;
2. `clone` with any namespace flag fails with EPERM; `clone3` fails with ENOSYS (its flags sit in memory that
   seccomp cannot read; the C library then falls back to `clone`);
3. `socket` and `socketpair` work only for AF_UNIX, AF_INET and AF_INET6; any other family (AF_VSOCK,
   AF_NETLINK, AF_PACKET, AF_ALG, ...) fails with EAFNOSUPPORT;
4. every call in `DENIED` fails with EPERM: new namespaces (`unshare`, `setns`), the kernel keyring, eBPF,
   perf events, userfaultfd, io_uring, mounts, module and kexec loading, ptrace and cross-process memory
   access, SysV IPC and memfd (kernel memory outside RLIMIT_AS), and a few other privileged calls;
5. everything else is allowed.

Supported machines: x86_64 and aarch64 (numbers checked against the kernel's unistd headers); elsewhere
`filter_program` returns None and the run has no filter (`Isolation.syscall_filter` is False, and a strict
sandbox refuses to run). Not done here: argument checks beyond the clone flags and socket families, and any
filter on the launcher itself or the pid-namespace init (both trusted).
"""

from __future__ import annotations

import errno

# struct sock_filter opcodes (linux/filter.h, linux/bpf_common.h)
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = 32-bit word of seccomp_data at k
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K

# struct seccomp_data offsets: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (little-endian)
NR_OFFSET, ARCH_OFFSET, ARG0_OFFSET = 0, 4, 16

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

X32_SYSCALL_BIT = 0x40000000
NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}

DENIED = (
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "open_by_handle_at",
    "name_to_handle_at",
    "fanotify_init",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "personality",
    "quotactl",
    "vhangup",
    "syslog",
    "lookup_dcookie",
    "shmget",
    "msgget",
    "semget",
    "memfd_create",
)

# name -> number, per machine (x86_64: asm/unistd_64.h; aarch64: asm-generic/unistd.h)
_X86_64 = {
    "clone": 56, "clone3": 435, "socket": 41, "socketpair": 53,
    "unshare": 272, "setns": 308, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "open_by_handle_at": 304, "name_to_handle_at": 303, "fanotify_init": 300, "acct": 163, "swapon": 167,
    "swapoff": 168, "reboot": 169, "personality": 135, "quotactl": 179, "vhangup": 153, "syslog": 103,
    "lookup_dcookie": 212, "shmget": 29, "msgget": 68, "semget": 64, "memfd_create": 319,
}  # fmt: skip
_AARCH64 = {
    "clone": 220, "clone3": 435, "socket": 198, "socketpair": 199,
    "unshare": 97, "setns": 268, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
    "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
    "delete_module": 106, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
    "open_by_handle_at": 265, "name_to_handle_at": 264, "fanotify_init": 262, "acct": 89, "swapon": 224,
    "swapoff": 225, "reboot": 142, "personality": 92, "quotactl": 60, "vhangup": 58, "syslog": 116,
    "lookup_dcookie": 18, "shmget": 194, "msgget": 186, "semget": 190, "memfd_create": 279,
}  # fmt: skip
ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, _X86_64),  # AUDIT_ARCH_X86_64
    "aarch64": (0xC00000B7, _AARCH64),  # AUDIT_ARCH_AARCH64
}

Instruction = tuple[int, int, int, int]


def _errno(code: int) -> int:
    return RET_ERRNO | code


def filter_program(machine: str) -> list[Instruction] | None:
    """The filter for `machine` (`os.uname().machine`) as sock_filter tuples, or None when unsupported.

    >>> prog = filter_program("x86_64")
    >>> prog[0], prog[-1] == (RET_K, 0, 0, RET_ALLOW), filter_program("mips") is None
    ((32, 0, 0, 4), True, True)
    """
    if machine not in ARCHES:
        return None
    arch, nr = ARCHES[machine]
    prog: list[Instruction] = [
        (LD_W_ABS, 0, 0, ARCH_OFFSET),
        (JEQ_K, 1, 0, arch),
        (RET_K, 0, 0, RET_KILL_PROCESS),
        (LD_W_ABS, 0, 0, NR_OFFSET),
    ]
    if machine == "x86_64":
        prog += [(JGE_K, 0, 1, X32_SYSCALL_BIT), (RET_K, 0, 0, _errno(errno.ENOSYS))]
    prog += [(JEQ_K, 0, 1, nr["clone3"]), (RET_K, 0, 0, _errno(errno.ENOSYS))]
    for name in DENIED:
        prog += [(JEQ_K, 0, 1, nr[name]), (RET_K, 0, 0, _errno(errno.EPERM))]
    # clone: A = low word of flags; deny any namespace flag
    prog += [
        (JEQ_K, 0, 4, nr["clone"]),
        (LD_W_ABS, 0, 0, ARG0_OFFSET),
        (JSET_K, 0, 1, NAMESPACE_FLAGS),
        (RET_K, 0, 0, _errno(errno.EPERM)),
        (RET_K, 0, 0, RET_ALLOW),
    ]
    families = sorted(SOCKET_FAMILIES.values())
    for call in ("socket", "socketpair"):
        n = len(families)
        block: list[Instruction] = [(LD_W_ABS, 0, 0, ARG0_OFFSET)]
        block += [(JEQ_K, n - i, 0, family) for i, family in enumerate(families)]
        block += [(RET_K, 0, 0, _errno(errno.EAFNOSUPPORT)), (RET_K, 0, 0, RET_ALLOW)]
        prog += [(JEQ_K, 0, len(block), nr[call]), *block]
    prog.append((RET_K, 0, 0, RET_ALLOW))
    return prog


def evaluate(program: list[Instruction], nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """What `program` returns for one system call: a reference interpreter of the instructions used here, for
    tests and for reading the filter (the kernel runs the real one).

    >>> evaluate(filter_program("x86_64"), 272, 0xC000003E) == RET_ERRNO | errno.EPERM
    True
    """
    words = {NR_OFFSET: nr & 0xFFFFFFFF, ARCH_OFFSET: arch}
    for i, value in enumerate(args):
        words[ARG0_OFFSET + 8 * i] = value & 0xFFFFFFFF
        words[ARG0_OFFSET + 8 * i + 4] = (value >> 32) & 0xFFFFFFFF
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        pc += 1
        if code == LD_W_ABS:
            acc = words.get(k, 0)
        elif code == RET_K:
            return k
        elif code in (JEQ_K, JGE_K, JSET_K):
            taken = acc == k if code == JEQ_K else acc >= k if code == JGE_K else bool(acc & k)
            pc += jt if taken else jf
        else:
            raise ValueError(f"instruction {code:#x} at {pc - 1} is not one this module emits")
