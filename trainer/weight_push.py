"""Trainer weights -> every engine, every K optimizer steps.

    sync = WeightSync(cfg.weight_push, store, run_dir / "weights")
    report = await sync.push(backend, version)      # pause engines -> transfer -> verify -> continue

The engines are the ones registered in the store (`engines` hash, maintained by the engine actors).
Sequence of one push:

1. gather the HF-named weights (backend.hf_state_dict) in the engines' dtype;
2. disk only: write the snapshot directory (atomic) and record it in the `weights` hash *before*
   touching an engine, so an engine restarting during the push already comes up with it;
3. pause every engine concurrently (`pause_mode`; in_place by default: running requests keep their
   KV cache and continue with the new weights, their tokens recording both weight versions);
4. transfer with the configured method (`PUSHERS`), to every engine concurrently;
5. `verify_weights`: read the first rows of a few tensors back from every engine the transfer
   updated and compare them exactly with what was sent (an engine that acknowledged the update but
   serves other values fails here);
6. continue every engine, always, even when a transfer failed;
7. `tensor` / `distributed`: write a snapshot every `snapshot_every_pushes` pushes, and whenever an
   engine failed (its restart must find these weights on disk);
8. record the push: `served_version` in the `weights` hash (what the orchestrator's staleness rule
   and a restarted trainer read);
9. an engine that failed any stage (dead, HTTP error, other values read back) gets a restart request
   in the store (`engine_restarts`: engine id -> this version), written after the snapshot: its actor
   (rollout/actor.py) restarts the engine process, which loads that snapshot. The method's state for
   the engines (the broadcast group) is reset, so the next push includes the restarted engine.

The `weights` hash (asyncrl.store.WeightsState): `served_version` is the version every engine serves,
`snapshot_version` + `snapshot` the newest snapshot on disk (what a (re)starting engine loads,
labelled with that version). An engine whose process died between two snapshots of a `tensor` or
`distributed` run comes back with the older snapshot until the next push reaches it (it
re-registers, so the next push includes it); its samples carry the older version, which the
staleness filter handles.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Awaitable, Callable, Optional

import torch
import torch.distributed as dist

from asyncrl.config import WeightPushConfig
from asyncrl.engine_client import EngineClient, EngineError
from asyncrl.model.config import ModelConfig
from asyncrl.model.io import save_tensors
from asyncrl.network import node_ip, use_gloo_interface_towards
from asyncrl.plugins import load_plugin
from asyncrl.store import Store
from trainer.atomic_dir import prune, write_atomically
from trainer.backends.base import TrainerBackend

log = logging.getLogger(__name__)

GROUP_NAME = "asyncrl_weights"
PAUSE_MODES = ("in_place", "retract", "abort")
KEY_SPACES = {"builtin": ("default_pg", "0"), "sglang": (GROUP_NAME, GROUP_NAME)}
"""engine_kind -> the two prefixes its side of the broadcast group puts on the rendezvous keys (BroadcastGroup)."""
Tensors = dict[str, torch.Tensor]


@dataclass
class PushReport:
    method: str
    version: int
    engines: int
    bytes: int
    prepare_s: float = 0.0
    """Gathering the weights (+ writing the snapshot for disk), engines still generating."""
    pause_s: float = 0.0
    update_s: float = 0.0
    """The transfer and its verification (engines paused)."""
    resume_s: float = 0.0
    total_s: float = 0.0
    snapshot: Optional[str] = None
    failed: dict[str, str] = field(default_factory=dict)
    """engine id -> error, for engines that did not take the new weights (each is restarted from the snapshot)."""


class WeightPusher(ABC):
    """One transfer method: moves `tensors` into every given (paused) engine. Raising means the method
    itself broke: every engine of the push counts as failed and `close` resets the method."""

    needs_snapshot = False
    """True when engines read the weights from a snapshot directory written before the transfer."""

    def __init__(self, cfg: WeightPushConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    async def update(self, clients: dict[str, EngineClient], tensors: Tensors, version: int,
                     snapshot: Optional[Path]) -> dict[str, str]:
        """Transfer to every engine; -> engine id -> error for the ones that failed."""

    async def close(self) -> None:
        """Release what the method holds between pushes."""


class DiskPusher(WeightPusher):
    needs_snapshot = True

    async def update(self, clients, tensors, version, snapshot):
        return await each(clients, lambda c: c.update_weights_from_disk(str(snapshot), str(version)))


class TensorPusher(WeightPusher):
    async def update(self, clients, tensors, version, snapshot):
        return await each(clients, lambda c: c.update_weights_from_tensor(tensors, str(version)))


class DistributedPusher(WeightPusher):
    """One torch.distributed group: the trainer is rank 0, engine i (by engine id) rank i + 1. Built at
    the first push, rebuilt when the set of engines changes (a restart, a new engine) or a push failed."""

    def __init__(self, cfg: WeightPushConfig) -> None:
        super().__init__(cfg)
        self.group: Optional[BroadcastGroup] = None
        self.members: dict[str, str] = {}  # engine id -> url of the current group's engines

    async def update(self, clients, tensors, version, snapshot):
        if self.group is None or self.members != {eid: c.base_url for eid, c in clients.items()}:
            await self._rebuild(clients, next(iter(tensors.values())).device)
        tensors = {name: t.to(self.group.device) for name, t in tensors.items()}
        announced = [c.update_weights_from_distributed(tensors, str(version), GROUP_NAME) for c in clients.values()]
        await asyncio.gather(asyncio.to_thread(self.group.broadcast, list(tensors.values())), *announced)
        return {}

    async def _rebuild(self, clients: dict[str, EngineClient], device: torch.device) -> None:
        """A new group with exactly `clients` (rank 0 here); engines of the old one leave it first."""
        await self.close()
        backend = self.cfg.distributed_backend
        backend = ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend
        address, port, world = self.cfg.master_address or node_ip(), free_port(), len(clients) + 1
        joins = [c.init_weights_update_group(address, port, i + 1, world, GROUP_NAME, backend)
                 for i, c in enumerate(clients.values())]
        self.group, *_ = await asyncio.gather(
            asyncio.to_thread(BroadcastGroup, address, port, world, backend, self.cfg.engine_kind, self.cfg.timeout_s),
            *joins)
        self.members = {eid: c.base_url for eid, c in clients.items()}
        log.info("weights broadcast group %s:%d (%s) with %d engines", address, port, backend, len(clients))

    async def close(self) -> None:
        """Engines leave the group (best effort: some may be gone), then the trainer drops its end."""
        if self.members:
            clients = {eid: EngineClient(url, timeout_s=30, api_key=self.cfg.engine_api_key)
                       for eid, url in self.members.items()}
            await each(clients, lambda c: c.destroy_weights_update_group(GROUP_NAME))
            await asyncio.gather(*(c.close() for c in clients.values()))
        self.group, self.members = None, {}


PUSHERS: dict[str, str] = {"disk": "trainer.weight_push:DiskPusher", "tensor": "trainer.weight_push:TensorPusher",
                           "distributed": "trainer.weight_push:DistributedPusher"}
"""`weight_push.method` built-ins -> import path of their WeightPusher (asyncrl/plugins.py)."""


class BroadcastGroup:
    """Rank 0 of the engines' weight-update group, built without touching this process's default
    process group (a data-parallel trainer already has one).

    The engines create their end with torch's own helpers, which namespace the rendezvous keys:
    asyncrl's engine calls `init_process_group` (keys under "default_pg" / "0/" / "<device>/"), SGLang
    its `init_custom_process_group` (under group_name / "group_name/" / "<device>/"). The trainer hosts
    the TCPStore and builds its ProcessGroup on the same key space; tests/trainer/test_weight_push.py
    checks it against a real engine."""

    def __init__(self, address: str, port: int, world_size: int, backend: str, engine_kind: str,
                 timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self.tcp_store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout,
                                       wait_for_workers=False)
        outer, group = KEY_SPACES[engine_kind]
        store = dist.PrefixStore(outer, self.tcp_store)
        store = dist.PrefixStore(f"{self.device.type}/", dist.PrefixStore(f"{group}/", store))
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, 0, world_size)
        else:
            use_gloo_interface_towards(address)
            self.pg = dist.ProcessGroupGloo(store, 0, world_size, timeout)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            self.pg.broadcast([tensor.contiguous()], dist.BroadcastOptions()).wait()


class WeightSync:
    """The push sequence around a WeightPusher (module docstring)."""

    def __init__(self, cfg: WeightPushConfig, store: Store, weights_dir: Path) -> None:
        pusher = load_plugin(PUSHERS, cfg.method, "weight_push.method")
        if cfg.pause_mode not in PAUSE_MODES:
            raise ValueError(f"weight_push.pause_mode {cfg.pause_mode!r} not in {list(PAUSE_MODES)}")
        if cfg.engine_kind not in KEY_SPACES:
            raise ValueError(f"weight_push.engine_kind {cfg.engine_kind!r} not in {sorted(KEY_SPACES)}")
        self.cfg, self.store, self.weights_dir = cfg, store, Path(weights_dir)
        self.pusher = pusher(cfg)
        self.pushes = 0
        self.clients: dict[str, EngineClient] = {}
        """engine id -> client, kept across pushes (a new HTTP client costs tens of ms)."""

    async def push(self, backend: TrainerBackend, version: int, lineage_offset: int = 0) -> PushReport:
        """Serve `version` on every engine; `lineage_offset`: versions pushed before without training
        (TrainerState.lineage_offset), published with it."""
        start = time.perf_counter()
        tensors = backend.hf_state_dict()
        report = PushReport(self.cfg.method, version, 0, sum(t.numel() * t.element_size() for t in tensors.values()))
        snapshot = None
        if self.pusher.needs_snapshot:
            snapshot = await self._snapshot(tensors, backend.hf_config(), version)
        report.prepare_s = time.perf_counter() - start
        await self._transfer(await self._engines(), tensors, version, snapshot, report)
        self.pushes += 1
        due = self.pushes % max(self.cfg.snapshot_every_pushes, 1) == 0
        if snapshot is None and (due or report.failed):  # an engine restarted for this push loads it
            snapshot = await self._snapshot(tensors, backend.hf_config(), version)
        await self.store.record_served_version(version, self.cfg.method, lineage_offset)
        if report.failed:
            log.warning("weights v%d did not reach %s: their actors restart them with the v%d snapshot", version,
                        report.failed, version)
            await self.store.request_engine_restarts(report.failed, version)
        report.snapshot, report.total_s = snapshot and str(snapshot), time.perf_counter() - start
        return report

    async def _engines(self) -> dict[str, EngineClient]:
        """Clients of the engines registered now (by engine id), reusing those whose URL is unchanged."""
        engines = await self.store.engines()
        for eid in [e for e, c in self.clients.items() if engines.get(e) != c.base_url]:
            await self.clients.pop(eid).close()
        for eid, url in engines.items():
            self.clients.setdefault(eid, EngineClient(url, timeout_s=self.cfg.timeout_s,
                                                      api_key=self.cfg.engine_api_key))
        return {eid: self.clients[eid] for eid in sorted(engines)}

    async def _transfer(self, clients: dict[str, EngineClient], tensors: Tensors, version: int,
                        snapshot: Optional[Path], report: PushReport) -> None:
        """Pause, update + verify, continue; engines that fail a stage are reported and left out of the next."""
        t = time.perf_counter()
        report.failed = await each(clients, lambda c: c.pause(self.cfg.pause_mode))
        paused = {eid: c for eid, c in clients.items() if eid not in report.failed}
        report.engines, report.pause_s = len(paused), time.perf_counter() - t
        t = time.perf_counter()
        try:
            report.failed |= await self._update(paused, tensors, version, snapshot)
        finally:
            report.update_s, t = time.perf_counter() - t, time.perf_counter()
            report.failed |= await each(paused, lambda c: c.resume())
            report.resume_s = time.perf_counter() - t
        if report.failed:  # those engines are restarted: what the method holds for them (a broadcast group) is void
            await self.pusher.close()

    async def _update(self, paused: dict[str, EngineClient], tensors: Tensors, version: int,
                      snapshot: Optional[Path]) -> dict[str, str]:
        """The transfer, then (verify_weights) the read-back from every engine it updated; -> the failed ones."""
        if not paused:
            return {}
        try:
            failed = await self.pusher.update(paused, tensors, version, snapshot)
        except Exception as err:  # the method itself broke (e.g. the broadcast group): no engine is trusted
            log.exception("weights v%d: %s push failed", version, self.cfg.method)
            return {eid: f"{type(err).__name__}: {err}" for eid in paused}
        if self.cfg.verify_weights:
            updated = {eid: c for eid, c in paused.items() if eid not in failed}
            failed |= await each(updated, lambda c: verify_weights(c, tensors))
        return failed

    async def _snapshot(self, tensors: Tensors, config: ModelConfig, version: int) -> Path:
        """Write the weights as an HF snapshot (atomic) and record it: what a (re)starting engine loads."""
        dtype = tensors["model.embed_tokens.weight"].dtype
        path = await asyncio.to_thread(write_atomically, self.weights_dir / f"v{version:08d}",
                                       lambda tmp: save_tensors(tensors, config, tmp, dtype))
        await self.store.record_snapshot(version, str(path))
        prune(self.weights_dir, "v*", self.cfg.keep_snapshots)
        return path

    async def close(self) -> None:
        await self.pusher.close()
        await asyncio.gather(*(c.close() for c in self.clients.values()))
        self.clients.clear()


class WeightsMismatch(RuntimeError):
    """An engine serves other values than the push sent it."""


VERIFY_ROWS = 4


def probe_names(tensors: Tensors) -> list[str]:
    """The tensors a push reads back: the first, middle and last HF name in sorted order (lm_head, a middle
    layer's, the final norm), so a transfer that stopped early or mixed tensors up shows."""
    names = sorted(tensors)
    return sorted({names[0], names[len(names) // 2], names[-1]})


async def verify_weights(client: EngineClient, tensors: Tensors) -> None:
    """Raise WeightsMismatch unless the engine's first VERIFY_ROWS rows of probe_names(tensors) are the
    sent values (compared exactly, in fp32: the engine holds them in the dtype they were sent in). An
    engine that refuses the read (an SGLang model without get_weights_by_name: a 4xx) is only logged."""
    for name in probe_names(tensors):
        sent = tensors[name][:VERIFY_ROWS].detach().float().cpu()
        try:
            served = await client.weights_by_name(name, VERIFY_ROWS)
        except EngineError as err:
            if err.status >= 500:
                raise
            log.warning("%s cannot read weights back (%s): push not verified; weight_push.verify_weights=false "
                        "stops asking", client.base_url, err.message)
            return
        if served.shape != sent.shape or not torch.equal(served, sent):
            gap = (served - sent).abs().max().item() if served.shape == sent.shape else float("nan")
            raise WeightsMismatch(f"{name}: the engine serves other values (max |difference| {gap:.3g})")


async def each(clients: dict[str, EngineClient], call: Callable[[EngineClient], Awaitable]) -> dict[str, str]:
    """Run `call` on every engine concurrently; -> engine id -> error message of the ones that failed."""
    results = await asyncio.gather(*(call(c) for c in clients.values()), return_exceptions=True)
    return {eid: f"{type(r).__name__}: {r}" for eid, r in zip(clients, results) if isinstance(r, BaseException)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

