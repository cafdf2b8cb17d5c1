"""Which process listens on a TCP port, read from Linux's /proc.

A launcher picks a free port, then starts a child that binds it seconds later (after its
imports and model load). Meanwhile any other process may bind that port, and a readiness poll
of the URL would take the stranger's 200 for the child's. `held_by(pid, port)` tells them
apart: the listening socket's inode (/proc/net/tcp, tcp6) among the open files of `pid` or
one of its descendants (a wrapper such as `sh -c` forks the server)."""
from __future__ import annotations

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


def family(pid: int) -> list[int]:
    """`pid` and its descendants that /proc shows (threads' children included)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in (PROC / str(p) / "task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass                # gone meanwhile, or a kernel without the file
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
    return any(listening & socket_inodes(p) for p in family(pid))
