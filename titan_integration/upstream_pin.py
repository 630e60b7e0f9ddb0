"""The TorchTitan code this package copies, pinned by a digest of its source, so an upgrade that changes it fails a
test (tests/titan_glue/test_upstream_pin.py) instead of silently diverging from the copy.

`SparseTrainer.sparse_step` (sparse_trainer.py) is TorchTitan's `Trainer.train_step` with four additions (there is
no hook between clipping and `optimizers.step()`); its metric block is `_log_metrics`. `_clip_with_norm` splits
the clip like `clip_grad_norm_` / `_clip_grad_norm_with_ep` do. When a digest no longer matches, re-read the
upstream function, carry its change into the copy named in `UPSTREAM_COPIES`, then update the digest here (the
message prints the new one). Nothing here imports torch or TorchTitan: the installed source is read as a file.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import io
import textwrap
import tokenize
from pathlib import Path

__all__ = ["UPSTREAM_PACKAGE", "UPSTREAM_VERSION", "UPSTREAM_TRAIN_STEP", "UPSTREAM_COPIES", "source_digest", "drift"]

UPSTREAM_PACKAGE, UPSTREAM_VERSION = "torchtitan", "0.3.0"
# (package, version, digest of the normalised source of torchtitan.trainer.Trainer.train_step): what sparse_step follows
UPSTREAM_TRAIN_STEP = (
    UPSTREAM_PACKAGE,
    UPSTREAM_VERSION,
    "5521d0256d3cefc1031d2f1131c370e113e7da0e0b6447b30cfa01681b1358aa",
)
# "module:qualname" upstream -> (its digest, what to re-check in this package when it changes)
UPSTREAM_COPIES: dict[str, tuple[str, str]] = {
    "torchtitan.trainer:Trainer.train_step": (
        UPSTREAM_TRAIN_STEP[2],
        "titan_integration/sparse_trainer.py SparseTrainer.sparse_step (batch fetch, valid-token count, "
        "forward_backward_step calls, clip_grad_norm_ arguments, optimizer/LR-scheduler step order) and "
        "_log_metrics (the metric block)",
    ),
    "torchtitan.distributed.utils:clip_grad_norm_": (
        "9ff5c2dcb37cf8073ec5745d8871a70dd72babcdcff728acf5196923483a4103",
        "titan_integration/sparse_trainer.py SparseTrainer._clip_with_norm (replay clips with the logged norm the "
        "way clip_grad_norm_ does) and sparse_step's clip_grad_norm_ call",
    ),
    "torchtitan.distributed.utils:_clip_grad_norm_with_ep": (
        "dfda29bf99a0adf751364c86eacbaeeb8d08cf37416164ca87024a4447acab0d",
        "titan_integration/sparse_trainer.py SparseTrainer._clip_with_norm (the EP / non-EP split of the clip)",
    ),
}


def _module_file(module: str) -> Path:
    """The installed file of `module`, found without importing it (nor its package: TorchTitan needs CPU mode)."""
    top, *rest = module.split(".")  # a submodule, e.g. torchtitan.trainer
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{top} is not installed")
    return Path(next(iter(spec.submodule_search_locations)), *rest[:-1], rest[-1] + ".py")


def _function_source(text: str, qualname: str) -> str:
    scope: list[ast.stmt] = ast.parse(text).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part), None)
        if node is None:
            raise LookupError(f"{qualname}: no {part} in the upstream source")
        scope = node.body
    return textwrap.dedent(ast.get_source_segment(text, node, padded=True) or "")


def normalise(source: str) -> str:
    """The source's tokens without comments and blank lines: reformatting or a comment is no drift, code is."""
    keep = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL):
            continue
        keep.append("<INDENT>" if tok.type == tokenize.INDENT else tok.string)
    return " ".join(keep)


def source_digest(target: str, text: str | None = None) -> str:
    """sha256 of the normalised source of "module:qualname" (as installed, or of `text`, the module's source)."""
    module, qualname = target.split(":")
    if text is None:
        text = _module_file(module).read_text()
    return hashlib.sha256(normalise(_function_source(text, qualname)).encode()).hexdigest()


def drift(read=None) -> list[str]:
    """One line per pinned upstream function whose installed source differs from the one copied (empty: none).
    `read(module)` gives a module's source (default: the installed file)."""
    out = []
    installed = importlib.metadata.version(UPSTREAM_PACKAGE)
    if installed != UPSTREAM_VERSION:
        out.append(
            f"{UPSTREAM_PACKAGE} {installed} is installed but the copies follow {UPSTREAM_VERSION}: check the "
            f"digests below, re-check what they name, then set UPSTREAM_VERSION (titan_integration/upstream_pin.py)"
        )
    for target, (pinned, recheck) in UPSTREAM_COPIES.items():
        got = source_digest(target, None if read is None else read(target.split(":")[0]))
        if got != pinned:
            out.append(
                f"{target} changed upstream (sha256 {got}, pinned {pinned}): re-check {recheck}; then pin the new "
                "digest in titan_integration/upstream_pin.py"
            )
    return out
