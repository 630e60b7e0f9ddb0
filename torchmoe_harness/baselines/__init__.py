"""Baseline checkpointing systems on the same model, ranks, data and storage code (DCP), for the bench:

  dense_dcp   dense DCP checkpoint every k iterations: `dcp.save` (sync) or `dcp.async_save` (DenseExporter)
  gemini      Gemini-style dense snapshot of the whole local state into host memory every k iterations
  pec         PEC / MoC-System: all non-expert state + K experts per checkpoint (round-robin or load-aware),
              Dynamic-K; lossy: lost-token accounting (PLT)
  moetion     MoEtion selective checkpointing: top-S experts by tokens since their last save, S per layer
              proportional to the layer's token risk, within a byte budget; lossy
  ours        the sparse per-iteration checkpointer of this package (exact)
  memcpy_ref  not a checkpoint: one plain memcpy of a dense snapshot's bytes per iteration, the copy roofline
              under training (the bench's reference for copy throughput)

`runner` drives the harness Trainer with any of them under torchrun, injects failures (at given iterations
or at wall-clock times), recovers in process and reports bytes, waits, recovery time and what was lost.
Every system has `attach(trainer)`, `after_step(trainer, res)`, `recover(trainer, failed_at)`, `close()`
and `stats()`.
"""

from __future__ import annotations


def make_system(kind: str, trainer, params: dict, workdir: str):
    if kind in ("dcp_sync", "dcp_async"):
        from torchmoe_harness.baselines.dense_dcp import DenseDcp

        return DenseDcp(trainer, workdir, asynchronous=kind == "dcp_async", **params)
    if kind == "gemini":
        from torchmoe_harness.baselines.gemini import HostDense

        return HostDense(trainer, **params)
    if kind == "pec":
        from torchmoe_harness.baselines.pec import Pec

        return Pec(trainer, **params)
    if kind == "moetion":
        from torchmoe_harness.baselines.moetion import MoEtion

        return MoEtion(trainer, **params)
    if kind == "ours":
        from torchmoe_harness.baselines.ours import Ours

        return Ours(trainer, **params)
    if kind == "memcpy_ref":
        from torchmoe_harness.baselines.memcpy_ref import MemcpyRef

        return MemcpyRef(trainer, **params)
    if kind == "none":
        return None
    raise ValueError(f"unknown system {kind!r}")
