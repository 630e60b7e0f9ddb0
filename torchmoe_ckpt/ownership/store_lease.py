"""One writing job per run prefix of an object store: a lease, `<uri>/<run>/LEASE.json` (the run lock, run_lock.py,
cannot see a job with the same run id on another host). Rank 0 holds it and renews it every `lease_s / 3` s; a
lease not renewed for `lease_s` is gone (its job died); a clean exit releases it. At start a lease of another job
that is renewed while we watch is refused in one line; one neither renewed nor expired is waited on. Stores have
no common compare-and-swap, so a take-over is written, then read back after SETTLE_S: of two jobs that wrote at
once, the one that reads another's lease yields."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from ..core.errors import ConfigError
from ..storage_format.store_open import open_store

log = logging.getLogger("torchmoe_ckpt.store_lease")
LEASE_NAME = "LEASE.json"
SETTLE_S = 0.3  # written, then read back after this long (two writers at once: the later one wins)


class StoreLeasedError(ConfigError):
    """Another live job writes this run's prefix of the object store; the message names it and the fix."""


def local_job_key() -> str:
    """What names this launch, as this process sees it: torchrun's rendezvous id when it has one; else its torchrun
    agent (the parent process: the same across restarts of one launch, so a restarted job takes its own lease back
    at once); else this process. Ranks see different agents and processes, so every rank uses rank 0's key
    (`tiers.job_key`): plain `torchrun --nproc_per_node N` (rendezvous id "none") is one job, not N."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return f"torchrun:{run}"
    if run == "none":
        return f"torchrun-agent:{socket.gethostname()}:{os.getppid()}"
    return f"process:{socket.gethostname()}:{os.getpid()}"


class StoreLease:
    def __init__(self, uri: str, run_id: str, storage_options: dict | None, lease_s: float, rank: int, job: str):
        """`job`: the key every rank of this launch shares (`tiers.job_key`); a lease with another key is another
        job's."""
        self.fs, root = open_store(uri, storage_options, probe=False)
        run = run_id.strip("/")
        self.path = f"{root.rstrip('/')}/{run}/{LEASE_NAME}" if run else f"{root.rstrip('/')}/{LEASE_NAME}"
        self.where = f"{uri.rstrip('/')}/{run}" if run else uri
        self.lease_s, self.rank = float(lease_s), rank
        self.job = job
        self.nonce = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"job": "unreadable", "renewed": 0.0, "lease_s": 0.0}

    def _write(self) -> None:
        body = {"job": self.job, "nonce": self.nonce, "host": socket.gethostname(), "pid": os.getpid()}
        body.update(renewed=time.time(), lease_s=self.lease_s)
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)  # a local store's run directory may not exist
        self.fs.pipe_file(self.path, json.dumps(body).encode())

    def acquire(self) -> None:
        """Rank 0 takes the lease (and renews it from now on); the other ranks only judge it. Raises
        StoreLeasedError (one line) when another live job holds it."""
        first = self.read()
        deadline = time.monotonic() + self.lease_s * 1.5 + 1.0
        while True:
            cur = self.read()
            if cur is None or cur.get("job") == self.job or _age_s(cur) > float(cur.get("lease_s", 0.0)):
                if self.rank != 0:
                    return  # rank 0 takes it (or has taken it) for this job
                self._write()
                time.sleep(SETTLE_S)
                back = self.read()
                if back is not None and back.get("nonce") == self.nonce:
                    self._thread = threading.Thread(target=self._renew, name="tmoe-store-lease", daemon=True)
                    self._thread.start()
                    return
                first = back  # another job wrote at the same time: judge it
                continue
            # renewed while we watched (its job is alive), or neither renewed nor expired in time
            if (first is not None and cur.get("renewed") != first.get("renewed")) or time.monotonic() > deadline:
                age = _age_s(cur)
                raise StoreLeasedError(
                    f"object store prefix {self.where} is written by another job ({cur.get('job')}, pid "
                    f"{cur.get('pid')} on host {cur.get('host')}, renewed {age:.1f} s ago): two jobs on one run would "
                    "mix their windows; give this job another run_id (TierConfig.run_id, [sparse_checkpoint] run_id), "
                    f"or stop that job (its lease expires {cur.get('lease_s')} s after its last renewal)"
                )
            time.sleep(min(1.0, self.lease_s / 10))

    def _renew(self) -> None:  # rank 0's renewal thread
        while not self._stop.wait(self.lease_s / 3):
            try:
                self._write()
            except Exception as exc:  # a store outage: the uploads say so too; renewed when it is back
                log.debug("lease renewal of %s failed: %s", self.path, exc)

    def release(self) -> None:
        """At a clean exit: stop renewing and remove the lease (a relaunch need not wait for it to expire)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(2.0)
        self._thread = None
        try:
            cur = self.read()
            if cur is not None and cur.get("nonce") == self.nonce:
                self.fs.rm_file(self.path)
        except Exception as exc:  # the store is down at exit: the lease expires by itself
            log.debug("lease release of %s failed: %s", self.path, exc)

    def stop(self, timeout_s: float) -> None:  # background.stop_at_exit: stop renewing, the lease then expires
        self._stop.set()


def _age_s(lease: dict) -> float:
    """Seconds since a lease was last renewed."""
    return time.time() - float(lease.get("renewed", 0.0))
