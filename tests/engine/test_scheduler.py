"""Scheduler: decode-first batching, chunked prefill, preemption by recompute, stop, abort.

A stand-in "model" samples the token `len(seq) % 97` (deterministic in the sequence's own
history, as greedy decoding is), so recompute after preemption must reproduce the same stream.
"""
from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.scheduler import Scheduler, SchedulerConfig
from prefixgate.backend.sequence import Sequence, SequenceStatus

BS = 4


def make(num_blocks=64, eos=(), **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", num_blocks * BS)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, BS), set(eos))


def seq(n: int, max_tokens=4, start=0, **kw) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, **kw))


def step(s: Scheduler):
    batch = s.schedule()
    if batch is None:
        return None
    tokens = [[len(q) % 97] if batch.samples(i) else [] for i, q in enumerate(batch.seqs)]
    s.update(batch, tokens)
    return batch


def run(s: Scheduler, limit=1000) -> int:
    steps = 0
    while s.has_unfinished():
        assert step(s) is not None, "scheduler stalled with work left"
        steps += 1
        assert steps < limit
    return steps


def expected_output(q: Sequence) -> list[int]:
    return [(q.num_prompt_tokens + i) % 97 for i in range(q.params.max_tokens)]


def test_single_sequence_prefill_then_decode():
    s = make()
    q = seq(10, max_tokens=3)
    s.add(q)
    first = step(s)
    assert first.num_new_tokens == [10] and not first.is_decode
    assert step(s).is_decode
    run(s)
    assert q.output_token_ids == expected_output(q) and q.finish_reason == "length"
    assert s.bm.usage() == 0.0


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    s = make(max_num_batched_tokens=16)
    q = seq(40, max_tokens=2)
    s.add(q)
    sizes = []
    while q.num_output_tokens == 0:
        sizes.append(step(s).num_tokens)
    assert sizes == [16, 16, 8]
    run(s)
    assert q.output_token_ids == expected_output(q)


def test_short_prompts_are_not_held_up_by_a_long_one():
    s = make(num_blocks=256, max_num_batched_tokens=32)
    long = seq(400, max_tokens=1)
    shorts = [seq(5, start=1000 + 10 * i, max_tokens=1) for i in range(4)]
    for q in [long, *shorts]:
        s.add(q)
    batch = step(s)
    assert set(batch.seqs) == {long, *shorts}
    assert batch.num_tokens == 32                       # leftover budget went to the long prompt
    assert all(q.is_finished for q in shorts) and not long.is_finished


def test_without_chunking_prompts_are_taken_whole():
    s = make(num_blocks=256, max_num_batched_tokens=32, enable_chunked_prefill=False)
    long = seq(400, max_tokens=1)
    short = seq(5, start=1000, max_tokens=1)
    s.add(long)
    s.add(short)
    batch = step(s)
    assert batch.seqs == [long] and batch.num_new_tokens == [400]   # oversize: runs alone
    assert step(s).seqs == [short]


def test_decodes_come_first_and_max_num_seqs_caps_the_batch():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = seq(6, max_tokens=5), seq(6, start=100, max_tokens=5), seq(6, start=200, max_tokens=5)
    for q in (a, b, c):
        s.add(q)
    assert step(s).seqs == [a, b]                       # c waits for a free slot
    batch = step(s)
    assert batch.seqs == [a, b] and batch.is_decode
    run(s)
    for q in (a, b, c):
        assert q.output_token_ids == expected_output(q)


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=8, max_num_batched_tokens=64)    # 32 slots; each sequence grows to 20
    qs = [seq(10, start=100 * i, max_tokens=10) for i in range(3)]
    for q in qs:
        s.add(q)
    run(s)
    assert s.num_preemptions > 0
    for q in qs:
        assert q.output_token_ids == expected_output(q)
    assert s.bm.usage() == 0.0


def test_stop_on_eos_unless_ignored():
    s = make(eos={12})
    stopped, ignored = seq(11, max_tokens=5), seq(11, start=500, max_tokens=5, ignore_eos=True)
    # len 11 -> samples 11, then len 12 -> samples 12 == eos
    s.add(stopped)
    s.add(ignored)
    run(s)
    assert stopped.output_token_ids == [11, 12] and stopped.finish_reason == "stop"
    assert ignored.num_output_tokens == 5 and ignored.finish_reason == "length"


def test_stop_token_ids_and_max_model_len():
    s = make(max_model_len=14)
    a = seq(10, max_tokens=50, stop_token_ids=[11])
    b = seq(10, start=300, max_tokens=50)
    s.add(a)
    s.add(b)
    run(s)
    assert a.output_token_ids == [10, 11] and a.finish_reason == "stop"
    assert len(b) == 14 and b.finish_reason == "length"


def test_abort_frees_blocks_waiting_or_running():
    s = make(max_num_seqs=1)
    a, b = seq(10, max_tokens=100), seq(10, start=100, max_tokens=100)
    s.add(a)
    s.add(b)
    step(s)
    assert a.status is SequenceStatus.RUNNING and s.bm.usage() > 0
    s.finish(b, "abort")                                 # still waiting
    s.finish(a, "abort")
    assert not s.has_unfinished() and s.bm.usage() == 0.0
    assert a.finish_reason == b.finish_reason == "abort"


def test_prefix_cache_hit_skips_computed_blocks():
    s = make(max_num_batched_tokens=64)
    first = seq(20, max_tokens=1)
    s.add(first)
    run(s)
    again = Sequence(list(range(16)) + [77, 78], SamplingParams(max_tokens=1))
    s.add(again)
    batch = step(s)
    assert batch.num_new_tokens == [2] and again.num_cached_tokens == 16
    assert s.bm.prefix_hits == 16


