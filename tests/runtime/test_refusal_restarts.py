"""A start refused under torchrun says that torchrun will repeat it: torchrun restarts a failed worker
`--max-restarts` times, so one refusal would otherwise appear that many times more in one log, each like a new
failure. The refusal carries `restarts_left` (typed) and one `event=start_refused` line; outside torchrun nothing
changes. In-process with the environment torchrun gives its workers (TORCHELASTIC_MAX_RESTARTS, _RESTART_COUNT:
torch's local_elastic_agent sets both); a real torchrun starts torch once per attempt, past a test's 60 s here."""

from __future__ import annotations

import logging

import pytest
import torch
from support.events import find

import torchmoe_ckpt as tmc


def _refused() -> tmc.ConfigError:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(tmc.ConfigError) as exc:
        tmc.Checkpointer(model, torch.optim.AdamW(model.parameters()), lambda b: b, seed="seven")  # a bad seed
    return exc.value


@pytest.mark.parametrize("attempt,left", [(0, 2), (1, 1), (2, 0)])
def test_a_refusal_under_torchrun_says_how_often_it_repeats(monkeypatch, caplog, attempt, left):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    with caplog.at_level(logging.ERROR, logger="torchmoe_ckpt"):
        exc = _refused()
    assert exc.restarts_left == left and "\n" not in str(exc), exc
    events = [ev.fields for ev in find(caplog.text, "start_refused")]
    assert events == [{"rank": "0", "attempt": str(attempt), "restarts_left": str(left), "error": "ConfigError"}]


def test_outside_torchrun_a_refusal_is_unchanged(monkeypatch, caplog):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    with caplog.at_level(logging.ERROR, logger="torchmoe_ckpt"):
        exc = _refused()
    assert exc.restarts_left is None and not find(caplog.text, "start_refused")
