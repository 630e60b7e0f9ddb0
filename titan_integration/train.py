"""Launcher for TorchTitan 0.3.0's real trainer with our config registry (and CPU mode without CUDA).

Run under torchrun::

    torchrun --standalone --nproc_per_node 2 -m titan_integration.train [torchtitan args...]

* Without ``--module``/``--config`` it uses ``--module titan_integration.config_registry
  --config deepseek_v3_tiny``. Any other TorchTitan flag (``--training.steps 6``,
  ``--dump_folder DIR``, ``--checkpoint.enable`` ...) is passed through unchanged.
* Without CUDA it calls :func:`titan_integration.cpu_mode.enable_cpu_mode` before torchtitan is
  imported (``TORCHMOE_TITAN_CPU=1`` forces it, ``=0`` disables it).
* It makes sure the offline assets exist, and checks the module/config names first, so a typo
  gives one ``error: ...`` line and exit status 2 instead of a traceback.

* ``--config job.toml``: a TOML job file (see :mod:`titan_integration.job_toml`), including a
  ``[sparse_checkpoint]`` section that turns on sparse per-iteration checkpointing and recovery
  (:mod:`titan_integration.sparse_trainer`). The whole file is checked before training (unknown
  sections/keys, bad values, an object store that cannot be reached): one ``error: ... fix: ...``
  line and exit status 2. Later ``--section.option`` flags still override the file.
* ``--sparse_checkpoint.KEY VALUE`` flags (:mod:`titan_integration.sparse_cli`) override the job file's
  ``[sparse_checkpoint]``, or, without a job file, go into the ``--override.imports`` entry (added if absent).
* Every ``[sparse_checkpoint]`` value (however given) is checked first, before CPU mode and TorchTitan are
  imported: its values, the host directory (created, probe-written), the on-store format and the object
  store (probe-written in torchrun's first attempt; a restart only opens it). A problem is one
  ``error: ... fix: ...`` line, exit status 2, on every rank.
* Before TorchTitan is imported, every process group this process will create gets a store of its rendezvous
  round (:func:`torchmoe_ckpt.runtime.distributed.key_rendezvous_by_attempt`): a restart must not read the previous
  round's rendezvous keys (the cause of "Gloo connectFullMesh failed" on restart).
* ``TORCHMOE_STANDBY=1``: the first attempt forks a pre-imported standby per rank, and a restarted worker hands
  itself over to it instead of importing torch and TorchTitan again (:mod:`titan_integration.standby`).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings

from titan_integration.sparse_cli import SPARSE_ENV, merge_into_override, override_section, split_args
from titan_integration.sparse_config import DeprecatedKeyWarning, JobConfigError  # neither imports torch/TorchTitan

DEFAULT_MODULE = "titan_integration.config_registry"
DEFAULT_CONFIG = "deepseek_v3_tiny"
TOML_MODULE = "titan_integration.job_toml"
TOML_FUNCTION = "from_toml"


class UsageError(Exception):
    """A problem the user fixes by changing the command line or environment (one-line message)."""


def _get_opt(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name:
            if i + 1 >= len(args):
                raise UsageError(f"{name} requires a value")
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _drop_opt(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def _first_attempt() -> bool:
    """Probe-write the object store only in torchrun's first attempt: a restart has the same settings, already
    probed, and waits for nothing but training (an outage during the run is the uploader's to report)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def check_job_file(path: str, sparse_args: dict | None = None) -> None:
    """Everything that can be checked before TorchTitan is imported: TOML syntax, sections, the
    [sparse_checkpoint] section with the ``--sparse_checkpoint.*`` flags over it (handed on to the loader in
    ``$TORCHMOE_TITAN_SPARSE_ARGS``), the host directory, the format and the object store."""
    from titan_integration.job_toml import check_sections, read_job, sparse_section

    os.environ[SPARSE_ENV] = json.dumps(sparse_args or {})
    try:
        job = read_job(path)
        check_sections(job)
        sparse_section(job).check_resources(probe=_first_attempt())
    except JobConfigError as e:
        raise UsageError(str(e)) from e


def check_sparse_args(argv: list[str], values: dict) -> list[str]:
    """Without a job file: the ``--sparse_checkpoint.*`` values into our override's JSON, then that section
    checked like a job file's (values, host directory, format, store). Returns the new argv."""
    try:
        argv = merge_into_override(argv, values)
        section = override_section(argv)
        if section is not None:
            section.check_resources(probe=_first_attempt())
    except JobConfigError as e:
        raise UsageError(str(e)) from e
    return argv


def resolve_args(argv: list[str]) -> list[str]:
    """Add the default ``--module``/``--config`` when missing. Returns the new argv."""
    args = list(argv)
    module = _get_opt(args, "--module")
    config = _get_opt(args, "--config")
    if config is not None and config.endswith(".toml"):
        if module is not None:
            raise UsageError(
                f"--module {module} cannot be combined with a job file (--config {config}); fix: drop --module"
            )
        from titan_integration.job_toml import JOB_ENV

        os.environ[JOB_ENV] = os.path.abspath(config)
        args = _drop_opt(args, "--config")
        return ["--module", TOML_MODULE, "--config", TOML_FUNCTION] + args
    if module is None:
        args = ["--module", DEFAULT_MODULE] + args
    if config is None:
        args = ["--config", DEFAULT_CONFIG] + args
    return args


def want_cpu_mode() -> bool:
    env = os.environ.get("TORCHMOE_TITAN_CPU")
    if env is not None:
        return env not in ("0", "false", "no", "")
    import torch

    return not torch.cuda.is_available()


def _config_functions(module) -> list[str]:
    return sorted(
        n
        for n in dir(module)
        if not n.startswith("_")
        and n[0].islower()
        and callable(getattr(module, n))
        and getattr(getattr(module, n), "__module__", None) == module.__name__
    )


def validate(args: list[str]) -> None:
    """Import the config module and check the config function exists (one-line errors)."""
    from titan_integration.assets import AssetError, ensure_assets

    module_name = _get_opt(args, "--module")
    config_name = _get_opt(args, "--config")
    assert module_name is not None and config_name is not None
    if module_name == TOML_MODULE:
        import logging

        from titan_integration.job_toml import JOB_ENV, load_job

        logging.disable(logging.WARNING)  # config-construction warnings are repeated by the real run
        try:
            ensure_assets()
            config = load_job(os.environ[JOB_ENV])  # unknown keys in TorchTitan's sections, model flavour, ...
            from titan_integration.tensor_parallel import check_tensor_parallel_job
            from titan_integration.titan_pipeline_recovery import check_pipeline_job

            world = int(os.environ.get("WORLD_SIZE", "1"))
            check_pipeline_job(config, config.sparse_checkpoint, world)
            check_tensor_parallel_job(config, config.sparse_checkpoint, world)
        except (AssetError, JobConfigError) as e:
            raise UsageError(str(e)) from e
        finally:
            logging.disable(logging.NOTSET)
        return
    if module_name == DEFAULT_MODULE:
        try:
            ensure_assets()
        except AssetError as e:
            raise UsageError(str(e)) from e
    # Same resolution order as torchtitan.config.manager.ConfigManager._load_config.
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    if module_name in _supported_models | _supported_experiments:
        candidates = [
            f"{prefix}.{module_name}.config_registry"
            for prefix in (
                "torchtitan.models",
                "torchtitan.experiments",
                "torchtitan.experiments.rl.examples",
            )
        ]
    else:
        candidates = [f"{module_name}.config_registry", module_name]
    module = None
    for candidate in candidates:
        try:
            module = importlib.import_module(candidate)
            break
        except ModuleNotFoundError as e:
            if e.name is None or not candidate.startswith(e.name):
                raise  # the module exists but one of *its* imports is missing: show the real error
    if module is None:
        raise UsageError(
            f"--module {module_name}: no such module; fix: use --module {DEFAULT_MODULE} "
            f"or a TorchTitan model name ({', '.join(sorted(_supported_models))})"
        )
    fn = getattr(module, config_name, None)
    if not callable(fn):
        raise UsageError(
            f"unknown config '{config_name}' in {module.__name__}; fix: use --config one of "
            f"{', '.join(_config_functions(module))}"
        )


def _say_deprecated_keys_once() -> None:
    """An old [sparse_checkpoint] key name is one ``warning: ...`` line, once per process (the section is read by
    the launcher's checks and again by TorchTitan's ConfigManager)."""
    warnings.filterwarnings("once", category=DeprecatedKeyWarning)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DeprecatedKeyWarning):
            print(f"warning: {message}", file=sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _say_deprecated_keys_once()
    from titan_integration import standby

    handed = standby.hand_over(argv)  # a restarted worker: its rank's pre-imported standby trains instead
    if handed is not None:
        return handed
    # Offline by default (set before datasets/huggingface_hub are imported).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.pop(SPARSE_ENV, None)
    try:
        try:
            argv, sparse_args = split_args(argv)  # --sparse_checkpoint.KEY VALUE: not TorchTitan's (tyro's) flags
        except JobConfigError as e:
            raise UsageError(str(e)) from e
        config = _get_opt(argv, "--config")
        if config is not None and config.endswith(".toml"):
            check_job_file(config, sparse_args)
        else:
            argv = check_sparse_args(argv, sparse_args)
        args = resolve_args(argv)
        cpu_mode = want_cpu_mode()
        if cpu_mode:
            from titan_integration.cpu_mode import enable_cpu_mode

            enable_cpu_mode()
        validate(args)
    except UsageError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            # Every rank finds the same problem; let rank 0 exit first, so torchrun does not stop it (SIGTERM)
            # before it has printed the one line. torchrun ends this rank as soon as rank 0 has exited.
            import time

            time.sleep(10)
        return 2

    if cpu_mode and _get_opt(args, "--module") not in (DEFAULT_MODULE, TOML_MODULE):
        # Stock TorchTitan configs don't carry the CPU settings: prepend them as flags (later
        # user flags still win).
        from titan_integration.cpu_mode import cpu_cli_flags

        args = cpu_cli_flags(expert_parallel_degree=2) + args

    from torchmoe_ckpt.runtime.distributed import key_rendezvous_by_attempt

    key_rendezvous_by_attempt()  # before TorchTitan's init_distributed: a restart must not read stale store keys
    import torchtitan.train

    from titan_integration import pipeline_compat
    from torchmoe_ckpt import HostMemoryLimitError, IdentityMismatch, RunLockedError, UnusableCheckpointError

    pipeline_compat.install()
    from titan_integration import restart_timing

    standby.start(main)  # first attempt, TORCHMOE_STANDBY=1: fork this rank's standby, every import done
    restart_timing.mark("titan_main")  # every import and check done: TorchTitan's own start from here
    sys.argv = [sys.argv[0]] + args
    try:
        torchtitan.train.main()
    except (IdentityMismatch, RunLockedError, UnusableCheckpointError, HostMemoryLimitError) as e:
        # another run's windows, another job on this run, every window rejected, more host memory than allowed
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    if "RANK" in os.environ:
        # Training finished and every result is written. Leave without running interpreter teardown: gloo's
        # C++ threads occasionally abort the process at exit ("terminate called without an active
        # exception"), which torchrun would report as a failed worker (same as torchmoe_harness.worker).
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
