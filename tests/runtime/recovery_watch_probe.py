"""torchrun worker for tests/runtime/test_watchdog_recovery.py: recover from the host tier with the recovery itself
watched (`recover(..., watchdog=wd)`), then train on with every step watched, and write each rank's final
state and losses (the layout `torchmoe_harness.launch.load_result` reads).

    torchrun --nproc_per_node 2 tests/runtime/recovery_watch_probe.py --spec spec.json --out DIR
"""

from __future__ import annotations

import os

import torch

from torchmoe_ckpt.config import SparseConfig
from torchmoe_ckpt.model.operators import discover_operators
from torchmoe_ckpt.persist.build_tiers import build_tiers
from torchmoe_ckpt.recovery.resume import RecoveryOptions, recover
from torchmoe_ckpt.runtime.watchdog import CollectiveWatchdog
from torchmoe_ckpt.sparse_checkpointer import RunContext, SparseCheckpointer
from torchmoe_harness.trainer import RunConfig, Trainer
from torchmoe_harness.worker import leave, start, write_report


def main() -> None:
    spec, out = start()
    cfg = RunConfig(**spec["run"])
    trainer = Trainer(cfg)
    wd = CollectiveWatchdog(spec["watchdog_timeout_s"], rank=trainer.rank, events_path=spec["watchdog_events"])
    tiers = build_tiers(spec["host_tier"], trainer.rank, trainer.world, cfg.hsdp)
    fresh = Trainer(cfg, init_seed=cfg.seed + 7777)  # other weights: what recovery misses shows as a mismatch
    ops = {o.name: o for o in discover_operators(fresh.model)}
    res = recover(fresh, tiers, ops, fresh.compute_dtype, options=RecoveryOptions(watchdog=wd))
    if res.window is not None:
        trainer = fresh
    ck = SparseCheckpointer(
        trainer.model,
        trainer.optimizer,
        trainer.compute_dtype,
        SparseConfig(**spec["checkpoint"]),
        RunContext(tiers=tiers, resumed=res),
    ).attach(trainer)
    losses = {}
    while trainer.step < cfg.steps:
        with wd.watch(f"train_step {trainer.step + 1}"):
            step = trainer.train_step()
        losses[step.step] = step.loss
        with wd.watch(f"checkpoint.after_step {step.step}"):
            ck.after_step(step)
    with wd.watch("checkpoint.close"):
        ck.flush()
    torch.save({"state": trainer.export_state(), "losses": losses}, out / f"rank{trainer.rank}.pt")
    write_report(
        out / "report.json",
        {
            "recovered_step": res.recovered_step,
            "watchdog": wd.stats(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        },
    )
    ck.stop()
    wd.close()
    leave()


if __name__ == "__main__":
    main()
