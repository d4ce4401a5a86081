"""The seccomp filter bwrap loads for the evaluation sandbox: a classic-BPF program (the bytes
`bwrap --seccomp FD` reads) that refuses the system calls a Python test program never needs and
kernel exploits and escapes often start from.

Refused with EPERM: new namespaces (unshare, setns, clone with a CLONE_NEW* flag), mounts
(mount, umount2, pivot_root, chroot, the new mount API), other processes' memory (ptrace,
process_vm_readv/writev), and the larger kernel attack surface (bpf, perf_event_open, userfaultfd,
io_uring, keyctl, add_key, request_key, kexec, module loading, open_by_handle_at). clone3 answers
ENOSYS (its flags sit in memory a filter cannot read), so the C library falls back to clone.
Calls of another architecture's ABI (x32, i386 on x86-64) end the process.
"""

from __future__ import annotations

import platform
import struct
import sys

# Syscall numbers: name -> (x86-64, AArch64).
_DENIED_BY_NAME = {
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51), "ptrace": (101, 117), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
}  # fmt: skip
_DENIED = {machine: {name: numbers[column] for name, numbers in _DENIED_BY_NAME.items()}
           for column, machine in enumerate(("x86_64", "aarch64"))}
# Numbered alike on both (the unified table from 5.1 on): io_uring and the new mount API.
_DENIED_COMMON = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}  # fmt: skip
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWTIME | NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_NEW_FLAGS = 0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
_CLONE_NEW_FLAGS |= 0x20000000 | 0x40000000

# Classic BPF (linux/filter.h, linux/seccomp.h).
_LOAD_WORD = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JUMP_EQUAL, _JUMP_AT_LEAST, _JUMP_ANY_BIT = 0x05 | 0x10, 0x05 | 0x30, 0x05 | 0x40  # BPF_JMP | BPF_K
_RETURN = 0x06
_KILL_PROCESS, _ALLOW = 0x80000000, 0x7FFF0000
_ERRNO = 0x00050000
_EPERM, _ENOSYS = 1, 38
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg 0's low word: little-endian)


def _op(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one) as struct sock_filter[] bytes, or None for an
    architecture without a table here (the sandbox then runs without a filter: features() says)."""
    machine = machine or platform.machine()
    if machine not in _DENIED or sys.byteorder != "little":
        return None
    refuse = _op(_RETURN, _ERRNO | _EPERM)
    program = [
        _op(_LOAD_WORD, _ARCH),
        _op(_JUMP_EQUAL, _AUDIT_ARCH[machine], jump_true=1),
        _op(_RETURN, _KILL_PROCESS),
        _op(_LOAD_WORD, _NR),
    ]
    if machine == "x86_64":
        program += [_op(_JUMP_AT_LEAST, _X32_SYSCALL_BIT, jump_false=1), _op(_RETURN, _KILL_PROCESS)]
    program += [_op(_JUMP_EQUAL, _CLONE3, jump_false=1), _op(_RETURN, _ERRNO | _ENOSYS)]
    for number in sorted({*_DENIED[machine].values(), *_DENIED_COMMON.values()}):
        program += [_op(_JUMP_EQUAL, number, jump_false=1), refuse]
    program += [
        _op(_JUMP_EQUAL, _CLONE[machine], jump_false=3),  # not clone: to the final allow
        _op(_LOAD_WORD, _ARG0),
        _op(_JUMP_ANY_BIT, _CLONE_NEW_FLAGS, jump_false=1),
        refuse,
        _op(_RETURN, _ALLOW),
    ]
    return b"".join(program)
