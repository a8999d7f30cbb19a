"""Every servable model by name: loaded just in time by the name a request sends, at most `max_models` resident
(fewer when memory refuses one more: the least recently used idle model goes first), unloaded after `keep_alive_s`
idle seconds (a request may set its own, as Ollama's `keep_alive`), never while a request of its own is in flight.

A request holds a `Lease` on its model from before it is queued until its last event is out; the lease is what keeps
a model resident. Loading runs on a worker thread, so requests to models already resident go on while another loads.
Pool state is touched from the event loop only (the load and the unload themselves run on threads).

A server of one model (`ModelPool.single`, tests) answers any name with it, as before:
clients send placeholders ("gpt-4o", "local-model"). Serving several, a name that is none of them is a 404 that
lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import InsufficientMemory
from engine.openai.errors import ApiError, unavailable, unknown_model
from engine.openai.metrics import Metrics
from engine.openai.service import ModelService, ServeConfig

FOREVER = None  # keep_alive: never unloaded for idleness
SWEEP_S = 0.25  # how often idle models are checked against their keep-alive
LOAD_NICENESS = 10  # the loading thread yields the CPU to the threads serving resident models


@dataclass(frozen=True)
class Servable:
    """A model the server may load: its name (what clients send) and where it is (None: given loaded)."""

    name: str
    path: Path | None = None
    size_bytes: int = 0


Loader = Callable[[Servable, ServeConfig, Metrics], ModelService]


@dataclass
class Resident:
    service: ModelService
    keep_alive_s: float | None
    last_used: float
    in_flight: int = 0
    pinned: bool = False  # given loaded (no loader can load it again): never unloaded


@dataclass
class Lease:
    """A request's hold on a resident model; `release()` (idempotent) lets it go idle."""

    pool: ModelPool
    name: str
    service: ModelService
    keep_alive_s: float | bool | None = False  # False: the model's own keep-alive stays
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool.release(self)


