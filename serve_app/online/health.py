"""What `/health` tells an authorized caller, as upstream `laya-serve` computes it, over the served checkpoints.

`ReplicaWatch` reads how many replicas of each scorer deployment run (Serve's controller, at most once a
second, on a thread): a checkpoint is `loaded` while one does, so a scaled-to-zero checkpoint is reported
unloaded, as upstream reports an idle-unloaded one. `health_payload` builds upstream's keys: `loaded`,
`revisions` (None per checkpoint: upstream's value for a checkpoint loaded from a local directory),
`device` (where a loaded checkpoint computes, else the configured preference), `device_is_preference`,
`checkpoint_devices` and `cpu_fallbacks` (a scorer never falls back to CPU: count 0).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

LIVENESS_ONLY = {"status": "ok"}  # upstream's answer to an unauthenticated caller when a key is set


class ReplicaWatch:
    """Running replicas per deployment of this application, cached for `ttl_s` seconds."""

    def __init__(self, app_name: str | None, run_in_thread: Callable, ttl_s: float = 1.0):
        self.app_name, self._thread, self.ttl_s = app_name, run_in_thread, ttl_s
        self._counts: dict[str, int] = {}
        self._at = -1e9
        self._lock = asyncio.Lock()

    def _read(self) -> dict[str, int]:
        from ray import serve

        app = serve.status().applications.get(self.app_name)
        if app is None:
            return {}
        return {name: int(d.replica_states.get("RUNNING", 0)) for name, d in app.deployments.items()}

    async def counts(self) -> dict[str, int]:
        """{deployment name: running replicas}; the last known counts when the controller does not answer."""
        if self.app_name is None:
            return {}
        async with self._lock:
            if time.monotonic() - self._at >= self.ttl_s:
                try:
                    self._counts = await asyncio.wait_for(self._thread(self._read), 5.0)
                except Exception as e:  # noqa: BLE001 - controller busy or restarting: keep the last counts
                    log.warning("replica counts unavailable: %s", type(e).__name__)
                self._at = time.monotonic()
            return self._counts

    async def running(self, deployment: str) -> int | None:
        """Running replicas of `deployment`, or None when unknown (outside Serve, no answer yet)."""
        return (await self.counts()).get(deployment)


async def health_payload(served: dict, deployments: dict[str, str], watch: ReplicaWatch, devices: dict[str, str],
                         preference: str, in_process: str | None = None) -> dict:
    """Upstream's authorized `/health` body. `served`: {name: ServedCheckpoint}; `deployments`: {name: scorer
    deployment}; `devices`: a cache {name: device} this fills by asking a loaded checkpoint's scorer once;
    `in_process`: the checkpoint this replica scores itself (always loaded)."""
    counts = await watch.counts()
    loaded = [n for n in served if n == in_process or counts.get(deployments[n], 0) > 0]
    for name in loaded:
        if name not in devices:
            resp = served[name].scorer.info.remote()
            try:
                devices[name] = str((await asyncio.wait_for(resp, 2.0))["device"])
            except Exception:  # noqa: BLE001 - replica busy or gone: report the device next time
                resp.cancel()
    checkpoint_devices = {n: devices[n] for n in loaded if n in devices}
    actual = next(iter(checkpoint_devices.values()), None)
    return {"status": "ok", "loaded": loaded, "revisions": {n: None for n in loaded},
            "device": actual or preference, "device_is_preference": actual is None,
            "checkpoint_devices": checkpoint_devices,
            "cpu_fallbacks": {n: {"count": 0, "last_reason": None} for n in loaded}}
