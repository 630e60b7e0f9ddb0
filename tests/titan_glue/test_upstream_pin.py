"""sparse_step copies TorchTitan's Trainer.train_step (and _clip_with_norm its clip split): the installed TorchTitan's
source must still be the one copied (titan_integration/upstream_pin.py). Reads the installed files, imports neither
torch nor TorchTitan."""

from __future__ import annotations

import pytest

from titan_integration import upstream_pin

pytest.importorskip("torchtitan", reason="TorchTitan is not installed (the titan extra)")


def test_the_copied_torchtitan_code_is_unchanged():
    problems = upstream_pin.drift()
    assert not problems, "TorchTitan changed code this package copies:\n" + "\n".join(problems)


def test_sparse_trainer_names_the_upstream_version_it_follows():
    source = (upstream_pin.Path(__file__).resolve().parents[2] / "titan_integration" / "sparse_trainer.py").read_text()
    assert "UPSTREAM_TRAIN_STEP" in source
    assert upstream_pin.UPSTREAM_TRAIN_STEP[:2] == ("torchtitan", "0.3.0")
    assert (
        upstream_pin.UPSTREAM_TRAIN_STEP[2] == upstream_pin.UPSTREAM_COPIES["torchtitan.trainer:Trainer.train_step"][0]
    )


def test_a_changed_train_step_is_reported(monkeypatch):
    """The check can fail: a train_step with one more statement is drift, naming what to re-check."""
    installed = upstream_pin._module_file

    def read(module: str) -> str:
        text = installed(module).read_text()
        if module == "torchtitan.trainer":
            text = text.replace(
                "        self.optimizers.zero_grad(",
                "        self.new_upstream_hook()\n        self.optimizers.zero_grad(",
                1,
            )
        return text

    problems = upstream_pin.drift(read)
    assert len(problems) == 1, problems
    assert problems[0].startswith("torchtitan.trainer:Trainer.train_step changed upstream")
    assert "re-check titan_integration/sparse_trainer.py SparseTrainer.sparse_step" in problems[0]


def test_formatting_and_comments_are_not_drift():
    text = upstream_pin._module_file("torchtitan.trainer").read_text()
    reformatted = text.replace(
        "        # Keep these variables local", "\n        #  (a new comment)\n        # Keep these", 1
    )
    target = "torchtitan.trainer:Trainer.train_step"
    assert reformatted != text
    assert upstream_pin.source_digest(target, reformatted) == upstream_pin.source_digest(target)


def test_a_version_bump_is_reported(monkeypatch):
    monkeypatch.setattr(upstream_pin.importlib.metadata, "version", lambda _name: "0.4.0")
    problems = upstream_pin.drift()
    assert len(problems) == 1 and "torchtitan 0.4.0 is installed but the copies follow 0.3.0" in problems[0]
