"""Take from this process, and every process it starts, the right to copy another process's
file descriptors (pidfd_getfd), as Yama's ptrace_scope=1 does for a child reading its parent,
and containers without CAP_SYS_PTRACE do for anyone: a seccomp filter that makes the call fail
with EPERM. What emmpool's IPC must do without (emmpool/ipc_service.hpp).

Linux on x86-64 or AArch64 only (the syscall numbers below); a filter cannot be removed, so
install it only in a process made for the test.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

SYS_PIDFD_OPEN = 434
SYS_PIDFD_GETFD = 438
_SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1  # every thread of the process, not the caller's alone
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_RET_K = 0x20, 0x15, 0x06


def supported() -> str | None:
    """Why the filter cannot be installed here, or None."""
    if platform.system() != "Linux" or platform.machine() not in _SYS_SECCOMP:
        return f"a seccomp filter for {platform.system()} on {platform.machine()}"
    return None


def deny_pidfd_getfd() -> None:
    """Install the filter (raises OSError where the kernel refuses it)."""
    machine = platform.machine()
    # seccomp_data: nr at offset 0, arch at offset 4.
    program = [
        (_BPF_LD_W_ABS, 0, 0, 4),                               # arch
        (_BPF_JEQ_K, 0, 2, _AUDIT_ARCH[machine]),               # another arch: allow
        (_BPF_LD_W_ABS, 0, 0, 0),                               # nr
        (_BPF_JEQ_K, 0, 1, SYS_PIDFD_GETFD),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    code = b"".join(struct.pack("=HBBI", *ins) for ins in program)
    buffer = ctypes.create_string_buffer(code)
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(buffer))  # sock_fprog
    fprog_buffer = ctypes.create_string_buffer(fprog)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(_SYS_SECCOMP[machine]), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                    ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC),
                    ctypes.c_void_p(ctypes.addressof(fprog_buffer))) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")


def pidfd_getfd_refused(pid: int, fd: int = 0) -> bool:
    """Whether copying descriptor `fd` of process `pid` is refused with EPERM here."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    pidfd = libc.syscall(ctypes.c_long(SYS_PIDFD_OPEN), ctypes.c_long(pid), ctypes.c_long(0))
    if pidfd < 0:
        return False
    try:
        got = libc.syscall(ctypes.c_long(SYS_PIDFD_GETFD), ctypes.c_long(pidfd), ctypes.c_long(fd),
                           ctypes.c_long(0))
        if got >= 0:
            import os

            os.close(got)
            return False
        return ctypes.get_errno() == errno.EPERM
    finally:
        import os

        os.close(pidfd)
