"""Expert parallelism (EP) for the harness model: each rank owns num_experts / world experts whole, and the
tokens, not the weights, move between ranks (as in real MoE training; FSDP2 would all-gather every expert
and reduce-scatter its gradient every step).

`ExpertDispatch` is installed on each GroupedExperts by `parallel.apply_expert_parallel`. One call: exchange
the per-expert token counts, send each token to the rank owning its expert (differentiable all_to_all, whose
backward sends the input gradients home), run the local experts on their rank-local shards in the compute
dtype, send the results back. Deterministic: the received rows are regrouped by (local expert, source rank)
with a permutation computed from the counts alone, so every execution, replay included, runs the same
matmuls on the same rows in the same order."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from torchmoe_harness.model import expert_mlp

WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def _by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Rows arrive grouped by (source rank, local expert) with `counts[s, e]` rows each: the permutation that
    orders them by (local expert, source rank)."""
    flat = counts.reshape(-1)
    start = torch.cumsum(flat, 0) - flat  # where segment (s, e) begins in the received rows
    lens = counts.t().reshape(-1)  # segments in (e, s) order
    starts = start.view(counts.shape).t().reshape(-1)
    first = torch.cumsum(lens, 0) - lens  # where each lands in the (e, s) order
    total = int(flat.sum())
    return torch.arange(total) + torch.repeat_interleave(starts - first, lens)


class ExpertDispatch:
    """The EP forward of one GroupedExperts (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, compute_dtype: torch.dtype):
        self.group = group
        self.world = dist.get_world_size(group)
        # What FSDP2's MixedPrecisionPolicy(param_dtype) does to a sharded parameter before use: `.to(dtype)`.
        # Frozen-operator replay loads compute weights into the fp32 masters, and this cast gives them back.
        self.compute_dtype = compute_dtype

    def _exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        # The differentiable all_to_all (torch.distributed.nn.functional.all_to_all_single's non-deprecated
        # successor): its backward sends the gradients back along the reverse splits.
        return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, self.group))

    def __call__(self, experts: nn.Module, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        world, local_n = self.world, len(counts) // self.world
        send = torch.tensor(counts, dtype=torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[s * local_n + e]: rank s's rows for my e
        recv = recv.view(world, local_n)
        send_splits = send.view(world, local_n).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        got = self._exchange(x_sorted, recv_splits, send_splits)
        perm = _by_expert(recv)
        w = [getattr(experts, n).to_local().to(self.compute_dtype) for n in WEIGHTS]
        first = dist.get_rank(self.group) * local_n  # this rank owns experts first .. first + local_n - 1
        frozen = frozenset(e - first for e in experts.frozen if first <= e < first + local_n)
        y = expert_mlp(got[perm], recv.sum(0).tolist(), *w, frozen)
        back = y[torch.argsort(perm)]  # back to (source rank, expert) order
        return self._exchange(back, send_splits, recv_splits)
