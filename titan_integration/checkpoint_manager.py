"""``SparseCheckpointManager``: TorchTitan's own DCP ``CheckpointManager``, kept whole, plus our two duties.

TorchTitan builds its checkpointer from ``config.checkpoint`` (``config.checkpoint.build(...)``), so a
``Config`` subclass is how a different manager gets in, without forking the Trainer. This one:

* keeps TorchTitan's periodic dense checkpoints exactly as configured in ``[checkpoint]`` (``enable``,
  ``interval``, ``folder``, async modes, ``initial_load_path`` ...);
* ``load()``: when sparse recovery has already rebuilt a newer state from a window (every iteration is
  checkpointed, so the window is newer than any periodic checkpoint), TorchTitan's load is skipped and says
  so; otherwise TorchTitan loads as usual (its own checkpoint folder, then ``initial_load_path``);
* ``save()``: also writes our *dense export* every ``[sparse_checkpoint] dense_export_every`` iterations to
  ``dense_export_uri`` (any fsspec URI, ``dcp.async_save`` on its own gloo group, newest
  ``dense_export_keep`` kept), in TorchTitan's layout: stock TorchTitan reads it with
  ``--checkpoint.initial_load_path {uri}/step-N``;
* ``close()``: waits for the export in flight.

The public ``load/save/close`` are overridden (TorchTitan's base class asks subclasses to override the
``_``-hooks instead) because our part must run even when TorchTitan's own checkpointing is disabled; the
base class's guard still runs for TorchTitan's part through ``super()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.tools.logging import logger

from titan_integration.sparse_config import SparseCheckpointSection
from titan_integration.titan_export import titan_entries

__all__ = ["SparseCheckpointManager"]


class SparseCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(
        self,
        config: Config,
        *,
        dataloader,
        model_parts,
        optimizers,
        lr_schedulers,
        states,
        sd_adapter,
        base_folder: str = "",
    ) -> None:
        super().__init__(
            config,
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        self.trainer = states.get("train_state")
        self.export_parts = model_parts
        self.export_optimizers = optimizers
        self.export_states = dict(states, dataloader=dataloader, lr_scheduler=lr_schedulers)  # titan_export.py
        self.restored_step: int | None = None  # set by the trainer when sparse recovery restored a state
        self.dense_exporter = None

    # ---- TorchTitan's entry points --------------------------------------------------------------------
    def load(self, step: int = -1) -> bool:
        if self.restored_step is not None:
            logger.info(
                f"torchmoe: TorchTitan checkpoint load skipped: sparse recovery restored step "
                f"{self.restored_step}, newer than any periodic checkpoint"
            )
            return False
        return super().load(step)

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        sc = getattr(self.trainer, "sc", None)
        if sc is not None and sc.enable and sc.dense_export_every:
            self._exporter(sc).maybe_export(
                self._model(), self._optimizer(), curr_step, extra=lambda: titan_entries(self.export_states)
            )  # complete for TorchTitan
        return super().save(curr_step, last_step)

    def close(self) -> None:
        if self.dense_exporter is not None:
            self.dense_exporter.wait()
            st = self.dense_exporter.stats()
            logger.info(
                f"torchmoe: dense exports {st['exports']}, latest {st['latest']}, training thread "
                f"waited at most {st['stage_s_max']:.3f} s, export took at most {st['export_s_max']:.3f} s"
            )
            self.dense_exporter = None
        super().close()

    # ---- dense export --------------------------------------------------------------------------------
    def _exporter(self, sc: SparseCheckpointSection):
        if self.dense_exporter is None:
            from torchmoe_ckpt.dcp.dense_export import DenseExporter

            self.dense_exporter = DenseExporter(
                sc.dense_export_uri, sc.storage_options or None, every=sc.dense_export_every, keep=sc.dense_export_keep
            )
        return self.dense_exporter

    def _model(self):
        if len(self.export_parts) != 1:
            raise NotImplementedError(
                "dense export with pipeline parallelism (several model parts) is not "
                "wired in yet; use TorchTitan's own [checkpoint] for PP"
            )
        return self.export_parts[0]

    def _optimizer(self):
        return self.export_optimizers  # every inner optimizer (DistMuon's and AdamW's): one flat FQN-keyed dict