def first_token_steps(s: Scheduler, seqs: list[Sequence]) -> list[int]:
    """The step (1-based) in which each sequence got its first token."""
    at = {}
    n = 0
    while len(at) < len(seqs):
        step(s)
        n += 1
        at.update({q: n for q in seqs if q.num_output_tokens and q not in at})
    return [at[q] for q in seqs]


def test_equal_prompts_finish_one_after_another_not_all_late():
    s = make(num_blocks=256, max_num_batched_tokens=32)  # 8 tokens guaranteed to the oldest
    qs = [seq(40, start=100 * i, max_tokens=1) for i in range(4)]
    for q in qs:
        s.add(q)
    # sharing every step out evenly (8 tokens each) would finish all four in step 5
    assert first_token_steps(s, qs) == [2, 3, 4, 5]


def test_a_cache_hit_is_not_held_up_behind_a_cold_prompt():
    s = make(num_blocks=256, max_num_batched_tokens=32)
    warm = seq(80, max_tokens=1)
    s.add(warm)
    run(s)
    cold = seq(200, start=1000, max_tokens=1)
    hit = Sequence(list(range(64)) + list(range(500, 516)), SamplingParams(max_tokens=1))
    s.add(cold)
    s.add(hit)                  # 64 of its 80 tokens are cached: 16 left, the cold one 200
    batch = step(s)
    assert hit.num_output_tokens == 1 and hit.num_cached_tokens == 64
    assert dict(zip(batch.seqs, batch.num_new_tokens)) == {cold: 16, hit: 16}
    assert first_token_steps(s, [cold])[0] > 1


def test_the_oldest_prefill_keeps_moving_under_a_stream_of_short_prompts():
    s = make(num_blocks=512, max_num_batched_tokens=32)
    long = seq(100, max_tokens=1)
    s.add(long)
    for i in range(40):         # more short work than the budget every step
        s.add(seq(12, start=1000 + 20 * i, max_tokens=1))
        s.add(seq(12, start=2000 + 20 * i, max_tokens=1))
        s.add(seq(12, start=3000 + 20 * i, max_tokens=1))
        step(s)
        if long.num_output_tokens:
            break
    assert long.num_output_tokens == 1 and i < 14       # 8 tokens a step at least: 13 steps


def test_where_tokens_cost_alike_a_step_ends_with_the_prompt_it_finishes():
    for chunked in (True, False):
        filled = make(num_blocks=256, max_num_batched_tokens=64, enable_chunked_prefill=chunked)
        costed = make(num_blocks=256, max_num_batched_tokens=64, enable_chunked_prefill=chunked,
                      step_overhead_tokens=8)
        for s in (filled, costed):
            for i in range(2):
                s.add(seq(30, start=100 * i, max_tokens=2))
        a, b = list(filled.waiting)
        assert first_token_steps(filled, [a, b]) == [1, 1]      # both wait for a 60-token step
        a, b = list(costed.waiting)
        assert first_token_steps(costed, [a, b]) == [1, 2]      # a's first token after 30
        run(costed)
        assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)


def test_short_prompts_still_share_a_step_when_steps_have_a_cost():
    s = make(num_blocks=256, max_num_batched_tokens=64, step_overhead_tokens=8)
    qs = [seq(5, start=100 * i, max_tokens=1) for i in range(10)]
    for q in qs:
        s.add(q)
    batch = step(s)
    # each 5-token prompt saves the ones still queued a step's overhead (8 tokens' worth)
    assert 5 <= len(batch.seqs) < 10
    run(s)
    assert all(q.output_token_ids == expected_output(q) for q in qs)


def test_a_twin_waits_for_the_prefix_being_computed_instead_of_computing_it_again():
    for chunked in (True, False):
        s = make(num_blocks=256, max_num_batched_tokens=64, enable_chunked_prefill=chunked)
        a = Sequence(list(range(40)) + [900, 901], SamplingParams(max_tokens=2))
        b = Sequence(list(range(40)) + [950, 951], SamplingParams(max_tokens=2))
        s.add(a)
        s.add(b)
        assert first_token_steps(s, [a, b]) == [1, 2]
        run(s)
        assert b.num_cached_tokens == 40 and s.bm.prefix_hits == 40     # computed once
        assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)


def test_kv_hold_keeps_blocks_until_released_and_abort_frees_at_once():
    s = make()
    q = seq(10, max_tokens=1)
    q.kv_hold = "t1"
    s.add(q)
    run(s)
    assert q.is_finished and s.held == {"t1": q} and s.num_held_blocks == 3
    assert s.bm.num_free_blocks == 64 - 3
    s.release("t1")
    s.release("t1")                                  # once only
    assert s.held == {} and s.num_held_blocks == 0 and s.bm.num_free_blocks == 64
    aborted = seq(10, max_tokens=5)
    aborted.kv_hold = "t2"
    s.add(aborted)
    step(s)
    s.finish(aborted, "abort")
    assert s.held == {} and s.bm.num_free_blocks == 64


def test_prefilled_sequence_runs_its_last_prompt_token_as_a_decode():
    s = make()
    q = seq(9, max_tokens=3)
    assert s.bm.allocate(q, len(q), s.bm.match_prefix(q))    # as kv_transfer reserves it
    s.add_prefilled(q)
    # full blocks entered in the cache
    assert q.num_computed_tokens == 8 and q.num_hashed_blocks == 2
    first = step(s)
    assert first.is_decode and first.num_new_tokens == [1] and first.samples(0)
    run(s)
    assert q.output_token_ids == expected_output(q) and s.bm.usage() == 0.0
