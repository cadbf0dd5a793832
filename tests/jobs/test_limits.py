"""Per-key limits (jobs/limits.py) and usage (jobs/usage.py) on a real Redis: the checks, what they record, where
a key's limits come from, and the file's format."""

from __future__ import annotations

import json

import pytest

from jobs import limits, usage
from jobs.limits import Limits


def test_requests_per_minute_refuses_the_one_over_and_says_when_a_place_frees(redis_conn):
    file = {"a" * 24: Limits(requests_per_minute=2)}
    seen = [limits.admit(redis_conn, file, "a" * 24, f"t{n}", synchronous=True, daily=limits.TOKENS)
            for n in range(3)]
    assert [v.refused for v in seen] == [None, None, "requests_per_minute"]
    assert [v.requests_left for v in seen[:2]] == [1, 0]
    assert 59 <= seen[2].retry_after_s <= 60
    other = limits.admit(redis_conn, file, "b" * 24, "t9", synchronous=True, daily=limits.TOKENS)
    assert other.refused is None and not other.limits.any()  # no entry, no default: not limited


def test_concurrent_counts_requests_in_flight_until_released(redis_conn):
    file = {limits.DEFAULT: Limits(concurrent=1)}
    assert limits.admit(redis_conn, file, "", "one", synchronous=True, daily=None).refused is None
    assert limits.admit(redis_conn, file, "", "two", synchronous=True, daily=None).refused == "concurrent"
    assert limits.admit(redis_conn, file, "", "job", synchronous=False, daily=None).refused is None  # async: `queued`
    limits.release(redis_conn, "", "one")
    assert limits.admit(redis_conn, file, "", "three", synchronous=True, daily=None).refused is None


def test_daily_limits_read_the_days_usage_and_reset_at_midnight(redis_conn):
    owner = "c" * 24
    file = {owner: Limits(tokens_per_day=100, audio_seconds_per_day=60.0)}
    with redis_conn.pipeline() as pipe:
        usage.add(pipe, owner, "m", {"requests": 1, "prompt_tokens": 60, "completion_tokens": 40})
        usage.add(pipe, owner, "w", {"requests": 1, "audio_seconds": 30.5})
        pipe.execute()
    text = limits.admit(redis_conn, file, owner, "t", synchronous=True, daily=limits.TOKENS)
    assert text.refused == "tokens_per_day" and text.used_today == 100
    assert 0 < text.retry_after_s <= 86400 and abs(text.retry_after_s - usage.seconds_to_midnight()) < 5
    audio = limits.admit(redis_conn, file, owner, "u", synchronous=True, daily=limits.AUDIO)
    assert audio.refused is None and audio.used_today == 30.5


def test_queued_counts_a_keys_jobs_until_they_end(redis_conn):
    file = {limits.DEFAULT: Limits(queued=2)}
    verdicts = [limits.admit_queued(redis_conn, file, "d" * 24, f"job-{n}", 3600) for n in range(3)]
    assert [v.refused for v in verdicts] == [None, None, "queued"]
    limits.job_ended(redis_conn, "d" * 24, "job-0")
    assert limits.admit_queued(redis_conn, file, "d" * 24, "job-3", 3600).refused is None


def test_the_admin_apis_entry_wins_over_the_files_and_defaults_come_last(redis_conn):
    owner = "e" * 24
    file = {owner: Limits(requests_per_minute=5), limits.DEFAULT: Limits(requests_per_minute=1)}
    assert limits.effective(redis_conn, file, owner) == (Limits(requests_per_minute=5), "file")
    assert limits.effective(redis_conn, file, "f" * 24) == (Limits(requests_per_minute=1), "file default")
    limits.set_override(redis_conn, limits.DEFAULT, Limits(concurrent=3))
    assert limits.effective(redis_conn, file, "f" * 24) == (Limits(concurrent=3), "admin default")
    limits.set_override(redis_conn, owner, Limits(tokens_per_day=7))
    assert limits.effective(redis_conn, file, owner) == (Limits(tokens_per_day=7), "admin")
    assert limits.admit(redis_conn, file, owner, "t", synchronous=True, daily=None).limits == Limits(tokens_per_day=7)
    assert limits.clear_override(redis_conn, owner) and not limits.clear_override(redis_conn, owner)


def test_the_file_names_keys_by_id_or_by_the_key_and_says_what_is_wrong(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"default": {"queued": 10}, "my-secret-key": {"requests_per_minute": 3},
                                "0123456789abcdef01234567": {"audio_seconds_per_day": 3600, "share": 3}}))
    found = limits.load_file(str(path))
    assert found[limits.entry_name("my-secret-key")] == Limits(requests_per_minute=3)
    assert "my-secret-key" not in found and found["0123456789abcdef01234567"] == Limits(audio_seconds_per_day=3600.0,
                                                                                      share=3.0)
    for bad, says in (({"default": {"per_hour": 1}}, "unknown limit 'per_hour'"),
                      ({"default": {"queued": -1}}, "default.queued: a number >= 0"),
                      ({"default": {"queued": True}}, "default.queued"), ([1], "an object of entries"),
                      ({"default": {"share": 0}}, "default.share: a weight from 0.01 to 1000")):
        path.write_text(json.dumps(bad))
        with pytest.raises(limits.LimitsFileError, match=says):
            limits.load_file(str(path))
    path.write_text("{not json")
    with pytest.raises(limits.LimitsFileError, match="not JSON"):
        limits.load_file(str(path))
    with pytest.raises(limits.LimitsFileError, match="cannot read it"):
        limits.load_file(str(tmp_path / "missing.json"))


def test_usage_rows_per_day_key_and_model(redis_conn):
    with redis_conn.pipeline() as pipe:
        usage.add(pipe, "a" * 24, "m", {"requests": 1, "completion_tokens": 5}, day="2026-11-27")
        usage.add(pipe, "a" * 24, "m", {"requests": 1, "completion_tokens": 7}, day="2026-11-28")
        usage.add(pipe, "", "w", {"requests": 1, "audio_seconds": 1.25}, day="2026-11-28")
        pipe.execute()
    rows = usage.read(redis_conn, usage.days_between("2026-11-27", "2026-11-28"))
    assert [(r["day"], r["key"], r["model"], r["requests"]) for r in rows] == [
        ("2026-11-27", "a" * 24, "*", 1), ("2026-11-27", "a" * 24, "m", 1), ("2026-11-28", "a" * 24, "*", 1),
        ("2026-11-28", "a" * 24, "m", 1), ("2026-11-28", "anonymous", "*", 1), ("2026-11-28", "anonymous", "w", 1)]
    assert rows[3]["completion_tokens"] == 7 and rows[5]["audio_seconds"] == 1.25 and rows[5]["prompt_tokens"] == 0
    only = usage.read(redis_conn, ["2026-11-28"], owner="")
    assert {r["model"] for r in only} == {"*", "w"}
    with pytest.raises(ValueError, match="before it starts"):
        usage.days_between("2026-11-28", "2026-11-27")
