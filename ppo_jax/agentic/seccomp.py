"""Seccomp filters for the sandbox: classic BPF programs that make the kernel refuse the system calls a
tool's Python code never needs (`sandbox_boundary.py` hands them to the sandbox).

    program = boundary_filter()          # bytes: struct sock_filter[], what bwrap's --seccomp reads
    program = no_new_programs_filter()   # installed by the sandbox's runner itself, after its start-up

Two filters because bwrap applies its filter before it executes the interpreter: `execve` can only be
refused once the interpreter runs, by the runner (`_sandbox_child.py`), before the tool's code starts.
Filters stack in the kernel, and none can be removed: the code runs under both.

A deny list, not an allow list: CPython's start-up and its standard library use a wide, version-
dependent set of calls, and everything the tool could use to leave its namespaces, reach the network or
another process, or keep state past its run is on the list. Denied calls fail with EPERM (ENOSYS for
`clone3`, so that glibc falls back to `clone`, whose flags a classic BPF filter can read), as the code
then sees an ordinary OSError. A foreign architecture (x32, i386 on x86-64) kills the process.

The numbers are the kernel's (`asm/unistd_64.h` on x86-64, `asm-generic/unistd.h` on arm64), the
layout is `struct seccomp_data` and `struct sock_filter` (linux/seccomp.h, linux/filter.h). libseccomp
would generate the same programs, but it has no maintained Python binding on PyPI; this file is the
whole of it and the tests run each filter in a real process.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # args[0]'s low 32 bits (little-endian): clone's flags

# BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
_LD_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ, _JGE, _JSET = 0x15, 0x35, 0x45  # BPF_JMP | BPF_{JEQ,JGE,JSET} | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
CLONE_THREAD = 0x00010000
X32_SYSCALL_BIT = 0x40000000

# AUDIT_ARCH_* (linux/audit.h) and each architecture's numbers of the calls named below.
_ARCHES = {
    "x86_64": (0xC000003E, {
        "socket": 41, "socketpair": 53, "connect": 42, "accept": 43, "accept4": 288, "bind": 49, "listen": 50,
        "sendto": 44, "recvfrom": 45, "sendmsg": 46, "recvmsg": 47, "sendmmsg": 307, "recvmmsg": 299,
        "shutdown": 48, "setsockopt": 54, "getsockopt": 55, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "kcmp": 312, "pidfd_open": 434, "pidfd_getfd": 438, "mount": 165,
        "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "unshare": 272, "setns": 308,
        "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semget": 64, "semop": 65, "semtimedop": 220,
        "semctl": 66, "shmget": 29, "shmat": 30, "shmdt": 67, "shmctl": 31, "kexec_load": 246,
        "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176, "reboot": 169,
        "swapon": 167, "swapoff": 168, "sethostname": 170, "setdomainname": 171, "acct": 163, "quotactl": 179,
        "syslog": 103, "iopl": 172, "ioperm": 173, "name_to_handle_at": 303, "open_by_handle_at": 304,
        "fanotify_init": 300, "lookup_dcookie": 212, "vhangup": 153, "mknod": 133, "mknodat": 259,
        "personality": 135, "execve": 59, "execveat": 322, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435}),
    "aarch64": (0xC00000B7, {
        "socket": 198, "socketpair": 199, "connect": 203, "accept": 202, "accept4": 242, "bind": 200,
        "listen": 201, "sendto": 206, "recvfrom": 207, "sendmsg": 211, "recvmsg": 212, "sendmmsg": 269,
        "recvmmsg": 243, "shutdown": 210, "setsockopt": 208, "getsockopt": 209, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_open": 434, "pidfd_getfd": 438,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "unshare": 97,
        "setns": 268, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "semget": 190, "semop": 193,
        "semtimedop": 192, "semctl": 191, "shmget": 194, "shmat": 196, "shmdt": 197, "shmctl": 195,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "sethostname": 161,
        "setdomainname": 162, "acct": 89, "quotactl": 60, "syslog": 116, "name_to_handle_at": 264,
        "open_by_handle_at": 265, "fanotify_init": 262, "lookup_dcookie": 18, "vhangup": 58, "mknodat": 33,
        "personality": 92, "execve": 221, "execveat": 281, "clone": 220, "clone3": 435}),
}

# What each group keeps the code from; docs/agentic.md's threat model names the groups.
NETWORK = ("socket", "socketpair", "connect", "accept", "accept4", "bind", "listen", "sendto", "recvfrom",
           "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "setsockopt", "getsockopt")
OTHER_PROCESSES = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open", "pidfd_getfd")
NAMESPACES_AND_MOUNTS = ("mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
                         "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns")
KERNEL_STATE = ("keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
                "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
                "finit_module", "delete_module", "reboot", "swapon", "swapoff", "sethostname", "setdomainname",
                "acct", "quotactl", "syslog", "iopl", "ioperm", "name_to_handle_at", "open_by_handle_at",
                "fanotify_init", "lookup_dcookie", "vhangup", "mknod", "mknodat", "personality")
SYSV_IPC = ("msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl", "shmget", "shmat",
            "shmdt", "shmctl")
NEW_PROCESSES = ("fork", "vfork")  # and clone without CLONE_THREAD, clone3 (see _program)
NEW_PROGRAMS = ("execve", "execveat")


class UnsupportedArchitecture(RuntimeError):
    """No syscall table for this machine: the sandbox cannot build its filter (fail closed)."""


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter, native byte order


def _program(machine: str, denied: tuple[str, ...], threads_only: bool) -> bytes:
    """The filter: a foreign architecture kills; a denied call returns EPERM; with `threads_only`,
    clone without CLONE_THREAD returns EPERM and clone3 ENOSYS (threads still start); the rest is allowed.

    Layout (each jump counts the instructions it skips):
        0 ld arch; 1 jeq ARCH ? 3 : 2; 2 ret KILL; 3 ld nr; [4 jge X32 ? eperm]
        one `jeq NR ? eperm` per denied call; [clone: jeq ? ld flags, jset THREAD ? allow : eperm]
        [clone3: jeq ? enosys]; ret ALLOW; enosys: ret ENOSYS; eperm: ret EPERM
    """
    if machine not in _ARCHES:
        raise UnsupportedArchitecture(f"the sandbox has no seccomp table for {machine!r} (x86_64 and aarch64 only)")
    audit_arch, numbers = _ARCHES[machine]
    numbers_denied = sorted({numbers[name] for name in denied if name in numbers})
    head = [_instruction(_LD_ABS, _ARCH), _instruction(_JEQ, audit_arch, jt=1), _instruction(_RET, RET_KILL_PROCESS),
            _instruction(_LD_ABS, _NR)]
    # Each body entry is (code, k, jt, jf) with "EPERM"/"ENOSYS"/"ALLOW" as symbolic targets, resolved below.
    body: list[tuple[int, int, object, object]] = []
    if machine == "x86_64":  # x32 calls reach the same kernel entries under other numbers
        body.append((_JGE, X32_SYSCALL_BIT, "EPERM", 0))
    body += [(_JEQ, nr, "EPERM", 0) for nr in numbers_denied]
    if threads_only:
        body += [(_JEQ, numbers["clone"], 0, 2), (_LD_ABS, _ARG0_LOW, 0, 0), (_JSET, CLONE_THREAD, "ALLOW", "EPERM"),
                 (_JEQ, numbers["clone3"], "ENOSYS", 0)]
    tail_labels = {"ALLOW": len(body), "ENOSYS": len(body) + 1, "EPERM": len(body) + 2}
    out = list(head)
    for i, (code, k, jt, jf) in enumerate(body):
        jumps = [tail_labels[t] - i - 1 if isinstance(t, str) else t for t in (jt, jf)]
        if code == _LD_ABS:
            jumps = [0, 0]
        out.append(_instruction(code, k, *jumps))
    out += [_instruction(_RET, RET_ALLOW), _instruction(_RET, RET_ERRNO | errno.ENOSYS),
            _instruction(_RET, RET_ERRNO | errno.EPERM)]
    if len(out) > 255:
        raise AssertionError("a BPF jump cannot span more than 255 instructions")
    return b"".join(out)


def boundary_filter(machine: str | None = None) -> bytes:
    """Applied by bwrap before the interpreter starts: no network, no other processes' memory, no new
    namespaces or mounts, no kernel keyrings / BPF / io_uring / modules, no SysV IPC, no new processes
    (threads start; a fork cannot)."""
    denied = NETWORK + OTHER_PROCESSES + NAMESPACES_AND_MOUNTS + KERNEL_STATE + SYSV_IPC + NEW_PROCESSES
    return _program(machine or platform.machine(), denied, threads_only=True)


def no_new_programs_filter(machine: str | None = None) -> bytes:
    """Installed by the runner after the interpreter started: no `execve` / `execveat`."""
    return _program(machine or platform.machine(), NEW_PROGRAMS, threads_only=False)
