"""Responses API ids that carry their upstream, so any gateway replica routes a follow-up.

vLLM (and other servers) keep a response in the memory of the server that created it; its
reads (`GET /v1/responses/{id}`), `/cancel` and follow-ups (`previous_response_id`) must go
back there. Instead of a table in one replica, the id the client sees says where:

    resp_pg<tag><mac>_<the upstream's own id>

`tag` names the upstream (8 hex digits of the xxh64 of its name: replicas configured with
the same upstream names agree), `mac` is 16 hex digits of HMAC-SHA256 over tag and id under
`responses.id_secret`, so a client cannot steer a request to an upstream the id was not
issued by, and an id that was forged, or issued under another secret, or whose upstream has
left the fleet, is a clear 404. The upstream only ever sees its own ids. Ids without the
`resp_pg` head (issued before this gateway, or by a server reached directly) pass through
unchanged and are routed by model, as any request.

Gateway replicas must share `id_secret`; without one each process draws its own at start-up
(a single replica needs nothing).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets

import xxhash

from prefixgate.common import sse
from prefixgate.common.errors import HTTPError
from prefixgate.common.schema import Key, check

PREFIX = "resp_pg"
TAG_HEX, MAC_HEX = 8, 16
_WRAPPED = re.compile(rf"{PREFIX}([0-9a-f]{{{TAG_HEX}}})([0-9a-f]{{{MAC_HEX}}})_(.+)", re.S)

SPEC = {
    "id_secret": Key((str, type(None)), None,
                     lambda v: None if len(v) >= 16 else "must be at least 16 characters"),
}


def validate(raw) -> dict:
    return check(raw, SPEC, "responses")


def tag_of(upstream: str) -> str:
    return f"{xxhash.xxh64_intdigest(upstream.encode()) & 0xFFFFFFFF:08x}"


class ResponseIds:
    def __init__(self, cfg: dict):
        secret = cfg["id_secret"]
        self.key = secret.encode() if secret is not None else secrets.token_bytes(32)

    def _mac(self, tag: str, upstream_id: str) -> str:
        mac = hmac.new(self.key, f"{tag}\0{upstream_id}".encode(), hashlib.sha256)
        return mac.hexdigest()[:MAC_HEX]

    def wrap(self, upstream: str, upstream_id: str) -> str:
        """The id the client sees for `upstream`'s response `upstream_id`."""
        tag = tag_of(upstream)
        return f"{PREFIX}{tag}{self._mac(tag, upstream_id)}_{upstream_id}"

    def unwrap(self, client_id: str, upstreams) -> tuple[str, str] | None:
        """(upstream name, its own id) of an id this fleet issued; None for an id without the
        `resp_pg` head; HTTPError 404 for one that fails its check or names no upstream here."""
        m = _WRAPPED.fullmatch(client_id)
        if m is None:
            if client_id.startswith(PREFIX):
                raise not_found(client_id)
            return None
        tag, mac, upstream_id = m.groups()
        if not hmac.compare_digest(mac, self._mac(tag, upstream_id)):
            raise not_found(client_id)
        name = next((u.name for u in upstreams if tag_of(u.name) == tag), None)
        if name is None:
            raise not_found(client_id, "its upstream is no longer in this gateway's fleet")
        return name, upstream_id


def not_found(client_id: str, why: str = "not issued by this gateway fleet") -> HTTPError:
    return HTTPError(404, f"Response with id {client_id[:200]!r} not found ({why}).",
                     code="response_not_found")


class Rewriter(sse.EventRewriter):
    """The answer rewriter (proxy/rewrite.py) of the Responses API: the client's ids in place
    of the upstream's in one answer — its own id (learned from the answer) and the id it
    continued (`previous_response_id`, known from the request)."""

    def __init__(self, ids: ResponseIds, upstream: str, previous: tuple[str, str] | None):
        super().__init__()
        self.ids, self.upstream = ids, upstream
        self.swaps: list[tuple[bytes, bytes]] = []       # (quoted upstream id, quoted client's)
        if previous is not None:
            self._swap(previous[1], previous[0])
        self.own_known = False                  # the answer's own id is among the swaps

    def _swap(self, upstream_id: str, client_id: str) -> None:
        self.swaps.append((json.dumps(upstream_id).encode(), json.dumps(client_id).encode()))

    def learn(self, upstream_id) -> None:
        """The answer's own id, as the upstream named it."""
        if isinstance(upstream_id, str) and not self.own_known:
            self.own_known = True
            self._swap(upstream_id, self.ids.wrap(self.upstream, upstream_id))

    def whole(self, answer: dict) -> dict:
        """A whole answer (a response object) with the client's ids."""
        if isinstance(answer, dict):
            self.learn(answer.get("id"))
            for field in ("id", "previous_response_id"):
                if isinstance(answer.get(field), str):
                    answer[field] = self._client(answer[field])
        return answer

    def _client(self, upstream_id: str) -> str:
        quoted = json.dumps(upstream_id).encode()
        return next((json.loads(c) for up, c in self.swaps if up == quoted), upstream_id)

    def event(self, raw: bytes) -> bytes:
        """One streamed event, ids swapped (whole events only: an id split between reads is
        still found)."""
        if not self.own_known:
            m = _STREAM_ID.search(raw)
            if m is not None:
                self.learn(json.loads(b'"' + m.group(1) + b'"'))
        for up, client in self.swaps:
            raw = raw.replace(up, client)
        return raw


# the response object's id in a Responses API stream (`response.created` comes first)
_STREAM_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')
