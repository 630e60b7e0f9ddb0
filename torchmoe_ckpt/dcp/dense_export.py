"""Dense export: the whole training state as a normal DCP checkpoint that stock `dcp.load` reads, in TorchTitan's
layout (model tensors at the top level, the optimizer flattened under `optimizer`, our `torchmoe_train_state`,
and a framework's own entries via `extra`), readable at any world size. `load_dense` goes through
`set_state_dict`, i.e. FSDP2's own load path: `dcp.load` into the live parameters alone would not necessarily
update the padded storage FSDP2 all-gathers from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from ..model.optim_state import init_optimizer_state, optimizer_list
from ..runtime.distributed import library_new_group
from ..storage_format.layout import METADATA
from ..storage_format.layout import dense_step_dirname as step_dirname
from ..storage_format.store_open import open_store

log = logging.getLogger("torchmoe_ckpt.dense_export")
TRAIN_STATE = "torchmoe_train_state"  # not TorchTitan's "train_state", which has other fields


# Flattened optimizer keys ("state.<fqn>.exp_avg"): TorchTitan's OptimizersContainer layout.
_OPTIONS = StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)


def _state(model: torch.nn.Module, optimizer, step: int = 0, lr: float = 0.0) -> dict:
    # Several optimizers (Muon + AdamW) flatten into one FQN-keyed dict, as TorchTitan's container does.
    msd, osd = get_state_dict(model, optimizer_list(optimizer), options=_OPTIONS)
    train = {"step": torch.tensor(step), "lr": torch.tensor(lr, dtype=torch.float64)}
    return {**msd, "optimizer": osd, TRAIN_STATE: train}


def _export_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict | Callable[[], dict] | None = None
) -> dict:
    """`extra`: more top-level entries (a dict, or a function returning one at export time), e.g. a framework's
    data-loader position, so that its own full resume finds every key."""
    state = _state(model, optimizer, step, float(optimizer_list(optimizer)[0].param_groups[0]["lr"]))
    more = extra() if callable(extra) else (extra or {})
    clash = sorted(set(more) & set(state))
    if clash:
        raise ValueError(f"dense export: extra entries {clash} would overwrite the model/optimizer state")
    state.update(more)
    return state


def export_dense(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    uri: str,
    step: int,
    storage_options: dict | None = None,
    extra=None,
) -> float:
    """Collective and synchronous (e.g. right after recovery): every rank calls it. Returns seconds."""
    t0 = time.perf_counter()
    save(_export_state(model, optimizer, step, extra), storage_writer=FsspecWriter(uri, **(storage_options or {})))
    seconds = time.perf_counter() - t0
    log.info("event=dense_export step=%d path=%s seconds=%.3f", step, uri, seconds)
    return seconds


def load_dense(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, uri: str, storage_options: dict | None = None
) -> int:
    """Collective: load an export into a (freshly built) model and optimizer; returns the step it holds."""
    fs, root = open_store(uri, storage_options, probe=False)
    if not fs.exists(f"{root.rstrip('/')}/{METADATA}"):
        raise FileNotFoundError(
            f"{uri} is not a complete dense export ({METADATA} missing): the export was "
            f"interrupted or the path is wrong; use an older export"
        )
    init_optimizer_state(optimizer)  # DCP loads in place: the optimizer state tensors must exist
    state = _state(model, optimizer)
    try:
        load(state, storage_reader=FsspecReader(uri, **(storage_options or {})))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        failures = getattr(exc, "failures", None)  # rank -> the exception it hit
        if any(isinstance(e, dist.DistError) for e in (failures.values() if failures else (exc,))):
            raise  # a peer died or the network failed: nothing is known about the export, say what happened
        why = "; ".join(sorted({str(e) for e in failures.values()})) if failures else str(exc)
        why = " ".join(why.split())[:300]
        raise ValueError(
            f"{uri} does not fit this model ({why}); it was written by another model or "
            f"configuration: load an export of this model, or start without initial_load"
        ) from None
    osd, ts = state.pop("optimizer"), state.pop(TRAIN_STATE)
    set_state_dict(model, optimizer_list(optimizer), model_state_dict=state, optim_state_dict=osd, options=_OPTIONS)
    step = int(ts["step"])
    log.info("event=dense_load step=%d path=%s", step, uri)
    return step


class DenseExporter:
    """Periodic dense exports to any fsspec URI by `dcp.async_save` on its own gloo group (its collectives never
    interleave with training's); an export without `.metadata` (written last) is incomplete. Keeps the newest `keep`."""

    def __init__(
        self, uri: str, storage_options: dict | None = None, every: int | None = None, keep: int = 2, async_stager=None
    ):
        """`async_stager`: DCP's `AsyncStager` for `dcp.async_save` (e.g. TorchTitan's `async_with_pinned_mem`; the
        caller closes it); None: DCP's default."""
        if every is not None and every < 1:
            raise ValueError(f"dense export interval must be >= 1 iterations or None (off), got {every}")
        self.uri, self.opts, self.every, self.keep = uri.rstrip("/"), dict(storage_options or {}), every, keep
        self.fs, self.root = open_store(uri, self.opts, probe=True)
        self.pg = library_new_group() if dist.is_initialized() else None
        self.async_stager = async_stager
        self._future, self._pending_step = None, None
        self.exported: list[int] = []
        self.stage_seconds: list[float] = []  # what the training thread waits (staging copy)
        self.export_seconds: list[float] = []  # start to complete, off the training thread

    def path(self, step: int) -> str:
        return f"{self.uri}/{step_dirname(step)}"

    def maybe_export(self, model, optimizer, step: int, extra=None) -> None:
        if self.every and step % self.every == 0:
            self.export(model, optimizer, step, extra)

    def export(self, model, optimizer, step: int, extra=None) -> None:
        self.wait()  # one export at a time
        t0 = time.perf_counter()
        self._future = async_save(
            _export_state(model, optimizer, step, extra),
            storage_writer=FsspecWriter(self.path(step), **self.opts),
            process_group=self.pg,
            async_stager=self.async_stager,
        )
        self._pending_step, self._t0 = step, t0
        self.stage_seconds.append(time.perf_counter() - t0)

    def wait(self) -> None:
        if self._future is None:
            return
        fut = getattr(self._future, "upload_completion", self._future)  # torch >= 2.9: an AsyncSaveResponse
        fut.result()  # pyright: ignore[reportAttributeAccessIssue]  (a Future either way)
        step, self._future, self._pending_step = self._pending_step, None, None
        assert step is not None  # set together with the future
        self.export_seconds.append(time.perf_counter() - self._t0)
        self.exported.append(step)
        log.info("event=dense_export step=%d path=%s seconds=%.3f", step, self.path(step), self.export_seconds[-1])
        if (not dist.is_initialized() or dist.get_rank() == 0) and self.keep > 0:
            for old in self.exported[: -self.keep]:
                try:
                    self.fs.rm(f"{self.root.rstrip('/')}/{step_dirname(old)}", recursive=True)
                except FileNotFoundError:  # gone already (a restarted exporter listed it again): retention is done
                    pass
            self.exported = self.exported[-self.keep :]

    def stats(self) -> dict:
        return {
            "exports": len(self.export_seconds),
            "stage_s_max": max(self.stage_seconds, default=0.0),
            "export_s_max": max(self.export_seconds, default=0.0),
            "latest": self.path(self.exported[-1]) if self.exported else None,
        }
