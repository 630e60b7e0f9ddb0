"""tests/support/events.py, the one parser of `event=` lines, on lines the library writes: copied from runs (the
docs quote them) and produced here by the library's own code."""

from __future__ import annotations

import logging

import pytest

from support.events import Event, events, find, first, names, one, parse
from torchmoe_ckpt.persist.tier_health import TierHealth

RECOVERED = (
    "INFO torchmoe_ckpt.recovery.resume: event=recovered run=t-1 window=3 source=object store steps=6..9 replayed=4 "
    "bytes=123456 seconds=0.412 rejected=[1, 2]: every replayed loss matched the original run bit for bit"
)
HANG = 'event=hang rank=0 op="train_step 10" waited_s=3.002 timeout_s=3.0 pid=9640 attempt=0 exit_code=124'
TIMING = (
    "[rank0]:[titan] torchmoe: event=restart_timing attempt=1 agent_restart=0.74 imports=16.14 process_group=0.96 "
    "model_build=0.84 recovery=1.99 first_step=0.59 total=21.26 (seconds, total from the kill to the first trained "
    "iteration)"
)
UNUSABLE = (
    "WARNING torchmoe_ckpt.recovery.agreed_window: event=unusable_copy rank=1 window=3 dir=/dev/shm/tmoe/r/window-3: "
    "slot-00/items-0.bin: checksum a != b (corrupt) (+2 more); this copy is skipped"
)
REJECTED = (
    "event=window_rejected window=2 rank0='replay: ReplayDivergence: loss 1.5 != 1.25 at step 7' "
    'rank1="replay: it\'s gone" (+3 more rank(s)): trying the next newest window'
)


def test_fields_values_with_dots_and_a_trailing_prose_part():
    ev = parse(RECOVERED)
    assert ev is not None and ev.name == "recovered"
    assert ev.fields == {
        "run": "t-1",
        "window": "3",
        "source": "object store",  # a bare word between fields joins the value before it
        "steps": "6..9",
        "replayed": "4",
        "bytes": "123456",
        "seconds": "0.412",
        "rejected": "[1, 2]",  # brackets kept whole, their space included
    }
    assert ev.prose == "every replayed loss matched the original run bit for bit"
    assert ev.int("replayed") == 4 and ev.float("seconds") == 0.412 and ev["steps"] == "6..9"


def test_quoted_values_are_unquoted_and_keep_their_colons_and_equals():
    ev = parse(REJECTED)
    assert ev is not None and ev.fields == {
        "window": "2",
        "rank0": "replay: ReplayDivergence: loss 1.5 != 1.25 at step 7",
        "rank1": "replay: it's gone",
    }
    assert ev.prose == "(+3 more rank(s)): trying the next newest window"
    hang = parse(HANG)
    assert hang is not None and hang["op"] == "train_step 10" and hang.int("exit_code") == 124 and hang.prose == ""
    eq = parse("event=jit_not_used reason='a=b: c' window_step=4 incomplete_copies_ignored=0")
    assert eq is not None and eq.fields == {"reason": "a=b: c", "window_step": "4", "incomplete_copies_ignored": "0"}


def test_prose_starts_at_the_first_colon_space_or_at_bare_words_after_the_last_field():
    ev = parse(UNUSABLE)
    assert ev is not None and ev.fields == {"rank": "1", "window": "3", "dir": "/dev/shm/tmoe/r/window-3"}
    assert ev.prose.startswith("slot-00/items-0.bin: checksum a != b (corrupt)")
    timing = parse(TIMING)
    assert timing is not None and timing.name == "restart_timing" and timing["total"] == "21.26"
    assert timing.prose.startswith("(seconds, total from the kill")
    uri = parse("event=store_lease_unavailable rank=0 store=s3://bucket/run: TimeoutError: slow; training goes on")
    assert uri is not None and uri["store"] == "s3://bucket/run" and uri.prose == "TimeoutError: slow; training goes on"
    bare = parse("event=stop_guard_failed: a frozen worker may wait out torchrun's SIGTERM grace")
    assert bare == Event("stop_guard_failed", {}, "a frozen worker may wait out torchrun's SIGTERM grace", bare.line)


def test_lines_without_an_event_and_lookalikes_are_not_events():
    assert parse("INFO training step 3 loss=1.5") is None
    assert parse("the prevent=3 option") is None  # `event=` must start a word
    text = "\n".join(["noise", RECOVERED, "more noise", HANG, TIMING])
    assert names(text) == ["recovered", "hang", "restart_timing"]


def test_find_one_and_first_select_by_name_and_exact_field_values():
    text = "\n".join([HANG, HANG.replace("rank=0", "rank=1"), RECOVERED])
    assert [e["rank"] for e in find(text, "hang")] == ["0", "1"]
    assert one(text, "hang", rank=1)["op"] == "train_step 10"
    assert one(text, "recovered", window=3, source="object store").int("replayed") == 4
    assert first(text, "hang").fields["rank"] == "0"
    assert events(text, "hang", rank=2) == [] and find(text, "recovered", window=30) == []  # exact, not a prefix
    with pytest.raises(AssertionError, match="expected one event=hang .*found 2; events seen:\nevent=hang rank=0"):
        one(text, "hang")
    with pytest.raises(AssertionError, match="found none"):
        first(text, "no_window")


def test_a_line_the_library_writes_reads_back_field_by_field(caplog):
    caplog.set_level(logging.WARNING)
    health = TierHealth("object store", 1)
    health.failed("window 2 slot 1", OSError(28, "No space left on device: '/x'"))
    ev = one(caplog.text, "tier_unhealthy", tier="object store", rank=1)
    assert ev["reason"] == "window 2 slot 1: OSError: [Errno 28] No space left on device: '/x'"
    assert ev.prose.startswith("windows are not persisted on this tier")
