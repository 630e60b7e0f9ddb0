"""TorchTitan 0.3.0 CPU mode: the real Trainer on 2 gloo ranks under torchrun (no mocks).

Run: ``pytest tests/titan_glue/test_titan_cpu.py`` (about 60 s on 2 cores). Each test starts real
``torchrun`` / ``python -m`` subprocesses; skipped when torchtitan is not installed.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from titan_integration import demo  # cheap: does not import torchtitan

pytestmark = pytest.mark.titan  # starts TorchTitan: not in make test-fast

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    e = demo.child_env()
    # Hermetic assets: generated (deterministically, < 1 s) into this test session's tmp dir.
    e["TORCHMOE_TITAN_ASSETS"] = str(tmp_path_factory.mktemp("titan-assets"))
    return e


def _torchrun_train(tmp_path: Path, env: dict[str, str], *args: str) -> list[demo.StepRecord]:
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + [
        "--standalone", "--nproc_per_node", "2", "--tee", "3", "--local-ranks-filter", "0",
        "-m", "titan_integration.train",
        "--dump_folder", str(tmp_path / "dump"),
        *args,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=55
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [demo._RANK_PREFIX.sub("", ln) for ln in proc.stdout.splitlines()]
    return demo.parse_steps(lines)


@pytest.mark.timeout(60)
def test_tiny_flavour_trains_3_steps_on_2_ranks(tmp_path, env):
    # Default --module/--config come from the launcher (titan_integration.config_registry / deepseek_v3_tiny).
    records = _torchrun_train(tmp_path, env, "--training.steps", "3")
    assert [r.step for r in records] == [1, 2, 3]
    losses = [r.loss for r in records]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses  # lr 3e-3 on a tiny synthetic corpus: drops every step
    assert all(math.isfinite(r.grad_norm) for r in records)


@pytest.mark.matrix  # test_override_imports_on_stock_trainer_equals_job_file_run compares two runs exactly
@pytest.mark.timeout(60)
def test_two_identical_runs_give_identical_losses(tmp_path, env):
    args = ("--training.steps", "3", "--debug.seed", "7", "--debug.deterministic")
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        runs.append(_torchrun_train(tmp_path / name, env, *args))
    a, b = runs
    assert len(a) == len(b) == 3
    assert [(r.loss, r.grad_norm) for r in a] == [(r.loss, r.grad_norm) for r in b]


@pytest.mark.timeout(60)
def test_unknown_config_gives_one_clear_error_line(tmp_path, env):
    # Directly (no torchrun): exactly one line on stderr, exit status 2.
    proc = subprocess.run(
        [sys.executable, "-m", "titan_integration.train", "--config", "no_such_config"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=55,
    )  # fmt: skip
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(err) == 1, proc.stderr
    assert err[0].startswith("error: unknown config 'no_such_config'")
    assert "deepseek_v3_tiny" in err[0]  # names the fix
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.matrix
@pytest.mark.timeout(60)
def test_demo_unknown_config_under_torchrun_is_one_line(tmp_path, env):
    # Through the demo (real torchrun, 2 ranks): torchrun's failure report is suppressed.
    proc = subprocess.run(
        [sys.executable, "-m", "titan_integration.demo", "--quiet", "--config", "nope",
         "--dump-folder", str(tmp_path / "dump")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=55,
    )  # fmt: skip
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0
    assert len(err) == 1, proc.stderr
    assert err[0].startswith("error: unknown config 'nope'") and "deepseek_v3_tiny" in err[0]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_assets_are_deterministic(tmp_path, monkeypatch):
    from titan_integration import assets

    digests = []
    for name in ("one", "two"):
        monkeypatch.setenv("TORCHMOE_TITAN_ASSETS", str(tmp_path / name))
        a = assets.ensure_assets()
        assert a.root.is_absolute() and a.complete()
        files = [a.tokenizer_dir / "tokenizer.json", a.tokenizer_dir / "tokenizer_config.json", a.dataset_file]
        digests.append([f.read_bytes() for f in files])
    assert digests[0] == digests[1]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "one" / assets.ASSETS_VERSION / "tokenizer" / "tokenizer.json"))
    assert tok.get_vocab_size() <= assets.TOKENIZER_VOCAB_SIZE
    assert tok.token_to_id(assets.BOS) is not None and tok.token_to_id(assets.EOS) is not None


def test_demo_summary_parser():
    lines = [
        "[titan] 2026-11-22 19:31:48,989 - root - INFO - Training starts at step 1",
        "[titan] 2026-11-22 19:31:49,608 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  7.61305  "
        "\x1b[38;2;180;60;0mgrad_norm:  1.5009  memory: 0.54GiB(2.31%)  tps: 320",
        "[titan] 2026-11-22 19:31:49,780 - root - INFO - step:  2  loss:  7.41031  grad_norm:  1.5793  tps: 1",
    ]
    recs = demo.parse_steps(lines)
    assert [(r.step, r.loss) for r in recs] == [(1, 7.61305), (2, 7.41031)]
    assert recs[0].seconds == pytest.approx(0.619) and recs[1].seconds == pytest.approx(0.172)
    assert "median step time" in demo.format_summary(recs)


@pytest.mark.timeout(60)
def test_enable_cpu_mode_is_idempotent_and_avoids_triton(env):
    # In a subprocess: the patches are process-global and must not leak into other tests.
    code = (
        "import sys\n"
        "from titan_integration.cpu_mode import enable_cpu_mode, cpu_mode_enabled\n"
        "enable_cpu_mode(); import torch.distributed as d; b = d.barrier\n"
        "enable_cpu_mode(); assert d.barrier is b and cpu_mode_enabled()\n"
        "import torchtitan.trainer, torchtitan.tools.utils as u\n"
        "assert u.device_type == 'cpu', u.device_type\n"
        "assert hasattr(d, 'set_timeout')\n"
        "from torchtitan.models.common.attention import FlexAttention\n"
        "assert FlexAttention._compiled_flex_attn.__name__ == 'cpu_flex_attention'\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('triton') is None: assert 'triton' not in sys.modules\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=55)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "ok"
