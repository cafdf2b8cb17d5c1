"""The access log: one line per request when it ends, like nginx's `access_log`.

    access_log: {path: /var/log/prefixgate/access.log, format: json}   # or path "-": stdout

The event loop only appends each finished request's fields to a deque (no lock, no wake-up);
a writer thread, waking every FLUSH_S, formats the lines and writes whatever has gathered in
one `write` on an O_APPEND descriptor, so a
line is never split or interleaved and a slow disk never stalls a request. That holds with
several processes appending to one file too (`serve --workers N`, whose lines carry the
writing worker's index as `worker`: the kernel appends each `write` whole); to a pipe or
terminal (`-`), where only writes of up to PIPE_BUF bytes are whole, the lines go in writes
of at most that. SIGUSR1 reopens the file (after logrotate moved it). A write that fails
(disk full) drops lines with a log message a minute, never a request.
"""
from __future__ import annotations

import json
import logging
import os
import select
import stat
import sys
import threading
import time
from collections import deque
from datetime import datetime, timezone

from prefixgate.common.schema import ConfigError, Key, check, one_of

log = logging.getLogger("prefixgate.access")

SPEC = {
    "path": Key(str, "-"),                             # a file, or "-" for stdout
    "format": Key(str, "json", one_of("json", "text")),
}
# every JSON line has every key (null when unknown), in this order
FIELDS = ("ts", "request_id", "client", "key", "method", "path", "model", "stream", "status",
          "upstream", "attempts", "route", "pd", "prefill_upstream", "prefill_leg_ms",
          "moved", "warm", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms",
          "gateway_ms", "queue_ms", "connect_ms", "upstream_ttft_ms", "engine_queue_ms",
          "prefill_ms", "first_decode_ms", "duration_ms", "bytes_out", "error")
_REOPEN, _STOP = object(), object()
WARN_EVERY_S = 60.0
MAX_PENDING = 100_000          # lines waiting for a disk that does not keep up; then dropped
FLUSH_S = 0.05                 # the writer wakes this often (at once for a reopen or a stop)
WRITE_LINES = 4096             # lines in one write, at most


def validate(raw, path: str = "access_log") -> dict | None:
    if raw is None:
        return None
    cfg = check(raw, SPEC, path)
    if cfg["path"] != "-":
        folder = os.path.dirname(os.path.abspath(cfg["path"]))
        if not os.path.isdir(folder):
            raise ConfigError(f"{path}.path", f"folder {folder} does not exist")
        if not os.access(folder, os.W_OK) and not os.access(cfg["path"], os.W_OK):
            raise ConfigError(f"{path}.path", f"cannot write to {cfg['path']}")
    return cfg


