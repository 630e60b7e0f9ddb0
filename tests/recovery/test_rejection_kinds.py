"""Recovery decides by a rejection's kind, never by its text (issue 46): a reason that merely mentions
"identity: " is not a foreign run, a foreign run's window is refused as one, and the report still says every
reason as the text it always said. In-process, one rank."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchmoe_ckpt as tmc
from torchmoe_ckpt.checkpointer import _Replay
from torchmoe_ckpt.core.errors import UnusableCheckpointError
from torchmoe_ckpt.core.rejection import Rejection, RejectionKind
from torchmoe_ckpt.model.identity import IdentityMismatch, build_identity
from torchmoe_ckpt.persist.build_tiers import build_tiers
from torchmoe_ckpt.recovery.agreed_window import SearchResult, TierOutcome
from torchmoe_ckpt.recovery.resume import RecoveryOptions, recover
from torchmoe_ckpt.storage_format.slot_format import CorruptCopyError
from torchmoe_harness.model import TinyMoE, TinyMoEConfig

RUN, STEPS = "a", 6  # W = 3: windows 0 and 1 committed


def build(init_seed: int = 0):
    torch.manual_seed(0)
    model = TinyMoE(TinyMoEConfig(load_balance_coeff=None))
    model.init_weights(init_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def forward_backward(tokens):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss

    return model, opt, forward_backward


def config(root: Path) -> tmc.CheckpointConfig:
    return tmc.CheckpointConfig(tiers=tmc.TierConfig(root=str(root), run_id=RUN), window=tmc.SparseConfig(window=3))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("written")
    model, opt, fb = build()
    with tmc.Checkpointer(model, opt, fb, config=config(root), data_identity="data=0") as ck:
        ck.resume()
        for step in range(1, STEPS + 1):
            ck.step(torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(step)))
    return root


def _recover(root: Path, data: str, options: RecoveryOptions | None = None):
    """A restarted attempt's recovery from `root`, for a job on the data `data`."""
    model, opt, fb = build(init_seed=7777)
    ck = tmc.Checkpointer(model, opt, fb, config=config(root), data_identity="data=0")
    tiers = build_tiers(config(root).tiers, 0, 1)
    ident = build_identity(model, opt, torch.float32, ck.ops, RUN, world_size=1, data=data, seed=0)
    return recover(_Replay(ck), tiers, ck.op_by_name, torch.float32, identity=ident, options=options)


def test_a_reason_that_mentions_identity_is_not_a_foreign_run(written):
    """Every replay fails with a message holding "identity: " (the old substring test took it for another run's
    window): the windows are unusable, not foreign, and the refusal says so."""

    def fails(window):
        raise RuntimeError(f"identity: not a run's, window {window.id}")

    with pytest.raises(UnusableCheckpointError) as exc:
        _recover(written, "data=0", RecoveryOptions(before_replay=fails))
    msg = str(exc.value)
    assert "every one was rejected" in msg and "replay: RuntimeError: identity: not a run's, window 1" in msg, msg
    assert "another run" not in msg, msg


def test_a_foreign_window_is_refused_by_its_kind(written):
    with pytest.raises(IdentityMismatch) as exc:
        _recover(written, "data=1")
    msg = str(exc.value)
    assert "holds windows of another run" in msg and "data" in msg and "\n" not in msg, msg


def test_a_rejection_is_its_message_and_pickles_with_its_kind():
    why = Rejection(RejectionKind.FOREIGN, "identity: seed 0 != 1", detail="seed 0 != 1")
    assert str(why) == "identity: seed 0 != 1" and pickle.loads(pickle.dumps(why)) == why
    said = why.reworded("load: CorruptCopyError: window 2 is unusable: identity: seed 0 != 1")
    assert said.kind is RejectionKind.FOREIGN and said.detail == "seed 0 != 1"
    err = pickle.loads(pickle.dumps(CorruptCopyError("window 2 is unusable", rejection=why)))
    assert err.rejection == why and str(err) == "window 2 is unusable"


def test_the_report_renders_the_typed_outcome_as_text():
    torn = Rejection(RejectionKind.TORN, "slot-00/x.distcp: 3 bytes, manifest says 4 (torn)", file="slot-00/x.distcp")
    lost = Rejection(RejectionKind.NO_COPY, "no copy: rank 1's part of window 2 is on no tier")
    found = TierOutcome(unusable_copies={2: torn}, rejected={2: {1: lost}}, unusable_by_rank={0: {2: torn}})
    found.pulled_from_peers, found.failed_downloads = {1: 0}, {2: lost}
    rep = found.settle().to_dict()
    assert found.outcome is SearchResult.NO_USABLE_WINDOW and found.outcome == "no usable window"
    assert rep["outcome"] == "no usable window" and type(rep["outcome"]) is str
    assert rep["unusable_copies"] == {2: str(torn)} and rep["unusable_by_rank"] == {0: {2: str(torn)}}
    assert rep["rejected"] == {2: {"1": str(lost)}} and rep["failed_downloads"] == {2: str(lost)}
    assert rep["pulled_from_peers"] == {"1": 0}
