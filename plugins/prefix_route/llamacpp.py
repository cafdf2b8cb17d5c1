"""llama.cpp slot pinning (`llamacpp_slots`): llama.cpp's server keeps one prompt cache per
slot, so a prefix family is pinned to a slot (`id_slot`, the same on every server, from the
prefix key's ring position) and the server is asked to reuse that slot's cache
(`cache_prompt`). Works with either policy: the upstream is chosen by the scorer, the slot
within it here."""
from __future__ import annotations

from prefixgate.plugins.prefix_route.keys import PrefixKeys, ring_position


class SlotPinning:
    def __init__(self, keys: PrefixKeys, slots: int):
        self.keys = keys
        self.slots = slots              # slots per llama.cpp server

    def pin(self, ctx) -> None:
        """Set the request's `id_slot` and `cache_prompt` (unless the client chose a slot)."""
        if "id_slot" in ctx.body:
            return
        key = self.keys.route_key(self.keys.of(ctx))
        if key is None:
            return
        ctx.body["id_slot"] = ring_position(key, ctx.model) % self.slots
        ctx.body["cache_prompt"] = True
        ctx.body_changed = True