class ModelPool:
    def __init__(
        self,
        servable: Sequence[Servable],
        config: ServeConfig,
        loader: Loader | None,
        *,
        max_models: int = 1,
        keep_alive_s: float | None = FOREVER,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`config` holds what every model shares (key, limits); each model's service gets it with its own name."""
        if max_models < 1:
            raise ValueError("max_models must be at least 1")
        self.servable = {s.name: s for s in servable}
        self.config = config
        self.loader = loader
        self.max_models = max_models
        self.keep_alive_s = keep_alive_s
        self.metrics = metrics if metrics is not None else Metrics()
        self.clock = clock
        self.residents: dict[str, Resident] = {}
        self.loading: dict[str, asyncio.Future[None]] = {}
        self._changed: asyncio.Event | None = None  # set whenever a lease ends or a model leaves
        self._sweeper: asyncio.Task[None] | None = None
        # One load at a time, on a thread of lower priority: two loads would only share the disk and the cores, and
        # the rows of resident models generate while it runs.
        self._loads = ThreadPoolExecutor(1, "spark-model-load", initializer=_lower_priority)
        self.metrics.sources.update(self.gauges())

    @classmethod
    def single(cls, service: ModelService) -> ModelPool:
        """A pool of one model, already loaded: the server of one model."""
        pool = cls([Servable(service.config.model_id)], service.config, None, metrics=service.metrics)
        pool.adopt(service.config.model_id, service, pinned=True)
        return pool

    def adopt(self, name: str, service: ModelService, *, pinned: bool = False) -> None:
        """Make `service` (loaded by the caller, e.g. the default model at start-up) the resident `name`."""
        self.residents[name] = Resident(service, FOREVER if pinned else self.keep_alive_s, self.clock(), pinned=pinned)

    # -- names ---------------------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.servable)

    def resolve(self, requested: str) -> str:
        """The servable model a request names; with one model, any name is it (clients send placeholders)."""
        if requested in self.servable:
            return requested
        if len(self.servable) == 1:
            return next(iter(self.servable))
        raise unknown_model(requested, self.names)

    def loaded(self, name: str) -> bool:
        return name in self.residents

    def any_service(self) -> ModelService | None:
        return next((r.service for r in self.residents.values()), None)

    # -- leases --------------------------------------------------------------------------------------------------
    async def acquire(self, requested: str, keep_alive_s: float | bool | None = False) -> Lease:
        """A lease on the model `requested` names, loading it first when it is not resident (and making room:
        the least recently used idle model is unloaded; with none idle, this waits for one). `keep_alive_s`
        (False: unchanged) becomes the model's keep-alive once the lease ends."""
        name = self.resolve(requested)
        self._start_sweeper()
        while True:
            resident = self.residents.get(name)
            if resident is not None:
                resident.in_flight += 1
                resident.last_used = self.clock()
                return Lease(self, name, resident.service, keep_alive_s)
            pending = self.loading.get(name)
            if pending is not None:
                await asyncio.shield(pending)  # its failure is the loader's to report; then try again
                continue
            if self.loader is None or self.servable[name].path is None:
                raise unavailable(f"The model {name!r} is not loaded and this server cannot load it.")
            if len(self.residents) + len(self.loading) >= self.max_models and not await self._make_room():
                continue  # waited for a lease to end; look again
            await self._load(name)

    def release(self, lease: Lease) -> None:
        resident = self.residents.get(lease.name)
        if resident is not None and resident.service is lease.service:
            resident.in_flight -= 1
            resident.last_used = self.clock()
            if lease.keep_alive_s is not False and not resident.pinned:
                resident.keep_alive_s = lease.keep_alive_s
        self._signal()

    # -- loading and unloading -----------------------------------------------------------------------------------
    async def _load(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self.loading[name] = done
        servable = self.servable[name]
        config = ServeConfig(**{**vars(self.config), "model_id": name})
        assert self.loader is not None
        loader = self.loader
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    service = await loop.run_in_executor(self._loads, loader, servable, config, self.metrics)
                    break
                except InsufficientMemory:
                    if not await self._unload_idle():  # nothing left to give back: the refusal stands
                        raise
        except BaseException as exc:
            done.set_result(None)
            self.loading.pop(name, None)
            self._signal()
            if isinstance(exc, ApiError):
                raise
            if isinstance(exc, InsufficientMemory):
                raise unavailable(str(exc)) from None
            raise
        self.metrics.model_loaded(name, time.perf_counter() - t0)
        self.residents[name] = Resident(service, self.keep_alive_s, self.clock())
        self.loading.pop(name, None)
        done.set_result(None)
        self._signal()

    async def _make_room(self) -> bool:
        """Unload the least recently used idle model; False after waiting for a lease to end (none was idle)."""
        if await self._unload_idle():
            return True
        event = self._event()
        event.clear()
        await event.wait()
        return False

    async def _unload_idle(self) -> bool:
        idle = [(r.last_used, n) for n, r in self.residents.items() if r.in_flight == 0 and not r.pinned]
        if not idle:
            return False
        await self.unload(min(idle)[1])
        return True

    async def unload(self, name: str) -> bool:
        """Unload `name` now if it is resident, idle and not pinned; whether it was."""
        resident = self.residents.get(name)
        if resident is None or resident.in_flight or resident.pinned:
            return False
        del self.residents[name]  # no new lease finds it from here on
        await asyncio.to_thread(_close, resident.service)
        self.metrics.model_unloaded(name)
        self._signal()
        return True

    async def sweep(self) -> None:
        """Unload every idle model past its keep-alive."""
        now = self.clock()
        for name, r in list(self.residents.items()):
            if r.in_flight == 0 and not r.pinned and r.keep_alive_s is not None and now - r.last_used >= r.keep_alive_s:
                await self.unload(name)

    def expires_in(self, name: str) -> float | None:
        """Seconds until `name` unloads for idleness (None: it stays)."""
        r = self.residents.get(name)
        if r is None or r.pinned or r.keep_alive_s is None:
            return None
        return max(0.0, r.keep_alive_s - (self.clock() - r.last_used)) if r.in_flight == 0 else r.keep_alive_s

    def close(self) -> None:
        if self._sweeper is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended (and ended it)
                self._sweeper.cancel()
        self._loads.shutdown(wait=False, cancel_futures=True)
        for r in list(self.residents.values()):
            r.service.close()
        self.residents.clear()

    # -- figures -------------------------------------------------------------------------------------------------
    def gauges(self) -> dict[str, Callable[[], float]]:
        return {
            "spark_models_loaded": lambda: float(len(self.residents)),
            "spark_requests_running": lambda: float(sum(r.service.scheduler.running for r in self.residents.values())),
            "spark_requests_waiting": lambda: float(sum(r.service.scheduler.waiting for r in self.residents.values())),
        }

    # -- internals -----------------------------------------------------------------------------------------------
    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _signal(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _start_sweeper(self) -> None:
        if self._sweeper is None and self.loader is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            with contextlib.suppress(Exception):  # a failed close must not end the sweeping
                await self.sweep()


def _lower_priority() -> None:
    """This thread's niceness raised (Linux: per thread); elsewhere it keeps the process's priority."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICENESS)


def _close(service: ModelService) -> None:
    service.close()
    gc.collect()  # the weights' last references go with the service: give their memory back now


def parse_keep_alive(value: object) -> float | bool | None:
    """Ollama's `keep_alive`: seconds (a number), a duration ("30s", "5m", "1h", "250ms"), a negative value (stay
    loaded), 0 (unload when idle); False when not sent; ValueError when not one of these."""
    if value is None:
        return False
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        units = (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0))
        unit = next(((u, f) for u, f in units if text.endswith(u) and text[: -len(u)].strip()), ("", 1.0))
        number = text[: len(text) - len(unit[0])] if unit[0] else text
        seconds = float(number) * unit[1]  # ValueError for anything else
    else:
        raise ValueError(value)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(value)
    return None if seconds < 0 else seconds
