"""The engine: requests in, per-request token/text deltas out.

`LLMEngine` is synchronous: `step()` applies queued adds and aborts, schedules, runs the
model, samples, detokenizes and checks stop strings. `AsyncEngine` (backend/async_engine.py)
drives it from asyncio, one step at a time on one worker thread.

With `--kv-events-config` the block manager and the second tier record KV events into one sink,
and the engine hands them to the publisher (backend/kv_events.py) as one batch after every step
that produced any, and after block manager work run between steps (`run_between_steps`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from prefixgate.backend import kv_tier
from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.config import (
    EngineArgs,
    check_cache_pin_fraction,
    check_kv_offloading,
    resolve_model,
    resolve_tokenizer,
    served_name,
)
from prefixgate.backend.cpu_linear import prepare_for_inference
from prefixgate.backend.kv_events import KVEventPublisher, KVEventSink
from prefixgate.backend.model_runner import (
    KV_CACHE_DTYPES,
    ModelRunner,
    kv_block_bytes,
    parse_bytes,
)
from prefixgate.backend.sampling import SamplingParams, find_stop_string
from prefixgate.backend.scheduler import Scheduler, SchedulerConfig
from prefixgate.backend.sequence import Sequence
from prefixgate.backend.spec_decode import Speculator
from prefixgate.backend.warmup import WarmupReport, warm_up
from prefixgate.common.block_hash import ROOT_HASH
from prefixgate.common.schema import ConfigError

log = logging.getLogger("prefixgate.engine")

DEFAULT_CPU_KV_MEMORY = 1 << 30          # 1 GiB of KV cache on CPU unless told otherwise
CUDA_MEMORY_FRACTION = 0.85              # of the memory left free after loading the weights


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]              # new this step
    text: str                         # new this step
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # prompt tokens computed inside a cache_control breakpoint's prefix (vLLM's
    # created_cache_tokens); None: the request has no breakpoint
    created_cache_tokens: int | None
    # the request's time.monotonic() stamps (as vLLM's): reaching the engine (add_request,
    # after tokenization), first scheduled, first token sampled, this output's token sampled
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None


@dataclass
class _Request:
    seq: Sequence
    decoder: object
    text: str = ""
    sent: int = 0                     # characters of `text` already emitted
    token_ids: list[int] = field(default_factory=list)
    # for a sequence arriving with its KV: writes it, on the engine thread
    fill: object = None


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from prefixgate.backend.loader import load_model, serving_dtype
        from prefixgate.common.tokenizer import IncrementalDecoder, Tokenizer

        self.args = args
        # its steps belong on this thread: on a CPU, stepped on another, every parallel loop
        # waits for a wake-up (backend/async_engine.py says why); step() warns once
        self.built_on = threading.get_ident()
        self._warned_of_thread = False
        check_kv_offloading(args.kv_offloading_size, args.kv_offloading_path,
                            args.enable_prefix_caching)
        check_cache_pin_fraction(args.cache_pin_fraction)
        self.model_dir = resolve_model(args.model)     # a directory, or a .gguf file
        self.device = torch.device(args.device if args.device != "auto" else
                                   "cuda" if torch.cuda.is_available() else "cpu")
        dtype = serving_dtype(args.dtype, self.device)
        self.model, self.model_config = load_model(self.model_dir, dtype=dtype,
                                                   device=self.device,
                                                   load_format=args.load_format)
        self.packed_linears = prepare_for_inference(self.model)
        self.tokenizer = Tokenizer.load(resolve_tokenizer(args.tokenizer) if args.tokenizer
                                        else self.model_dir)
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ConfigError("--tokenizer", f"{self.tokenizer.vocab_size} tokens, more than "
                              f"the model's {self.model_config.vocab_size} embeddings")
        self._decoder_cls = IncrementalDecoder
        self.served_model_name = args.served_model_name or served_name(args.model)
        kv_dtype = self._kv_dtype()
        num_blocks = self._num_blocks(kv_dtype)
        self.max_model_len = min(self.model_config.max_position_embeddings,
                                 num_blocks * args.block_size, args.max_model_len or 1 << 62)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching,
                                          pin_fraction=args.cache_pin_fraction)
        eos = set(self.tokenizer.eos_token_ids) | _config_eos(self.model_config)
        config = self._scheduler_config()
        self.speculator = Speculator(args.speculative_config) if args.speculative_config else None
        self.scheduler = Scheduler(config, self.block_manager, eos, self.speculator)
        self.runner = ModelRunner(self.model, self.model_config, block_size=args.block_size,
                                  num_blocks=num_blocks, kv_cache_dtype=kv_dtype,
                                  attention_backend=args.attention_backend,
                                  use_cuda_graphs=not args.enforce_eager,
                                  max_num_seqs=args.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  kv_mantissa_bits=args.debug_kv_mantissa_bits)
        self.kv_tier = self.block_manager.tier = self._kv_tier()
        self.requests: dict[str, _Request] = {}
        self._adds: deque[_Request] = deque()      # filled by the event loop, drained by step()
        self._aborts: deque[str] = deque()
        self._releases: deque[str] = deque()       # transfer ids whose held KV blocks to free
        # last: nothing after it can fail and leave it bound
        self.kv_events = self._kv_events()
        log.info("engine ready: %s on %s (weights: %s), %d KV blocks of %d tokens, "
                 "max_model_len %d",
                 self.model_dir, self.device, args.load_format, num_blocks, args.block_size,
                 self.max_model_len)

    def _kv_tier(self) -> kv_tier.KVTier | None:
        a = self.args
        if not a.kv_offloading_size:
            return None
        return kv_tier.KVTier(self.runner.kv_caches, a.block_size, a.kv_offloading_size,
                              a.kv_offloading_path)

    def _kv_events(self) -> KVEventPublisher | None:
        """The publisher `--kv-events-config` asks for, its sink given to the block manager and
        the tier; None when events are off."""
        config = self.args.kv_events_config
        if config is None or not config.publishes:
            return None
        if not self.args.enable_prefix_caching:
            log.warning("--kv-events-config: with --no-prefix-caching no block is ever cached: "
                        "no KV event will be published")
        try:
            publisher = KVEventPublisher(config)
        except ConfigError as e:       # the endpoint cannot be bound (in use, ...)
            raise ConfigError("--kv-events-config", str(e)) from None
        self.block_manager.events = KVEventSink(self.args.block_size, ROOT_HASH)
        if self.kv_tier is not None:
            self.kv_tier.events = self.block_manager.events
        return publisher

    def close(self) -> None:
        """Let the second KV tier go (waits for its queued stores) and close the KV event
        publisher (what is queued is sent first); the engine then runs without them."""
        self.publish_kv_events()
        tier, self.kv_tier = self.kv_tier, None
        self.block_manager.tier = None
        if tier is not None:
            tier.close()
        publisher, self.kv_events = self.kv_events, None
        self.block_manager.events = None
        if publisher is not None:
            publisher.close()

    def _kv_dtype(self) -> torch.dtype:
        name = self.args.kv_cache_dtype
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {name!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
        return KV_CACHE_DTYPES[name] or next(self.model.parameters()).dtype

    def _scheduler_config(self) -> SchedulerConfig:
        a = self.args
        cuda = self.device.type == "cuda"
        budget = a.max_num_batched_tokens or (2048 if cuda else 512)
        overhead = a.step_overhead_tokens
        if overhead is None:    # a CPU step's fixed cost (weights streamed once, Python) is
            overhead = 0 if cuda else 32    # ~30 tokens of compute, whatever the model's size
        return SchedulerConfig(max_model_len=self.max_model_len, max_num_seqs=a.max_num_seqs,
                               max_num_batched_tokens=budget,
                               enable_chunked_prefill=a.enable_chunked_prefill,
                               long_prefill_token_threshold=a.long_prefill_token_threshold,
                               step_overhead_tokens=overhead)

    def _num_blocks(self, kv_dtype: torch.dtype) -> int:
        a = self.args
        if a.num_kv_blocks is not None:
            return int(a.num_kv_blocks)
        per_block = kv_block_bytes(self.model_config, a.block_size, kv_dtype)
        if a.kv_cache_memory is not None:
            budget = parse_bytes(a.kv_cache_memory)
        elif self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * CUDA_MEMORY_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_MEMORY
        if budget < per_block:
            raise ValueError(f"KV cache budget of {budget} bytes is less than one block "
                             f"({per_block} bytes)")
        return budget // per_block

    # --- called from the event loop thread --------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, kv_hold: str | None = None,
                    cache_salt: str | None = None, cache_pins=()) -> None:
        """Queue a request; its arrival is now unless given (a time.monotonic() stamp). With
        `kv_hold` (a transfer id) its blocks are held when it ends, for a decode engine's pull;
        `cache_salt` and `cache_pins` (prompt tokens, ttl seconds) as Sequence takes them."""
        seq = Sequence(prompt_ids, params, request_id, arrival_time, cache_salt, cache_pins)
        seq.kv_hold = kv_hold
        self._adds.append(_Request(seq, self._decoder_cls(self.tokenizer)))

    def add_prefilled(self, seq: Sequence, fill) -> None:
        """Queue a sequence whose blocks are allocated and whose prompt KV `fill()` writes
        (between steps, on the engine thread); it is then scheduled as a decode."""
        self._adds.append(_Request(seq, self._decoder_cls(self.tokenizer), fill=fill))

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def release_kv(self, transfer_id: str) -> None:
        """Free the blocks held for a KV transfer (pulled, or timed out)."""
        self._releases.append(transfer_id)

    def has_work(self) -> bool:
        return bool(self._adds or self._aborts or self._releases or self.scheduler.has_unfinished())

    def stats(self) -> dict:
        s, bm = self.scheduler, self.block_manager
        return {"running": len(s.running), "waiting": len(s.waiting) + len(self._adds),
                "kv_cache_usage": bm.usage(), "prefix_queries": bm.prefix_queries,
                "prefix_hits": bm.prefix_hits, "preemptions": s.num_preemptions,
                "kv_held_blocks": s.num_held_blocks, **bm.pin_stats(), **self._kv_tier_stats(),
                **self._kv_events_stats()}

    def _kv_events_stats(self) -> dict:
        """The KV event publisher's counters; none when it is off."""
        if self.kv_events is None:
            return {}
        t = self.kv_events.stats
        return {"kv_events_published_batches": t.published_batches,
                "kv_events_published_events": t.published_events,
                "kv_events_dropped_batches": t.dropped_batches}

    def _kv_tier_stats(self) -> dict:
        """The second KV tier's counters and usage; none when it is off."""
        tier = self.kv_tier
        if tier is None:
            return {}
        t = tier.stats
        return {"kv_offload_usage": tier.usage(), "kv_offload_stored_blocks": t.stored_blocks,
                "kv_offload_loaded_blocks": t.loaded_blocks, "kv_offload_hit_tokens": t.hit_tokens,
                "kv_offload_corrupted_blocks": t.corrupted_blocks}

    def spec_stats(self) -> dict | None:
        """Speculative decoding's counters (vLLM's), or None when it is off."""
        sp = self.speculator
        if sp is None:
            return None
        return {"num_drafts": sp.num_drafts, "num_draft_tokens": sp.num_draft_tokens,
                "num_accepted_tokens": sp.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(sp.accepted_per_pos)}

    # --- called from the worker thread -------------------------------------------------------

    def warm_up(self) -> WarmupReport:
        """Run every batch shape once before serving, leaving no trace (backend/warmup.py)."""
        return warm_up(self)

    def step(self) -> list[RequestOutput]:
        if not self._warned_of_thread and threading.get_ident() != self.built_on:
            self._warn_of_thread()
        try:
            self._apply_queued()
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            started = time.perf_counter()
            sampled = self.runner.run(batch)    # returns host lists: the device has finished
            if self.speculator is not None and batch.is_decoding:
                self.speculator.cost.observe(batch.num_tokens, time.perf_counter() - started)
            return [self._output(seq, n) for seq, n in self.scheduler.update(batch, sampled)]
        finally:    # even after a failed forward: what was cached and evicted stays so
            self.publish_kv_events()

    def _warn_of_thread(self) -> None:
        self._warned_of_thread = True
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            log.warning("the engine steps on a thread other than the one that built it: on a CPU "
                        "each of its parallel loops then waits for a wake-up and steps are slower "
                        "(up to 1.8x on two cores); build it on the thread that steps it")

    def run_between_steps(self, fn, *args):
        """`fn(*args)` on the engine thread between steps (block manager work, such as a KV
        pull's reservation); the KV events it causes are published at once."""
        try:
            return fn(*args)
        finally:
            self.publish_kv_events()

    def publish_kv_events(self) -> None:
        """Hand the KV events recorded since the last call to the publisher, as one batch."""
        sink = self.block_manager.events
        if self.kv_events is not None and sink is not None and sink.events:
            self.kv_events.publish(sink.take())

    def _apply_queued(self) -> None:
        while self._adds:
            req = self._adds.popleft()
            self.requests[req.seq.request_id] = req
            if req.fill is None:
                self.scheduler.add(req.seq)
            else:
                req.fill()
                req.fill = None
                self.scheduler.add_prefilled(req.seq)
        while self._aborts:
            req = self.requests.pop(self._aborts.popleft(), None)
            if req is not None:
                self.scheduler.finish(req.seq, "abort")
        while self._releases:
            self.scheduler.release(self._releases.popleft())

    def _output(self, seq: Sequence, num_new: int) -> RequestOutput:
        """The step's output for `seq`, which got `num_new` tokens (several: an accepted draft)."""
        req = self.requests[seq.request_id]
        stop = seq.params.stop
        longest = max(map(len, stop), default=0)
        new = seq.token_ids[len(seq) - num_new:]
        for i, token in enumerate(new):
            req.token_ids.append(token)
            checked = len(req.text)
            req.text += req.decoder.push(token)
            if seq.is_finished and i == num_new - 1:
                req.text += req.decoder.flush()
            # Search only where a stop string could newly end (it may straddle older text).
            cut = find_stop_string(req.text, stop, max(0, checked - longest + 1)) if stop else -1
            if cut != -1:
                req.text = req.text[:cut]
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                seq.drop_last_tokens(num_new - i - 1)
                break
        if seq.is_finished:
            end = len(req.text)
            del self.requests[seq.request_id]
        else:   # hold back text that might be the start of a stop string
            end = max(req.sent, len(req.text) - max(longest - 1, 0))
        delta, req.sent = req.text[req.sent:end], end
        new_ids, req.token_ids = req.token_ids, []
        return RequestOutput(seq.request_id, new_ids, delta, seq.is_finished, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens,
                             seq.created_cache_tokens, seq.arrival_time,
                             seq.first_scheduled_time, seq.first_token_time, seq.last_token_time)


def _config_eos(config) -> set[int]:
    eos = config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}
