"""An agent program's keeper: `python -I -S subreaper.py SAID PROGRAM ARG...` runs PROGRAM and, once it has
exited, kills whatever it left running, however that left it: a job in the background, a command in a
session of its own, a daemon that cleared its environment on the way. This process is a child subreaper
(prctl PR_SET_CHILD_SUBREAPER): every process orphaned below it is handed to it rather than to init, so
what is left is exactly its children, and theirs as each is killed. Then the size of stdout when
PROGRAM exited (what it said, before a leftover could write more) goes to the file SAID, which so says
that nothing is left. SIGUSR2 (the episode late) kills PROGRAM at once, and the rest as above; SIGTERM,
SIGINT, SIGHUP and SIGQUIT are ignored (a program's `kill 0` reaches its whole process group, this
process too), and are the program's defaults again. It ends as PROGRAM did: its exit status, or the
signal that killed it. Standard library only: it runs isolated from the run's and the user's paths.
It keeps what a program leaves, not a program that turns on it: one that kills or stops its keeper
(`kill -9 $PPID`) leaves the rest to the mark its environment carries.
"""

import ctypes
import os
import resource
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36
LATE = signal.SIGUSR2  # the episode is late: kill the program now
# not this process's to obey: a program's `kill 0` (its whole group), a terminal's; the program's own again
IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def children(me: int) -> list[int]:
    """The pids of `me`'s children (read from /proc: the kernel's own list is not always built in)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(b")", 1)[1].split()[1]) == me:
                found.append(int(name))
    return found


def stop(pid: int) -> bool:
    """SIGKILL `pid`; False where it cannot be (gone, or another user's: a program run with sudo)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_all_left(me: int) -> None:
    """Kill the children until none that can be is left: one killed hands its own children over as it dies
    (another user's are left to init). Each pass reaps all that died, so a thousand leftovers take a few
    passes, not a thousand."""
    killed: set[int] = set()
    while left := [pid for pid in children(me) if pid in killed or stop(pid)]:
        killed.update(left)
        killed.discard(os.waitpid(-1, 0)[0])  # one of those killed, or one that ended meanwhile
        while True:
            try:
                pid = os.waitpid(-1, os.WNOHANG)[0]
            except ChildProcessError:
                return
            if not pid:
                break
            killed.discard(pid)


def main(said: str, argv: list[str]) -> None:
    me = os.getpid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"{argv[0]}: not run: cannot adopt what it would leave (prctl: {os.strerror(ctypes.get_errno())})")
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    try:  # as a shell would start it: the signals ignored here (and by Python) are the program's default
        program = os.posix_spawnp(argv[0], argv, os.environ,
                                  setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, LATE, *IGNORED))
    except OSError as e:
        print(f"{argv[0]}: {e.strerror}", file=sys.stderr)
        sys.exit(126 if isinstance(e, PermissionError) else 127)
    signal.signal(LATE, lambda *_: stop(program))  # the program's exit then ends the wait
    while True:  # reaping what is orphaned meanwhile
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            break
    size = os.fstat(1).st_size
    signal.signal(LATE, signal.SIG_IGN)  # what is left is being killed already
    kill_all_left(me)
    try:
        with open(said, "w") as f:  # last: the file says that nothing is left
            f.write(str(size))
    except OSError:  # the episode's folder gone: nobody waits for it
        pass
    if os.WIFSIGNALED(status):  # killed: so is this process, by the same signal (and without a core)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.WTERMSIG(status) != signal.SIGKILL:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(me, os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
