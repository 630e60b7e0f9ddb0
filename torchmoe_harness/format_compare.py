"""Both object-store formats on the same window: bytes and objects written, upload time, bytes read.

    from torchmoe_harness.format_compare import compare_formats, synthetic_window
    tiers = synthetic_window(tmp_dir, world=2, experts=8)            # or the HostTier of a real run
    compare_formats(tiers[0], window_id=1, uri="s3://bucket/cmp", storage_options=opts)

`synthetic_window` writes one committed host-tier window per rank with MoE-shaped slots (grouped expert
tensors [E, F, D] split over the ranks, with their AdamW state, a sharded dense weight, bf16 compute weights
of a later layer). Bytes read are what crossed the storage driver (tensorstore's kvstore metrics; for the
DCP format the bytes of the files fetched, which is what `ObjectTier.download` reads).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from torchmoe_ckpt.core.operator import Piece
from torchmoe_ckpt.core.plan import SlotPlan, WindowPlan
from torchmoe_ckpt.core.records import IterationRecord, ReplayLog, SlotInfo
from torchmoe_ckpt.core.slot import Slot, SlotItem
from torchmoe_ckpt.storage_format.layout import store_writer_prefix, window_dirname, writer_name
from torchmoe_ckpt.tiers.host_tier import HostTier


def _item(key, role, fqn, gshape, offset, shape, t) -> SlotItem:
    return SlotItem(key, role, fqn, Piece(fqn, True, tuple(gshape), tuple(offset), (), tuple(shape)), t)


def synthetic_slot(
    index: int, rank: int, world: int, experts: int = 8, ffn: int = 256, dim: int = 128, seed: int = 0
) -> Slot:
    g = torch.Generator().manual_seed(seed * 1000 + index * 10 + rank)
    per = experts // world
    items: list[SlotItem] = []
    w1 = "layers.0.moe.experts.w1"
    for e in range(rank * per, (rank + 1) * per):
        off, shp = (e, 0, 0), (1, ffn, dim)
        items.append(_item(f"model.{w1}", "master", w1, (experts, ffn, dim), off, shp, torch.randn(shp, generator=g)))
        items.append(
            _item(f"optim.{w1}.exp_avg", "exp_avg", w1, (experts, ffn, dim), off, shp, torch.randn(shp, generator=g))
        )
        items.append(
            _item(
                f"optim.{w1}.exp_avg_sq", "exp_avg_sq", w1, (experts, ffn, dim), off, shp, torch.rand(shp, generator=g)
            )
        )
    items.append(_item(f"optim.{w1}.step", "step", w1, (), (), (), torch.tensor(float(7 + index))))
    wq, rows = "layers.0.attention.wq.weight", dim // world
    items.append(
        _item(
            f"model.{wq}",
            "master",
            wq,
            (dim, dim),
            (rank * rows, 0),
            (rows, dim),
            torch.randn((rows, dim), generator=g),
        )
    )
    w2 = "layers.1.moe.experts.w2"
    for e in range(rank * per, (rank + 1) * per):
        items.append(
            _item(
                f"compute.{w2}",
                "compute",
                w2,
                (experts, dim, ffn),
                (e, 0, 0),
                (1, dim, ffn),
                torch.randn((1, dim, ffn), generator=g).to(torch.bfloat16),
            )
        )
    return Slot(index, ("layer0",), ("layer1",), items, step=7 + index)


def synthetic_window(
    root: str | Path, world: int = 2, window_id: int = 1, slots: int = 2, run_id: str = "syn", **shape
) -> list[HostTier]:
    """One committed host-tier window per rank (what the PersistThread produces), with synthetic MoE slots."""
    tiers = []
    for r in range(world):
        tier = HostTier(Path(root) / "node-0", run_id, r, world)
        for i in range(slots):
            slot = synthetic_slot(i, r, world, seed=window_id, **shape)
            tier.write_slot(window_id, slot, SlotInfo(window_id, i, 7, step=slot.step))
        plan = WindowPlan(
            tuple(SlotPlan(("layer0",), ("layer1",), 0) for _ in range(slots)), float("inf"), True, ("layer0", "layer1")
        )
        rlog = ReplayLog()
        rlog.add(
            IterationRecord(8, torch.arange(16), torch.tensor(1.5), 1e-3, torch.tensor(2.0), torch.get_rng_state())
        )
        tier.write_commit(window_id, 7, plan, rlog, {"synthetic": True})
        tiers.append(tier)
    return tiers


def _stored(fs, path: str) -> tuple[int, int]:
    """(objects, bytes) under a store path."""
    found = fs.find(path, detail=True)
    return len(found), sum(int(v.get("size") or 0) for v in found.values())


def compare_formats(
    tier: HostTier,
    window_id: int,
    uri: str,
    storage_options: dict | None = None,
    run_id: str | None = None,
    experts_to_read: int = 2,
) -> dict:
    """Upload `tier`'s committed window with both formats to `uri` and measure, per format: bytes and
    objects written for the window, upload seconds, bytes read to recover this rank (download into a fresh
    host tier), and bytes read to fetch `experts_to_read` of this rank's experts of one grouped expert tensor."""
    from torchmoe_ckpt.storage_format.store_open import open_store
    from torchmoe_ckpt.storage_format.tensorstore_spec import io_counters
    from torchmoe_ckpt.tiers.object_tier import make_store
    from torchmoe_ckpt.tiers.tensorstore_read import read_pieces

    run_id = run_id or f"cmp-{time.monotonic_ns()}"
    fs, root = open_store(uri, storage_options, probe=False)
    out: dict = {}
    man = tier.manifest(window_id)
    for fmt in ("dcp", "tensorstore"):
        run = f"{run_id}-{fmt}"
        store = make_store(uri, run, tier.rank, storage_options, keep_windows=10, format=fmt)
        t0 = time.perf_counter()
        payload = store.upload(tier, window_id)
        upload_s = time.perf_counter() - t0
        # the DCP format keeps the host layout (every writer under window-N/), tensorstore one database per writer
        prefix = f"{run}/" if fmt == "dcp" else store_writer_prefix(run, writer_name(tier.rank))
        objects, nbytes = _stored(fs, f"{root.rstrip('/')}/{prefix}{window_dirname(window_id)}")
        with tempfile.TemporaryDirectory() as tmp:
            fresh = HostTier(tmp, run, tier.rank, tier.world_size)
            c0, t0 = io_counters(), time.perf_counter()
            problems = store.download(window_id, fresh)
            download_s = time.perf_counter() - t0
            c1 = io_counters()
        if problems:
            raise RuntimeError(f"{fmt}: download of window {window_id} failed: {problems[:2]}")
        row = {
            "payload_bytes": payload,
            "bytes_written": nbytes,
            "objects_written": objects,
            "upload_s": round(upload_s, 4),
            "download_s": round(download_s, 4),
        }
        if fmt == "dcp":
            row["bytes_read_recover_rank"] = man.total_bytes + len(man.to_json())  # every file + MANIFEST.json
            # the DCP object tier fetches whole files: any expert needs its slot's whole .distcp file
            row["bytes_read_experts"] = sum(e.bytes for rel, e in man.files.items() if rel.startswith("slot-00/"))
        else:
            row["bytes_read_recover_rank"] = c1["bytes_read"] - c0["bytes_read"]
            row["read_requests_recover_rank"] = c1["reads"] - c0["reads"]
            row["stats"] = dict(store.last_upload)
            key, held = _expert_key(store, window_id)
            if key is not None:
                c0 = io_counters()
                wanted = {
                    key: [
                        ((e,) + (0,) * (len(held[0]) - 1), (1,) + (1 << 40,) * (len(held[0]) - 1))
                        for e in sorted({o[0] for o in held})[:experts_to_read]
                    ]
                }
                got = read_pieces(uri, run, window_id, wanted, slot=0, storage_options=storage_options)
                c1 = io_counters()
                row.update(
                    experts_read=sorted(k[2][0] for k in got),
                    expert_key=key,
                    bytes_read_experts=c1["bytes_read"] - c0["bytes_read"],
                    read_requests_experts=c1["reads"] - c0["reads"],
                )
        out[fmt] = row
    out["window_id"], out["rank"], out["uri"] = window_id, tier.rank, uri
    return out


def _expert_key(store, window_id: int):
    from torchmoe_ckpt.storage_format.tensorstore_spec import is_expert_key

    items = store._read_meta(window_id)["slots"][0]["items"]
    for e in items:
        if "array" in e and is_expert_key(e["key"], e["global_shape"]):
            return e["key"], [x["offset"] for x in items if x["key"] == e["key"]]
    return None, []
