"""An opt-in staging buffer on the device (`SparseConfig.device_staging`): the slot is copied device-to-device
(the cast to the slot's dtype fused) right after the update, and the copy to the host runs from there.

Why: the next update has to wait only for the device-to-device copy (about a millisecond of HBM time per GB; one
`_foreach_copy_` per (source, staging) dtype pair, each a multi-tensor kernel: measured by the GPU check), while the
copy to the host, from a buffer nobody overwrites, may take the whole next iteration; with `copy_chunk_bytes` it
still yields the copy engine to the training stream's reads.

What it costs: one buffer of the largest slot of the window (item offsets aligned to ALIGN bytes), allocated on
the copy stream and reused. It is taken only when it fits: on CUDA in the device's free memory
(`torch.cuda.mem_get_info`) with HEADROOM to spare; on a CPU the "device" is host memory, so it is counted in
`stats()["host_memory"]` (part "device_staging") and against `host_memory_limit`. A window whose slot does not fit
is copied without staging, counted and said once per change; when even the smallest slot any W gives cannot fit,
the checkpointer is refused at construction in one line (`refusal`, agreed over the ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..core.config_values import human_bytes

__all__ = ["ALIGN", "DeviceStaging", "HEADROOM", "staging_need", "staging_fits"]

log = logging.getLogger("torchmoe_ckpt")

ALIGN = 256  # bytes: every staged item starts on a multiple (vectorised kernels)
HEADROOM = 1 << 30  # CUDA: free device memory left to training after the buffer (allocator growth, spikes)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def staging_need(dsts: list[torch.Tensor]) -> int:
    """Bytes of staging one slot with these host buffers needs (each item aligned)."""
    return sum(_aligned(d.numel() * d.element_size()) for d in dsts)


def staging_fits(need: int, free: int, held: int, headroom: int) -> bool:
    """A buffer of `need` bytes fits when what this one already holds plus what is free covers it with `headroom`
    to spare (pure: the rule the tests check with synthetic figures)."""
    return need <= held + free - headroom


class DeviceStaging:
    """The staging buffer of one SnapshotEngine on `device`. `room(n)`: on a CPU, whether `n` more host bytes stay
    within `host_memory_limit` (None: no limit). Window admission runs on the training thread (`admit`), the
    buffer is carved per slot there too (`views`), inside the copy stream's context so its memory is the stream's."""

    def __init__(self, device: torch.device, room: Callable[[int], bool] | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.room = room
        self.target = 0  # bytes the window being captured stages (0: this window is not staged)
        self.held = 0  # bytes allocated now
        self.generation = 0  # bumped when the buffer is replaced: views carved from the old one are stale
        self._buf: torch.Tensor | None = None
        self.windows_staged = 0
        self.windows_refused = 0
        self.staged_copies = 0
        self.last_refusal: str | None = None

    def free_bytes(self) -> tuple[int, int]:
        """(free bytes the buffer may take beyond what it holds, headroom to leave)."""
        if self.cuda:
            free, _total = torch.cuda.mem_get_info(self.device)  # CUDA only
            return int(free), HEADROOM
        return (1 << 62) if self.room is None else 0, 0

    def fits(self, need: int) -> bool:
        if not self.cuda and self.room is not None:  # host memory: the limit's own account
            return need <= self.held or self.room(need - self.held)
        free, headroom = self.free_bytes()
        return staging_fits(need, free, self.held, headroom)

    def refusal(self, floor_bytes: int) -> str | None:
        """Why device staging, asked for, cannot happen here: even the smallest slot any window gives (`floor_bytes`)
        does not fit (one line with the fix); None when it can. The caller agrees it over the ranks."""
        if self.fits(floor_bytes):
            return None
        if self.cuda:
            free, headroom = self.free_bytes()
            where = f"plus {human_bytes(headroom)} of headroom in free device memory, and {human_bytes(free)} is free"
        else:
            where = "within host_memory_limit, and there is less room under it"
        return (
            f"device_staging=True needs a staging buffer of at least {human_bytes(floor_bytes)} (the smallest slot "
            f"any window gives) {where}: set SparseConfig.device_staging = False"
            + ("" if self.cuda else " or raise host_memory_limit")
        )

    def admit(self, need: int, window_id: int) -> bool:
        """At a window start: stage this window (its largest slot needs `need` bytes) when it fits; else copy it
        without staging, counted and logged once per change."""
        ok = self.fits(need)
        self.target = need if ok else 0
        if ok:
            self.windows_staged += 1
            if self.last_refusal is not None:
                log.info(f"torchmoe: device staging resumed at window {window_id}")
            self.last_refusal = None
            return True
        self.windows_refused += 1
        if self.last_refusal is None:
            free, headroom = self.free_bytes()
            self.last_refusal = (
                f"device staging skipped from window {window_id}: its largest slot needs {human_bytes(need)}"
                + (f", {human_bytes(free)} free on the device (headroom {human_bytes(headroom)})" if self.cuda else "")
                + (" over host_memory_limit" if not self.cuda else "")
                + "; copied directly to the host until it fits"
            )
            log.warning(f"torchmoe: {self.last_refusal}")
        return False

    def views(self, dsts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Staging tensors shaped like `dsts` (same dtype: the device-to-device copy does the cast), carved from
        the buffer, which grows to the window's target first. Call inside the copy stream's context."""
        need = staging_need(dsts)
        if self._buf is None or self.held < max(need, self.target):
            self._buf = None  # the old one goes back to the copy stream's pool (only that stream used it)
            self.held = max(need, self.target)
            self._buf = torch.empty(self.held, dtype=torch.uint8, device=self.device)
            self.generation += 1
        out, off = [], 0
        for d in dsts:
            n = d.numel() * d.element_size()
            out.append(self._buf[off : off + n].view(d.dtype).view(d.shape))
            off += _aligned(n)
        return out

    def release(self) -> None:
        """Let the buffer go (close)."""
        self._buf, self.held, self.target = None, 0, 0
        self.generation += 1

    def stats(self) -> dict:
        return {
            "held_bytes": self.held,
            "target_bytes": self.target,
            "windows_staged": self.windows_staged,
            "windows_refused": self.windows_refused,
            "staged_copies": self.staged_copies,
            "refusal": self.last_refusal,
        }
