"""The worker's memory settings (pure logic): the buffer cache's share of the budget, and handing memory back
once per idle period."""

from __future__ import annotations

import pytest

from workers.memory import CACHE_FRACTION, CPU_CACHE_BYTES, IdleRelease, cache_limit_bytes

MIB = 2**20


def test_cache_limit_defaults_to_a_share_of_the_budget_and_little_on_a_cpu():
    assert cache_limit_bytes(-1, 1600 * MIB, "cuda") == int(1600 * MIB * CACHE_FRACTION) == 100 * MIB
    assert cache_limit_bytes(-1, 1600 * MIB, "cpu") == CPU_CACHE_BYTES == 32 * MIB
    assert cache_limit_bytes(-1, 160 * MIB, "cpu") == 10 * MIB  # a small budget: its share
    assert cache_limit_bytes(0, 1600 * MIB, "cuda") == 0  # no cache at all
    assert cache_limit_bytes(300, 1600 * MIB, "cpu") == 300 * MIB  # the operator's word, on any device


def test_a_cache_limit_that_crowds_out_the_models_is_refused():
    with pytest.raises(ValueError, match="MLXQ_CACHE_LIMIT_MB=900"):
        cache_limit_bytes(900, 1600 * MIB, "metal")


def test_memory_goes_back_once_each_time_the_worker_has_been_idle_for_two_beats():
    released = []
    idle = IdleRelease(lambda: released.append(True))
    assert [idle.beat(busy) for busy in (False, False, False)] == [False] * 3  # nothing ran: nothing to give
    # busy, one idle beat (a gap between requests), busy, then idle: released on the second idle beat, once
    assert [idle.beat(busy) for busy in (True, False, True, False, False, False)] == [
        False, False, False, False, True, False]
    assert len(released) == 1


def test_a_failing_release_does_not_stop_the_heartbeat():
    def broken():
        raise RuntimeError("no allocator")

    idle = IdleRelease(broken, idle_beats=1)
    assert idle.beat(True) is False and idle.beat(False) is False  # logged, not raised
