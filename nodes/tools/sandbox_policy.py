"""What the python tool's sandbox may do: bubblewrap's arguments, the resource limits and the seccomp
deny list, kept apart from the running of it (`python_sandbox`) so the whole policy reads in one place.

Memory is bounded as a whole without a cgroup (none can be made on machines whose cgroups belong to
their host): every process has an address-space limit and a sandbox has its own process budget (a
user id of its own), the root and /dev are read-only, the only writable place is a size-capped /tmp,
and what would put memory outside those limits (memfd, SysV and POSIX shared memory, message queues)
is denied by the seccomp filter. The bound is MAX_PROCESSES x MEMORY_BYTES + TMP_BYTES.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import resource
import shutil
import subprocess
import tempfile

BWRAP = "bwrap"
BWRAP_MIN = (0, 8, 0)  # --disable-userns
INSTALL = "apt-get install bubblewrap"
MEMORY_BYTES = 256 * 2**20  # address space of each process
MAX_PROCESSES = 8  # per sandbox, bwrap's own and threads included
TMP_BYTES = 16 * 2**20  # /tmp, its only writable place (also the largest file)
MAX_FILES = 64  # open file descriptors per process
MAX_CODE = 2**20  # bytes of a program
UID_BASE = 1_000_000_000  # run as root: each sandbox runs as UID_BASE + bwrap's pid (its own process budget)
CODE_PATH = "/run/main.py"
DEVICES = ("null", "zero", "full", "random", "urandom")  # no ptmx, no pts, no shm

# Kernel surfaces that Python code rarely needs, and ways out of the limits above; each answers EPERM.
DENIED = (
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "memfd_create", "memfd_secret", "shmget", "shmat", "msgget", "mq_open",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "syslog", "quotactl", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
    "uselib", "vhangup", "iopl", "ioperm", "modify_ldt", "fanotify_init", "settimeofday", "clock_settime",
)
NEW_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK (inside its own network namespace)


def missing() -> str | None:
    """None when the sandbox can run here, else why not and how to install what is missing."""
    if shutil.which(BWRAP) is None:
        return f"bubblewrap (bwrap) is not installed; install it with: {INSTALL}"
    version = bwrap_version()
    if version < BWRAP_MIN:
        return (f"bubblewrap {'.'.join(map(str, version))} is older than {'.'.join(map(str, BWRAP_MIN))} "
                f"(needed for --disable-userns); upgrade it with: {INSTALL}")
    if python() is None:
        return "no system Python 3 under /usr for the sandbox; install it with: apt-get install python3"
    try:
        seccomp_filter()
    except Exception as exc:  # noqa: BLE001 - pyseccomp or libseccomp missing or broken
        return f"no seccomp filter ({exc}); install libseccomp2 (apt-get install libseccomp2) and pyseccomp"
    return None


@functools.cache
def bwrap_version() -> tuple[int, ...]:
    try:
        out = subprocess.run([BWRAP, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return (0,)
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(map(int, found.groups())) if found else (0,)


def python() -> str | None:
    return next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)


@functools.cache
def seccomp_filter() -> bytes:
    """The deny list as a BPF program for bwrap's --seccomp (default: allow; other architectures: killed)."""
    import pyseccomp as sc

    native = sc.system_arch()
    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        if sc.resolve_syscall(native, name) != -1:  # a name this libseccomp knows
            f.add_rule(deny, name)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags cannot be read by a filter: libc falls back to clone
    for flag in NEW_NAMESPACES:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    f.add_rule(no_family, "socket", sc.Arg(0, sc.GT, max(SOCKET_FAMILIES)))
    for family in set(range(max(SOCKET_FAMILIES))) - set(SOCKET_FAMILIES):
        f.add_rule(no_family, "socket", sc.Arg(0, sc.EQ, family))
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        return fh.read()


def memfd(name: str, data: bytes) -> int:
    """A file descriptor (at offset 0, close-on-exec: only `pass_fds` hands it on) that holds `data`: how
    bwrap reads the program and the filter."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def command(code_fd: int, seccomp_fd: int) -> list[str]:
    """bwrap's argument list: the program comes from `code_fd` as a read-only file, not on argv."""
    devices = [arg for name in DEVICES for arg in ("--dev-bind", f"/dev/{name}", f"/dev/{name}")]
    return [BWRAP, "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dir", "/dev", *devices,
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp", "--ro-bind-data", str(code_fd), CODE_PATH,
            "--remount-ro", "/", "--seccomp", str(seccomp_fd), "--chdir", "/tmp", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            python(), "-I", "-S", "-u", CODE_PATH]


def limit(timeout_s: float) -> None:
    """In the child, before bwrap starts: become the sandbox's own unprivileged user (root: a user id of
    its own, so its process budget is its own) and set the limits every process inside inherits."""
    own = 0
    if os.getuid() == 0:
        uid = UID_BASE + os.getpid()  # unique while this sandbox lives
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:  # not root: the user's process budget, shared with its other processes and sandboxes
        own = sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == os.getuid())
    cpu = int(timeout_s) + 1
    for which, value in ((resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, TMP_BYTES), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NOFILE, MAX_FILES), (resource.RLIMIT_MEMLOCK, 0),
                         (resource.RLIMIT_MSGQUEUE, 0), (resource.RLIMIT_NPROC, own + MAX_PROCESSES)):
        resource.setrlimit(which, (value, value))


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
