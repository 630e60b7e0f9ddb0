"""torchrun entry point: train the tiny MoE with a *stock* torch.distributed.pipelining schedule whose
stages log their sends (pipeline.stock.LoggingPipelineStage), and record what each stage actually
received, so a test can check the logs entry by entry against the receivers (torch.equal).

Spec: "run" (RunConfig), "schedule": gpipe | 1f1b | interleaved1f1b, "stages_per_rank" (2 for
interleaved), "microbatches", "log_root", "steps".
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from torchmoe_ckpt.pipeline.boundary_log import BoundaryLog
from torchmoe_ckpt.pipeline.stock import LoggingPipelineStage
from torchmoe_harness.data import TokenStream
from torchmoe_harness.pipeline_trainer import PipelineConfig, build_stage, stage_forward
from torchmoe_harness.trainer import RunConfig
from torchmoe_harness.worker import leave, start, write_report

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}


class StageModule(nn.Module):
    """One stage of the tiny MoE; records the inputs it received and the output gradients it received."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model
        self.received_inputs: list[torch.Tensor] = []
        self.received_grads: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and not x.is_meta:
            self.received_inputs.append(x.detach().clone())
        out = stage_forward(self.m, x)
        if out.requires_grad and self.m.output is None and not out.is_meta:
            out.register_hook(lambda g: self.received_grads.append(g.detach().clone()))
        return out


def run(spec: dict, out: Path) -> dict:
    cfg = RunConfig(**spec["run"])
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = int(spec.get("stages_per_rank", 1))
    n_stages = world * per_rank
    m = int(spec.get("microbatches", 2))
    pp = PipelineConfig(stages=n_stages, microbatches=m, schedule="gpipe")
    pp.validate(cfg)
    stage_ids = [rank + k * world for k in range(per_rank)]  # interleaved: loop placement, as TorchTitan
    mb_b, s, d = cfg.batch_size // m, cfg.seq_len, cfg.model.dim
    modules, stages = [], []
    for sid in stage_ids:
        mod = StageModule(build_stage(cfg, pp, sid))
        example = torch.zeros(mb_b, s, dtype=torch.long) if sid == 0 else torch.zeros(mb_b, s, d)
        logdir = Path(spec["log_root"]) / f"stage-{sid}"
        stages.append(
            LoggingPipelineStage(
                mod, sid, n_stages, torch.device("cpu"), input_args=example, boundary_log=BoundaryLog(logdir)
            )
        )
        modules.append(mod)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

    kind = SCHEDULES[spec["schedule"]]
    sched = kind(stages if per_rank > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)
    stream = TokenStream(cfg.model.vocab_size, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    for it in range(1, int(spec.get("steps", 2)) + 1):
        for st in stages:
            st.iteration = it
        tokens = stream.batch(it, 0)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        args = (x,) if 0 in stage_ids else ()
        kwargs = {"target": y} if n_stages - 1 in stage_ids else {}
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for st in stages:
        st.boundary_log.flush()
    n = int(spec.get("steps", 2)) * m
    for sid, mod in zip(stage_ids, modules):
        # The stage's shape inference runs one forward on an uninitialised buffer before the first
        # micro-batch: keep the last steps x microbatches (forwards and backwards run in micro-batch order).
        torch.save(
            {
                "inputs": mod.received_inputs[-n:],
                "grads": mod.received_grads[-n:],
                "extra_inputs": len(mod.received_inputs) - n,
            },
            Path(out) / f"received-{sid}.pt",
        )
    return {"stages": n_stages, "log": {sid: st.boundary_log.stats() for sid, st in zip(stage_ids, stages)}}


def main() -> None:
    spec, out = start()
    rep = run(spec, out)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, rep)
    merged = {"stages": rep["stages"], "log": {k: v for r in reports for k, v in r["log"].items()}}
    write_report(out / "report.json", merged)
    leave()


if __name__ == "__main__":
    main()
