"""Offline assets for the tiny TorchTitan runs: a byte-level BPE tokenizer and a c4_test-style dataset.

TorchTitan 0.3.0 ships neither (its debug configs point at ``./tests/assets`` of a source
checkout). :func:`ensure_assets` generates both deterministically (fixed seed, no downloads,
well under a second) into a cache directory and returns absolute paths, so configs work from
any working directory. Safe to call from several ranks at once (file lock + atomic rename).

Cache directory: ``$TORCHMOE_TITAN_ASSETS`` if set, else ``~/.cache/torchmoe-ckpt/titan-assets``.
Layout (``v1`` is bumped whenever the generator changes)::

    <cache>/v1/tokenizer/{tokenizer.json,tokenizer_config.json}
    <cache>/v1/c4_test/data.json            # JSONL rows {"text", "timestamp", "url"}

CLI: ``python -m titan_integration.assets [--force]`` prints the directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AssetError", "TitanAssets", "assets_root", "ensure_assets", "TOKENIZER_VOCAB_SIZE"]

ASSETS_VERSION = "v1"
TOKENIZER_VOCAB_SIZE = 1024  # upper bound incl. special tokens; the tiny model's vocab_size
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
NUM_ROWS = 1000
SEED = 1234


class AssetError(RuntimeError):
    """Raised when the offline assets cannot be found or generated (message names the fix)."""


@dataclass(frozen=True)
class TitanAssets:
    root: Path

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def dataset_dir(self) -> Path:
        return self.root / "c4_test"

    @property
    def dataset_file(self) -> Path:
        return self.dataset_dir / "data.json"

    def complete(self) -> bool:
        return (
            (self.tokenizer_dir / "tokenizer.json").is_file()
            and (self.tokenizer_dir / "tokenizer_config.json").is_file()
            and self.dataset_file.is_file()
        )


def assets_root() -> Path:
    base = os.environ.get("TORCHMOE_TITAN_ASSETS")
    if base:
        root = Path(base).expanduser()
    else:
        root = Path.home() / ".cache" / "torchmoe-ckpt" / "titan-assets"
    return (root / ASSETS_VERSION).absolute()


# ---------------------------------------------------------------------------------------------
# Deterministic synthetic corpus: simple English-like sentences about training MoE models. It
# has enough structure (fixed grammar, Zipf-ish word choice) that the loss visibly drops within
# a handful of steps.
_SUBJECTS = [
    "the model",
    "the router",
    "each expert",
    "the optimizer",
    "a token",
    "the trainer",
    "the checkpoint",
    "every rank",
    "the gradient",
    "the scheduler",
    "the loss",
    "a layer",
]
_VERBS = [
    "sends",
    "updates",
    "stores",
    "reads",
    "routes",
    "saves",
    "loads",
    "averages",
    "balances",
    "selects",
    "computes",
    "restores",
    "shards",
    "writes",
]
_OBJECTS = [
    "the weights",
    "two experts",
    "the next batch",
    "its state",
    "a small shard",
    "the learning rate",
    "the token counts",
    "the expert bias",
    "the moments",
    "the parameters",
    "a snapshot",
    "the logits",
]
_TAILS = [
    "after every step",
    "on each rank",
    "before the backward pass",
    "in fp32",
    "without a GPU",
    "to local disk",
    "when a rank fails",
    "for the next iteration",
    "with gloo",
    "in a few milliseconds",
    "",
    "",
    "",
]


def _sentence(rng: random.Random) -> str:
    def pick(words: list[str]) -> str:
        # Zipf-ish: earlier words are more frequent.
        return words[min(int(rng.paretovariate(1.2)) - 1, len(words) - 1)]

    tail = pick(_TAILS)
    s = f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}" + (f" {tail}" if tail else "")
    return s[0].upper() + s[1:] + "."


def _corpus(rng: random.Random, n_rows: int) -> list[str]:
    return [" ".join(_sentence(rng) for _ in range(rng.randint(8, 24))) for _ in range(n_rows)]


def _write_tokenizer(texts: list[str], out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() > TOKENIZER_VOCAB_SIZE:  # pragma: no cover - trainer guarantees it
        raise AssetError(f"generated tokenizer vocab {tok.get_vocab_size()} > {TOKENIZER_VOCAB_SIZE}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _write_dataset(texts: list[str], out_file: Path) -> None:
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with out_file.open("w") as f:
        for i, text in enumerate(texts):
            row = {
                "text": text,
                "timestamp": f"2019-04-{1 + i % 28:02d}T12:00:00Z",
                "url": f"https://example.invalid/torchmoe-ckpt/{i}",
            }
            f.write(json.dumps(row) + "\n")


def _generate(root: Path) -> None:
    rng = random.Random(SEED)
    texts = _corpus(rng, NUM_ROWS)
    _write_tokenizer(texts, root / "tokenizer")
    _write_dataset(texts, root / "c4_test" / "data.json")


def ensure_assets(force: bool = False) -> TitanAssets:
    """Return the asset paths, generating them first if missing (or ``force``). Raises AssetError."""
    assets = TitanAssets(assets_root())
    if assets.complete() and not force:
        return assets
    parent = assets.root.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        import fcntl

        with open(parent / f".{ASSETS_VERSION}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent ranks: one generates, the others wait
            if assets.complete() and not force:
                return assets
            tmp = Path(tempfile.mkdtemp(prefix=f".{ASSETS_VERSION}-", dir=parent))
            try:
                _generate(tmp)
                os.chmod(tmp, 0o755)  # mkdtemp creates 0700
                if assets.root.exists():
                    shutil.rmtree(assets.root)
                os.replace(tmp, assets.root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except ImportError as e:
        raise AssetError(f"cannot generate TorchTitan assets ({e}); fix: run `make setup` (installs tokenizers)") from e
    except OSError as e:
        raise AssetError(
            f"cannot write TorchTitan assets under {parent} ({e.strerror or e}); "
            "fix: set TORCHMOE_TITAN_ASSETS to a writable directory"
        ) from e
    if not assets.complete():  # pragma: no cover - defensive
        raise AssetError(
            f"TorchTitan assets incomplete in {assets.root}; fix: python -m titan_integration.assets --force"
        )
    return assets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="regenerate even if present")
    args = p.parse_args(argv)
    try:
        assets = ensure_assets(force=args.force)
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(assets.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
