"""torchrun entry for tests/runtime/test_library_groups.py: examples/own_loop.py under a default process group
that refuses CPU tensors the way NCCL does.

`init_process_group("cuda:gloo")` registers gloo for the cuda device type only; on this CPU-only torch every
collective on the default group with a CPU tensor then fails ("No backend type associated with device type cpu"),
and every object collective on it fails too (it stages objects on a CUDA device). The model shards over a gloo
group of its own (FSDP2's mesh), as a GPU user's model shards over its NCCL mesh. Everything the library does --
window agreements, operator sizes, the W agreement, routed-token sums, recovery's gathers -- must therefore run on
the library's own group: one collective on the default group fails the run. Writes this rank's final state, its
losses and what it checked about the groups.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchmoe_ckpt.runtime.distributed import key_rendezvous_by_attempt, library_group
from torchmoe_harness.hf_worker import flat_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from own_loop import main


def default_group_refuses_cpu() -> bool:
    try:
        dist.all_reduce(torch.zeros(1))
    except RuntimeError as exc:
        return "No backend type associated with device type cpu" in str(exc)
    return False


if __name__ == "__main__":
    key_rendezvous_by_attempt()  # restart-safe, as tmc.init_process_group would do
    dist.init_process_group("cuda:gloo")
    checks = {"default_refuses_cpu": default_group_refuses_cpu()}
    user = dist.new_group(backend="gloo")  # the user's model group (NCCL on a GPU job)
    mesh = DeviceMesh.from_group(user, "cpu")
    model, optimizer, scheduler, losses = main(sys.argv[1:], mesh=mesh)
    own = library_group()
    checks.update(
        library_group_cached=own is library_group(),
        library_group_is_gloo=dist.get_backend(own) == "gloo",
        library_group_not_default=own is not dist.group.WORLD and own is not user,
        library_group_of_user_group=library_group(user) is own,  # the same ranks: the same group
    )
    state = flat_state({"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()})
    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ["OWN_LOOP_OUT"])
    torch.save({"state": state, "losses": losses, "checks": checks}, out / f"rank{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown (its threads occasionally abort at exit after the results are written)
