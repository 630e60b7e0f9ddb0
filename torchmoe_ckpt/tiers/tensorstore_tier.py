"""Tensorstore format for the object-store tier: one OCDBT database per (writer, window), zarr3 arrays in global
shape chunked one expert per chunk, a window's every write in ONE atomic transaction whose OCDBT manifest, written
last, makes it visible (a writer killed mid-commit leaves an invisible database without `meta.json`). A copy tier
(contracts.py) like `ObjectTier`; selected by `{"format": "tensorstore"}` (`object_tier.make_store`); no Azure driver.
Layout and reads: docs/tensorstore-format.md, tensorstore_read.py."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import torch

from ..core.errors import StoreConfigError
from ..core.records import SlotInfo
from ..core.rejection import Rejection, RejectionKind
from ..core.slot import Slot
from ..runtime import faults
from ..storage_format.checksums import FileEntry, crc32_bytes, crc32_tensor
from ..storage_format.layout import (
    manifest_name,
    parse_window_dirname,
    replay_file,
    slot_writer_dir,
    store_writer_prefix,
    window_dirname,
    writer_name,
)
from ..storage_format.manifest import WindowManifest
from ..storage_format.store_open import explain
from ..storage_format.tensorstore_spec import (
    DTYPES,
    META_FORMAT,
    META_KEY,
    REPLAY_KEY,
    TORCH_DTYPES,
    chunk_shape,
    context,
    db_spec,
    io_counters,
    kvstore_spec,
    plain_item,
    region,
    slot_from_dcp,
    sub_spec,
    to_numpy,
    to_torch,
    ts_module,
)
from .contracts import ObjectStore, StoreTier

NOT_COMMITTED = Rejection(RejectionKind.NOT_COMMITTED, "window not committed in the store (no meta.json)")


class TensorstoreTier(StoreTier, ObjectStore):
    """Object-store tier in the tensorstore format (see the module docstring). One instance per rank."""

    format = "tensorstore"
    attempts = 4

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.root = kvstore_spec(self.uri, self.storage_options)
        self.writer = writer_name(self.rank)
        self.base = sub_spec(self.root, store_writer_prefix(self.run_id, self.writer))
        self.last_upload: dict = {}
        if not self.probe:
            return
        try:
            kv = self._kv(self.root)
            key = f".probe-{os.getpid()}-{time.monotonic_ns()}"
            kv.write(key, b"ok").result()
            kv.write(key, None).result()
        except Exception as exc:
            raise StoreConfigError(explain(self.uri, exc)) from None

    def _kv(self, spec: dict):
        return ts_module().KvStore.open(spec, context=context()).result()

    def _db(self, window_id: int) -> dict:
        return db_spec(self.base, window_dirname(window_id) + "/")

    def upload(self, tier, window_id: int) -> int:
        """Upload this rank's copy of a committed host-tier window as one atomic OCDBT commit."""
        problems = tier.verify(window_id)
        if problems:
            if problems[0].kind is RejectionKind.NOT_COMMITTED:
                raise FileNotFoundError(f"window {window_id} is not on the host tier: {problems[0]}")
            raise RuntimeError(f"local copy of window {window_id} does not verify: {problems[0]}")
        man = tier.manifest(window_id)
        wdir = tier.window_dir(window_id)
        slots = [slot_from_dcp(i, wdir / slot_writer_dir(i, self.writer)) for i in range(man.window)]
        replay = (wdir / replay_file(self.writer)).read_bytes()
        t0, c0 = time.perf_counter(), io_counters()
        nbytes = self._retry("upload", self._commit, window_id, man, slots, replay)
        c1 = io_counters()
        self.last_upload = {"window": window_id, "seconds": time.perf_counter() - t0, "payload_bytes": nbytes}
        self.last_upload.update((k, c1[k] - c0[k]) for k in ("bytes_written", "writes"))
        return nbytes

    def _commit(self, window_id: int, man: WindowManifest, slots: list, replay: bytes) -> int:
        ts = ts_module()
        db = self._db(window_id)
        self._clear_leftovers(window_id)
        txn = ts.Transaction(atomic=True)
        kv = self._kv(db).with_transaction(txn)
        if kv.list().result():  # re-upload of a visible window id: replace its contents in the same commit
            kv.delete_range(ts.KvStore.KeyRange()).result()
        meta = {"format": META_FORMAT, "manifest": json.loads(man.to_json()), "rank": self.rank, "slots": []}
        meta["manifest"].pop("files", None)
        writes, nbytes = [], 0
        for slot, info in slots:
            entries: list[dict] = []
            arrays: dict[str, Any] = {}  # key -> its open tensorstore array
            for it in slot.items:
                pc, buf = it.piece, it.buffer
                e = {"key": it.key, "offset": list(pc.global_offset), "shape": list(pc.shape)}
                e.update(global_shape=list(pc.global_shape), dtype=DTYPES[buf.dtype], crc32=crc32_tensor(buf))
                if it.role == "step" or buf.dim() == 0:
                    e["value"] = buf.double().item().hex()  # scalars live in the metadata
                elif buf.numel() > 0:
                    e["array"] = f"s{slot.index:02d}/{it.key}/"
                    if it.key not in arrays:
                        chunks = chunk_shape(it.key, pc.global_shape, pc.shape, buf.element_size())
                        grid = {"name": "regular", "configuration": {"chunk_shape": chunks}}
                        md = {"shape": e["global_shape"], "data_type": e["dtype"], "chunk_grid": grid}
                        spec = {"driver": "zarr3", "kvstore": sub_spec(db, e["array"]), "metadata": md}
                        arrays[it.key] = ts.open(spec, create=True, context=context(), transaction=txn).result()
                    writes.append(arrays[it.key][region(pc.global_offset, pc.shape)].write(to_numpy(buf)))
                    nbytes += it.nbytes
                entries.append(e)
            meta["slots"].append({"slot": slot.index, "info": info, "items": entries})
        for w in writes:
            w.result()
        kv.write(REPLAY_KEY, replay).result()
        meta["replay"] = {"bytes": len(replay), "crc32": crc32_bytes(replay)}
        kv.write(META_KEY, json.dumps(meta, sort_keys=True).encode()).result()
        nbytes += len(replay)
        faults.point("upload")  # everything staged, nothing committed: a crash here leaves no trace
        txn.commit_async().result()  # the OCDBT manifest, written last, makes the window visible
        return nbytes

    def _clear_leftovers(self, window_id: int) -> None:
        """A database of this id without meta.json (a writer died mid-commit): delete its files first."""
        base = self._kv(self._db(window_id)["base"])
        if base.list().result() and self._read_meta(window_id) is None:
            base.delete_range(ts_module().KvStore.KeyRange()).result()

    def _listed(self) -> set[int]:
        try:
            keys = self._kv(self.base).list().result()
        except Exception as exc:
            if "NOT_FOUND" in str(exc) or isinstance(exc, FileNotFoundError):
                return set()
            raise
        return {w for k in keys if (w := parse_window_dirname(k.decode().split("/", 1)[0])) is not None}

    def _read_meta(self, window_id: int) -> dict | None:
        try:
            r = self._kv(self._db(window_id)).read(META_KEY).result()
        except Exception as exc:  # no manifest.ocdbt yet: an empty / torn database
            if "NOT_FOUND" in str(exc) or "manifest" in str(exc).lower():
                return None
            raise
        return json.loads(bytes(r.value)) if r.state == "value" else None

    def window_ids(self) -> list[int]:
        """Windows whose commit is in the store (meta.json present in the database's latest version)."""
        return sorted(w for w in self._listed() if self._read_meta(w) is not None)

    def collect(self) -> list[int]:
        """Retention: the newest `keep_windows` windows stay; databases torn mid-commit go too."""
        ids = self.window_ids()
        gone = ids[: -self.keep] if self.keep > 0 else []
        torn = [w for w in self._listed() - set(ids) if ids and w < ids[-1]]  # died mid-commit: garbage
        for wid in gone + torn:
            kv = self._kv(self._db(wid)["base"])
            self._retry("delete", lambda: kv.write("manifest.ocdbt", None).result())  # invisible first  # noqa: B023
            self._retry("delete", lambda: kv.delete_range(ts_module().KvStore.KeyRange()).result())  # noqa: B023
        return gone

    def read_items(self, window_id: int, wanted) -> list[tuple[dict, torch.Tensor | None, Rejection | None]]:
        """[(entry, tensor, problem)] for the metadata entries `wanted`: reads only their chunks, checks CRC32."""
        ts, db = ts_module(), self._db(window_id)
        paths = {e["array"] for e in wanted if "array" in e}
        opening = {
            p: ts.open({"driver": "zarr3", "kvstore": sub_spec(db, p)}, open=True, context=context()) for p in paths
        }
        arrays = {p: f.result() for p, f in opening.items()}
        futs = [
            (e, arrays[e["array"]][region(e["offset"], e["shape"])].read() if "array" in e else None) for e in wanted
        ]
        out = []
        for e, f in futs:
            dtype = TORCH_DTYPES[e["dtype"]]
            if "value" in e:
                t = torch.tensor(float.fromhex(e["value"]), dtype=dtype)
            elif f is None:
                t = torch.empty(e["shape"], dtype=dtype)
            else:
                t = to_torch(f.result(), dtype)
            ok = crc32_tensor(t) == e["crc32"]
            out.append((e, t, None if ok else _corrupt(f"{e['key']}@{e['offset']}: CRC32 does not match (corrupt)")))
        return out

    def download(self, window_id: int, tier) -> list[Rejection]:
        """Fetch this writer's copy into the host tier (as its slot files: HostTier.write_slot), verifying every
        piece; returns problems (empty = ok). The local manifest is written only after everything verified."""
        try:
            meta = self._read_meta(window_id)
        except Exception as exc:
            return [_failed(f"metadata unreadable: {exc}")]
        if meta is None:
            return [NOT_COMMITTED]
        w = window_dirname(window_id)
        tier.files.remove([f"{w}/{manifest_name(tier.writer)}"])
        problems: list[Rejection] = []
        files: dict = {}
        for s in meta["slots"]:
            try:
                got = self._retry("download", self.read_items, window_id, s["items"])
            except Exception as exc:
                problems.append(_failed(f"slot {s['slot']}: {exc}"))
                continue
            problems += [p for _, _, p in got if p]
            if problems:
                continue
            # a tensor is None only together with a problem (none here)
            items = [
                plain_item(e["key"], e["global_shape"], e["offset"], e["shape"], t) for e, t, _ in got if t is not None
            ]
            slot = Slot(s["slot"], (), (), items)
            tier.write_slot(window_id, slot, SlotInfo.from_dict(s["info"]))  # (read from the store: the JSON edge)
            files.update(tier.written(window_id, slot.index))
        try:
            replay, problem = self._replay(window_id, meta)
            problems += [problem] if problem else []
        except Exception as exc:
            problems.append(_failed(f"replay records: {exc}"))
        if problems:
            return problems
        tier.files.write(f"{w}/{replay_file(tier.writer)}", replay)
        files[replay_file(tier.writer)] = FileEntry(len(replay), crc32_bytes(replay))
        # The store's copy of the manifest (identity, slot records) with the files just written here.
        man = WindowManifest.from_dict(dict(meta["manifest"], files={}))
        man.files = files
        tier.files.write_last(f"{w}/{manifest_name(tier.writer)}", man.to_json().encode())
        return []

    def inspect(self, window_id: int) -> tuple[WindowManifest, list[Rejection], list[dict], int] | None:
        """What `inspect` lists of this writer's window: (its manifest, the problems `verify` finds, per slot the
        planner info with its items as "checksums", payload bytes); None while it is not committed."""
        meta = self._read_meta(window_id)
        if meta is None:
            return None
        try:
            problems = self.verify(window_id)
        except Exception as exc:
            problems = [_failed(f"read failed: {' '.join(str(exc).split())[:200]}")]
        nbytes = meta["replay"]["bytes"] + sum(
            int(np.prod(i["shape"], dtype=np.int64)) * TORCH_DTYPES[i["dtype"]].itemsize
            for s in meta["slots"]
            for i in s["items"]
        )
        infos = [dict(s["info"], checksums=s["items"]) for s in meta["slots"]]
        return WindowManifest.from_dict(dict(meta["manifest"], files={})), problems, infos, nbytes

    def verify(self, window_id: int) -> list[Rejection]:
        """Read every piece and the replay records of this rank's window and check them (nothing written)."""
        meta = self._read_meta(window_id)
        if meta is None:
            return [NOT_COMMITTED]
        problems = []
        for s in meta["slots"]:
            problems += [p for _, _, p in self.read_items(window_id, s["items"]) if p]
        return problems + [p for p in self._replay(window_id, meta)[1:] if p]

    def _replay(self, window_id: int, meta: dict) -> tuple[bytes, Rejection | None]:
        """The window's replay records and why they are unusable (None: their CRC32 matches)."""
        r = self._kv(self._db(window_id)).read(REPLAY_KEY).result()
        data = bytes(r.value) if r.state == "value" else b""
        ok = r.state == "value" and crc32_bytes(data) == meta["replay"]["crc32"]
        return data, None if ok else _corrupt("replay records: missing or CRC32 does not match (corrupt)")


def _failed(message: str) -> Rejection:
    return Rejection(RejectionKind.DOWNLOAD_FAILED, message)


def _corrupt(message: str) -> Rejection:
    return Rejection(RejectionKind.CORRUPT, message)
