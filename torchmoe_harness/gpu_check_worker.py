"""torchrun worker of the GPU check's recovery phases (gpu_check_recovery.py): one rank trains the check model --
the harness TinyMoE under FSDP2, with dropout (so the device RNG shapes every step) and an L2 penalty on the
embedding in the loss (one large reduction, whose rounding follows the thread count on a CPU) -- through the
own-loop `Checkpointer`, or through the same loop without it ("plain": the reference, and the sync baseline).
Faults are real `kill -9`s armed with TORCHMOE_FAULT; torchrun restarts the worker and `resume()` recovers from the
host tier.

    torchrun --nproc_per_node 1 --max-restarts N -m torchmoe_harness.gpu_check_worker --spec spec.json --out DIR

Spec: "device" ("cuda" | "cpu"), "dtype", "model" (TinyMoEConfig fields), "steps", "batch_size", "seq_len", "seed",
"dropout", "l2", "mode" ("plain" | "checkpointed"), "window", "replay_check", "deterministic" (kernels; CUDA also
needs CUBLAS_WORKSPACE_CONFIG in the environment), "threads" (intra-op threads by attempt, CPU), "host_dir",
"run_id". Writes attempt{a}.json per attempt, and rank0.pt (every state tensor incl. the RNG states, this attempt's
losses) at the end; a refusal (a TorchmoeError at start or in resume) writes refused.json and exits 2."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

T_START = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import torchmoe_ckpt as tmc  # noqa: E402
from torchmoe_ckpt.core.errors import TorchmoeError  # noqa: E402
from torchmoe_harness.data import TokenStream  # noqa: E402
from torchmoe_harness.gpu_check_syncs import SyncCounter  # noqa: E402
from torchmoe_harness.model import TinyMoE, TinyMoEConfig  # noqa: E402
from torchmoe_harness.parallel import apply_fsdp, build_mesh  # noqa: E402
from torchmoe_harness.trainer import DTYPES, training_state  # noqa: E402

MAX_NORM = 1.0


def _dropout(p: float):
    def hook(module, args, output):
        return F.dropout(output, p, module.training)

    return hook


class CheckModel:
    """The model, optimizer, schedule and step function of the check, built the same way in every process."""

    def __init__(self, spec: dict, device: torch.device):
        cfg = TinyMoEConfig(**spec["model"])
        model = TinyMoE(cfg)
        model.init_weights(spec["seed"])  # on the CPU: the same weights on any device
        model.to(device)
        p = spec.get("dropout", 0.0)
        if p:  # after the embedding and every attention: dropout draws from the device's default generator
            model.tok_embeddings.register_forward_hook(_dropout(p))
            for block in model.layers.values():
                block.attention.register_forward_hook(_dropout(p))
        self.l2, self.penalty = spec.get("l2", 0.0), None
        if self.l2:  # read in forward, where FSDP2 has the full weight in hand
            model.tok_embeddings.register_forward_hook(self._penalise)
        apply_fsdp(model, build_mesh(1, 1, device.type), DTYPES[spec["dtype"]])
        self.model = model
        self.params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 4))
        self.stream = TokenStream(cfg.vocab_size, spec["seq_len"], spec["batch_size"], seed=spec["seed"])
        self.device = device

    def _penalise(self, module, args, output) -> None:
        self.penalty = self.l2 * module.weight.float().pow(2).sum()

    def batch(self, step: int) -> torch.Tensor:
        return self.stream.batch(step, 0).to(self.device, non_blocking=True)

    def forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        if self.penalty is not None:
            loss, self.penalty = loss + self.penalty, None
        loss.backward()
        return loss

    def plain_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """What `Checkpointer.step` does to the training state, without the checkpointer."""
        loss = self.forward_backward(tokens)
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        torch.nn.utils.clip_grads_with_norm_(self.params, MAX_NORM, norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """Every tensor of the training state (host copies: parameters, optimizer state, buffers, LR, step), the
        schedule's position, and the RNG states the next step would draw from."""
        out = training_state(self.model, self.optimizer, step)
        out["sched/last_epoch"] = torch.tensor(self.scheduler.last_epoch)
        out["rng/cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            out["rng/cuda"] = torch.cuda.get_rng_state(self.device)
        return out


def _refuse(out: Path, attempt: int, where: str, exc: BaseException) -> None:
    line = " ".join(str(exc).split())
    rec = {"attempt": attempt, "where": where, "error": type(exc).__name__, "line": line}
    rec["seconds_since_start"] = time.perf_counter() - T_START
    (out / "refused.json").write_text(json.dumps(rec, indent=1))
    print(f"gpu-check worker: refused ({where}): {type(exc).__name__}: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


def run(spec: dict, out: Path) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    threads = spec.get("threads")
    if threads:
        torch.set_num_threads(threads[min(attempt, len(threads) - 1)])
    if spec.get("deterministic"):
        torch.use_deterministic_algorithms(True)
    tmc.init_process_group(timeout_s=spec.get("timeout_s", 120))
    device = torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" else torch.device("cpu")
    m = CheckModel(spec, device)
    torch.manual_seed(spec["seed"])  # every device's generator: dropout draws the same in every run (and replay)
    rec: dict = {"attempt": attempt, "threads": torch.get_num_threads(), "device": str(device)}
    losses: dict[int, torch.Tensor] = {}
    counter = SyncCounter(enabled=device.type == "cuda")
    ckpt = None
    if spec["mode"] == "checkpointed":
        config = tmc.CheckpointConfig(
            tiers=tmc.TierConfig(root=spec["host_dir"], run_id=spec["run_id"]),
            window=tmc.SparseConfig(window=spec["window"]),
            max_grad_norm=MAX_NORM,
            replay_check=spec.get("replay_check", "exact"),
        )
        try:
            ckpt = tmc.Checkpointer(m.model, m.optimizer, m.forward_backward, m.scheduler, config)
        except TorchmoeError as exc:  # e.g. "exact" on CUDA without deterministic kernels: refused up front
            _refuse(out, attempt, "start", exc)
        t0 = time.perf_counter()
        try:
            start = ckpt.resume()
        except TorchmoeError as exc:  # every window refused (a replay that is not bit for bit, under "exact")
            _refuse(out, attempt, "resume", exc)
        rec["resume_seconds"] = time.perf_counter() - t0
        rec["recovery"] = ckpt.stats()["recovery"]
        step_fn = ckpt.step
    else:
        start, step_fn = 0, m.plain_step
    rec["start_step"], rec["first_step_at_s"] = start, time.perf_counter() - T_START
    (out / f"attempt{attempt}.json").write_text(json.dumps(rec, indent=1, default=str))
    with counter:
        for step in range(start + 1, spec["steps"] + 1):
            counter.step = step
            losses[step] = step_fn(m.batch(step))
            rec["syncs"] = counter.report()  # after every step: a kill must not take the counts so far with it
            (out / f"attempt{attempt}.json").write_text(json.dumps(rec, indent=1, default=str))
    if ckpt is not None:
        rec["waits_s"] = ckpt.sparse.engine.waits[-64:]
        rec["checkpoint"] = {k: v for k, v in ckpt.stats().items() if k != "recovery"}
        ckpt.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rec["syncs"] = counter.report()
    rec["seconds"] = time.perf_counter() - T_START
    (out / f"attempt{attempt}.json").write_text(json.dumps(rec, indent=1, default=str))
    torch.save(
        {"state": m.state(spec["steps"]), "losses": {s: v.to("cpu") for s, v in losses.items()}}, out / "rank0.pt"
    )


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    run(json.loads(Path(args.spec).read_text()), Path(args.out))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo teardown (its threads occasionally abort at exit after the results are written)


if __name__ == "__main__":
    main()