class AccessLog:
    def __init__(self, cfg: dict):
        self.path = cfg["path"]
        self.format = text_line if cfg["format"] == "text" else json_line
        # finished requests' fields (and the _REOPEN, _STOP marks), appended by the event
        # loop, taken by the writer thread: a deque's append and popleft need no lock
        self._pending: deque = deque()
        self._wake = threading.Event()
        self._fd = -1
        self._write_limit: int | None = None     # bytes one write keeps whole (None: any)
        self._thread = threading.Thread(target=self._run, name="prefixgate-access-log",
                                        daemon=True)
        self._warned_at = 0.0
        self.dropped = 0
        self._dropped_told = 0

    def start(self) -> None:
        self._fd = self._open()
        self._thread.start()

    def write(self, fields: dict) -> None:
        """Queue one finished request's fields (the keys of FIELDS); never blocks."""
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
        else:
            self._pending.append(fields)

    def reopen(self) -> None:
        """Reopen the file by its name (SIGUSR1, after logrotate moved it): lines queued
        from now on go to the new file."""
        self._pending.append(_REOPEN)
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then close the file (within `timeout_s`: a disk that hangs
        keeps what is queued)."""
        if self._thread.is_alive():
            self._pending.append(_STOP)
            self._wake.set()
            self._thread.join(timeout_s)

    # --- the writer thread -----------------------------------------------------------------
    def _open(self) -> int:
        if self.path == "-":
            fd = sys.stdout.fileno()
        else:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # a file takes each write whole; a pipe or terminal only up to PIPE_BUF bytes
        self._write_limit = None if stat.S_ISREG(os.fstat(fd).st_mode) else select.PIPE_BUF
        return fd

    def _run(self) -> None:
        pending, stop = self._pending, False
        while not stop:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            lines = []
            while pending and not stop:
                item = pending.popleft()
                if item is _STOP:
                    stop = True
                elif item is _REOPEN:
                    self._flush(lines)          # what came before the signal: the old file
                    lines = []
                    self._reopen_file()
                else:
                    lines.append(self.format(item))
                    if len(lines) >= WRITE_LINES:
                        self._flush(lines)
                        lines = []
            self._flush(lines)
            if self.dropped > self._dropped_told:       # the queue overflowed meanwhile
                self._dropped_told = self.dropped
                self._warn_dropped("lines come faster than the file takes them")
        self._close_fd()

    def _flush(self, lines: list[str]) -> None:
        if not lines:
            return
        writes = ([("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")]
                  if self._write_limit is None else whole_lines(lines, self._write_limit))
        try:
            for data in writes:
                while data:
                    data = data[os.write(self._fd, data):]
        except OSError as e:
            self.dropped += len(lines)
            self._dropped_told += len(lines)
            self._warn_dropped(f"write failed ({e.strerror or e})")

    def _warn_dropped(self, why: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("access log %s: %s; %d lines dropped so far", self.path, why,
                        self.dropped)

    def _reopen_file(self) -> None:
        if self.path == "-":
            return
        try:
            fd = self._open()
        except OSError as e:
            log.warning("access log %s: reopen failed (%s); still writing to the old file",
                        self.path, e.strerror or e)
            return
        self._close_fd()
        self._fd = fd

    def _close_fd(self) -> None:
        if self.path != "-":
            os.close(self._fd)


def whole_lines(lines: list[str], limit: int) -> list[bytes]:
    """`lines` in writes of at most `limit` bytes, each of whole lines (a longer line alone)."""
    writes, chunk, size = [], [], 0
    for line in lines:
        data = (line + "\n").encode("utf-8", "backslashreplace")
        if chunk and size + len(data) > limit:
            writes.append(b"".join(chunk))
            chunk, size = [], 0
        chunk.append(data)
        size += len(data)
    if chunk:
        writes.append(b"".join(chunk))
    return writes


def json_line(fields: dict) -> str:
    fields = {**fields, "ts": iso_utc(fields["ts"])}
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":"), default=str)


def text_line(f: dict) -> str:
    """nginx's combined-like line, then key=value pairs:
    `127.0.0.1 - web [01/Dec/2026:20:00:00 +0000] "POST /v1/chat/completions" 200 1234 ...`"""
    ts = datetime.fromtimestamp(f["ts"], timezone.utc).strftime("%d/%b/%Y:%H:%M:%S +0000")
    head = (f'{f["client"] or "-"} - {f["key"] or "-"} [{ts}] "{f["method"]} {f["path"]}" '
            f'{f["status"]} {f["bytes_out"]}')
    pairs = [f"{k}={_text_value(f[k])}" for k in (*FIELDS[6:], "worker")
             if k not in ("status", "bytes_out") and f.get(k) is not None]
    return " ".join([head, f"request_id={f['request_id']}", *pairs])


def _text_value(value) -> str:
    if isinstance(value, str):
        return value if value and not any(c in value for c in ' "=\n') else json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, separators=(",", ":")) if isinstance(value, list) else str(value)


def iso_utc(epoch_s: float) -> str:
    """ISO 8601 UTC with milliseconds: 2026-12-01T20:00:00.123Z"""
    return datetime.fromtimestamp(epoch_s, timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")
