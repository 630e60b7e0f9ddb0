"""A DCP user's training loop that checkpoints every iteration sparsely by changing only the planner and
the storage writer it passes to `dcp.save`, then recovers bit-exactly with `dcp.load` + sparse-to-dense.

    .venv/bin/torchrun --nproc_per_node 2 --max-restarts 1 examples/dcp_user.py --steps 14 --kill-at 10 \\
        --tier tiered --host /dev/shm/dcp-user --store file:///tmp/dcp-user-store --out /tmp/dcp-user-out

With the peer tier (`--tier peer`: host + 1 peer copy + store, each rank its own node; `--wipe-host`: the
killed rank comes back with empty shared memory and reads its slots from its peer's host memory):

    .venv/bin/torchrun --nproc_per_node 2 --max-restarts 1 examples/dcp_user.py --steps 12 --kill-at 9 \
        --tier peer --wipe-host --host /dev/shm/dcp-user --store file:///tmp/dcp-user-store

The model and its deterministic iteration come from the test harness (FSDP2, or HSDP with --hsdp 2; on the GPUs
with NCCL when CUDA is there, batches on the model's device); any loop that keeps a replay record per iteration
(batch, gradient norm, LR, RNG state, loss) works the same.
`--kill-at N`: rank 1 SIGKILLs itself in iteration N (first attempt only); torchrun restarts every rank,
they agree on the newest window every rank can read and convert it to dense, then training goes on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

import torchmoe_ckpt as tmc
from torchmoe_harness.trainer import RunConfig, Trainer


def node_dir(args) -> str:
    """This rank's node-local shared memory. With the peer tier each rank plays its own node (a failure
    domain: `--ranks-per-node 1`), so wiping one directory is what a restarted node would find."""
    return f"{args.host}/node-{dist.get_rank()}" if args.tier == "peer" else args.host


def tier_writer(args, path: str, placement) -> dcp.StorageWriter:
    """The storage writer of one slot: host shared memory, the object store, both (tiered), or all three with
    the peer tier (host copy, r peer copies placed by failure domain, the store)."""
    if args.tier == "peer":
        host = f"{node_dir(args)}/{path}"
        return tmc.TieredWriter(
            [tmc.HostWriter(host), tmc.PeerWriter(host, placement), tmc.StoreWriter(f"{args.store}/{path}")]
        )
    if args.tier == "host":
        return tmc.HostWriter(f"{args.host}/{path}")
    if args.tier == "store":
        return tmc.StoreWriter(f"{args.store}/{path}")
    return tmc.TieredWriter([tmc.HostWriter(f"{args.host}/{path}"), tmc.StoreWriter(f"{args.store}/{path}")])


def tier_reader(args, path: str) -> dcp.StorageReader:
    """Fastest first: host memory, then the store (a missing or corrupt copy falls through). The peer tier
    reads this node's memory, fetching from a peer's host memory what this node lost (no store)."""
    if args.tier == "peer":
        host = f"{node_dir(args)}/{path}"
        return tmc.TieredReader([tmc.HostReader(host), tmc.PeerReader(host)])
    readers = {"host": [tmc.HostReader(f"{args.host}/{path}")], "store": [tmc.StoreReader(f"{args.store}/{path}")]}
    return tmc.TieredReader(readers["host"] + readers["store"] if args.tier == "tiered" else readers[args.tier])


def newest_window(args, schedule: tmc.SparseSchedule) -> int | None:
    """The newest window every rank committed (its manifest is written with the window's last slot) on some tier
    it reads, agreed by all ranks."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    if args.tier == "peer":  # complete when some node holds each rank's committed copy
        held = {
            (w, src)
            for w in range(args.steps // schedule.window + 1)
            for src in tmc.held_copies(
                f"{node_dir(args)}/{schedule.slot_name(schedule.first_step + w * schedule.window)}"
            )
        }
        every: list = [None] * ws
        dist.all_gather_object(every, held)
        union = set().union(*every)
        ok = [w for w in range(args.steps // schedule.window + 1) if all((w, r) in union for r in range(ws))]
        return max(ok) if ok else None
    bases = {"host": [args.host], "store": [args.store], "tiered": [args.host, args.store]}[args.tier]
    mine = set().union(*(tmc.committed_windows(b, rank=rank) for b in bases))
    every = [None] * ws
    dist.all_gather_object(every, mine)
    common = set.intersection(*every)
    return max(common) if common else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--hsdp", type=int, default=1)
    ap.add_argument("--tier", choices=("host", "store", "tiered", "peer"), default="host")
    ap.add_argument(
        "--wipe-host",
        action="store_true",
        help="peer tier: the killed rank's node comes back with empty shared memory (its host copies are gone)",
    )
    ap.add_argument("--host", default="/dev/shm/dcp-user")
    ap.add_argument("--store", default="file:///tmp/dcp-user-store")
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--stop-at", type=int, default=0, help="exit cleanly after this iteration (a stopped job)")
    ap.add_argument("--resume", action="store_true", help="recover from the tiers before training")
    ap.add_argument("--out", default="")
    ap.add_argument("--optimizer", default="adamw", help="torchmoe_harness.optimizers.KINDS, e.g. muon-adamw, sgd")
    args = ap.parse_args()
    rank, _ = tmc.init_process_group()
    trainer = Trainer(RunConfig(steps=args.steps, dtype="bf16", hsdp=args.hsdp, optimizer_kind=args.optimizer))
    # collective; slots hold the optimizer state as it is (any keys and dtypes; several optimizers at once)
    schedule = tmc.SparseSchedule(trainer.model, args.window, trainer.compute_dtype, optimizer=trainer.optimizer)
    # r=1 copy of each rank's slot on another failure domain, HSDP replicas first
    placement = tmc.place_replicas(tmc.Topology.from_mesh_shape(dist.get_world_size(), args.hsdp, 1), r=1)
    losses: dict[int, torch.Tensor] = {}
    start = 1
    if args.wipe_host and rank == 1 and tmc.restart_attempt() > 0:
        shutil.rmtree(node_dir(args), ignore_errors=True)
        print(f"rank {rank}: host memory wiped", flush=True)
    if args.resume or tmc.restart_attempt() > 0:
        wid = newest_window(args, schedule)
        if wid is not None:
            readers: list = []

            def reader_for(s: int) -> dcp.StorageReader:
                readers.append(tier_reader(args, schedule.slot_name(s)))
                return readers[-1]

            try:
                window = tmc.load_sparse_window(schedule, wid, reader_for)
            except (tmc.CorruptItemError, CheckpointException) as exc:  # DCP raises it on every rank (collective)
                if wid == 0:
                    raise
                if rank == 0:  # no tier holds a verified copy of a slot: the previous window is still whole
                    print(
                        f"window {wid} is unusable ({' '.join(str(exc).split())[:300]}); falling back to window "
                        f"{wid - 1}",
                        flush=True,
                    )
                wid, readers[:] = wid - 1, []
                window = tmc.load_sparse_window(schedule, wid, reader_for)
            fetched = {
                k: v for r in readers for p in getattr(r, "readers", [r]) for k, v in getattr(p, "fetched", {}).items()
            }
            if fetched:
                print(
                    f"rank {rank} fetched the copies of ranks {sorted(fetched)} from peers "
                    f"{sorted(set(fetched.values()))}",
                    flush=True,
                )
            report = tmc.sparse_to_dense(trainer, window)  # replays the window with frozen operators
            start = report.recovered_step + 1
            if rank == 0:
                print(
                    f"recovered window {wid}: state after iteration {report.recovered_step}, "
                    f"{report.replayed_iterations} replayed",
                    flush=True,
                )
    for step in range(start, args.steps + 1):
        if step == args.kill_at and rank == 1 and tmc.restart_attempt() == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a real crash in the middle of the run
        res = trainer.train_step()
        losses[step] = res.loss
        # What replay needs: the batch, gradient norm, every param group's LR and hyper-parameters (of every
        # optimizer), the loss, and the RNG state (CPU and, on a GPU, the GPU's).
        record = tmc.IterationRecord(
            res.step,
            res.tokens,
            res.grad_norm,
            res.lr,
            res.loss,
            res.rng_state,
            lrs=res.lrs,
            hyper=res.hyper,
            device_rng=res.device_rng,
        )
        model_sd, optim_sd = get_state_dict(trainer.model, tmc.optimizer_list(trainer.optimizer))
        # The only change a DCP user makes: our planner (this iteration's slot) and our storage writer.
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            planner=tmc.SparseSavePlanner(schedule, step, record),
            storage_writer=tier_writer(args, schedule.slot_name(step), placement),
        )
        wid, slot, _ = schedule.locate(step)
        if slot == schedule.window - 1 and wid >= 2 and (rank == 0 or args.tier == "peer") and args.tier != "store":
            shutil.rmtree(f"{node_dir(args)}/window-{wid - 2:06d}", ignore_errors=True)  # keep the last two windows
        if step == args.stop_at:
            break
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        host_losses = {s: loss.detach().cpu() for s, loss in losses.items()}
        torch.save({"state": trainer.export_state(), "losses": host_losses}, Path(args.out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
