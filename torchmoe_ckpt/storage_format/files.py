"""Where a tier's files go: a local directory or any fsspec store behind one small interface, paths relative to
its root. `write` makes a new file (never writes into an existing one: on a host tier it may be a link to live
slot buffers); `write_last` is the commit (commit.py locally; on a store, the put after every other).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .checksums import FileEntry, digest, file_entry
from .commit import write_last
from .spare_files import place_new_file
from .store_open import is_local, open_store


class LocalFiles:
    local = True

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.where = str(root)

    def path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def read(self, rel: str) -> bytearray:
        path = self.path(rel)
        buf = bytearray(os.path.getsize(path))
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        return buf

    def write(self, rel: str, data) -> None:
        place_new_file(self.path(rel))
        with open(self.path(rel), "wb") as f:
            f.write(memoryview(data).cast("B"))

    def write_last(self, rel: str, data: bytes | bytearray) -> None:
        self.path(rel).parent.mkdir(parents=True, exist_ok=True)
        write_last(self.path(rel), data)

    def makedirs(self, rel: str) -> None:
        self.path(rel).mkdir(parents=True, exist_ok=True)

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def entry(self, rel: str, algo: str) -> FileEntry:
        """Size and digest of a file, streamed."""
        return file_entry(self.path(rel), algo)

    def listdir(self, rel: str = "") -> list[str]:
        try:
            return os.listdir(self.path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def find(self, rel: str = "") -> list[str]:
        """Every file below `rel`, relative to it."""
        base = self.path(rel)
        return [str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()] if base.is_dir() else []

    def remove(self, rels: list[str]) -> None:
        for rel in rels:
            self.path(rel).unlink(missing_ok=True)

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self.path(rel), ignore_errors=True)


class StoreFiles:
    def __init__(self, fs, root: str, where: str):
        self.fs, self.root, self.where = fs, root.rstrip("/"), where
        self.local = is_local(fs)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def makedirs(self, rel: str) -> None:
        if self.local:  # on object stores makedirs of a prefix is a no-op (or would create a bucket)
            self.fs.makedirs(self.path(rel), exist_ok=True)

    def write(self, rel: str, data) -> None:
        if self.local:
            self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(self.path(rel), bytes(memoryview(data).cast("B")))

    def write_last(self, rel: str, data: bytes | bytearray) -> None:
        self.write(rel, data)  # one put is whole; the commit is that it comes after every other file
        self.invalidate()

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def entry(self, rel: str, algo: str) -> FileEntry:
        data = self.read(rel)
        return FileEntry(len(data), digest(data, algo), algo)

    def listdir(self, rel: str = "") -> list[str]:
        try:
            return [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.path(rel), detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def find(self, rel: str = "") -> list[str]:
        try:
            return list(self.sizes(rel))
        except FileNotFoundError:
            return []

    def sizes(self, rel: str) -> dict[str, int]:
        """Every file below `rel` with its size (one listing)."""
        base = self.path(rel)
        found = self.fs.find(base, detail=True)
        return {p[len(base) + 1 :]: info.get("size") for p, info in found.items() if p.startswith(base + "/")}

    def remove(self, rels: list[str]) -> None:
        if not rels:
            return
        try:
            self.fs.rm([self.path(r) for r in rels])
        except FileNotFoundError:  # one of them was gone already: the others one by one
            for r in rels:
                if self.exists(r):
                    self.fs.rm(self.path(r))

    def remove_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass

    def invalidate(self) -> None:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache()


def open_files(location: str | os.PathLike, storage_options: dict | None = None, probe: bool = False):
    """A plain path: LocalFiles. Any URI (file:// too): StoreFiles through `open_store` (checked, probed when
    `probe`), with `storage_options` passed to fsspec."""
    loc = str(location)
    if "://" not in loc:
        return LocalFiles(loc)
    fs, root = open_store(loc, storage_options, probe=probe)
    return StoreFiles(fs, root, loc)
