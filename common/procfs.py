"""What Linux's /proc says about processes: a process's tree (`tree_pids`), and whether the
socket listening on a TCP port is that tree's (`held_by`).

A launcher picks a free port, then starts a child that binds it seconds later (after its
imports and model load). Meanwhile any other process may bind that port, and a readiness poll
of the URL would take the stranger's 200 for the child's. `held_by(pid, port)` tells them
apart: the listening socket's inode (/proc/net/tcp, tcp6) among the open files of `pid` or
one of its descendants (a wrapper such as `sh -c` forks the server)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"                       # st column of /proc/net/tcp: TCP_LISTEN


def listening_inodes(port: int) -> set[str]:
    """Inodes of the sockets listening on `port`, IPv4 and IPv6, any address."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is ADDR:PORT in hex; inode is the tenth column
            if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant of it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # the command name, in parentheses, may hold spaces: the fields after it count
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets `pid` has open (empty when it is gone or not ours to read)."""
    inodes = set()
    try:
        fds = os.scandir(PROC / str(pid) / "fd")
    except OSError:
        return inodes
    with fds:
        for fd in fds:
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def held_by(pid: int, port: int) -> bool | None:
    """Whether the socket listening on `port` belongs to `pid` or a descendant of it: True,
    False (another process's), or None where /proc cannot tell (not Linux, or no listener in
    this network namespace: a port forwarded elsewhere)."""
    listening = listening_inodes(port)
    if not listening:
        return None
    return any(listening & socket_inodes(p) for p in tree_pids(pid))
