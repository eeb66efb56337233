"""Placement: which queued runs start now, and where. A pure function of tables.

A run's kind is ``RunSpec.worker_key`` (model and engine). A server serves one run at a
time, so that runs never disturb each other. Rules, oldest queued run first:
- a run takes an idle, ready server of its kind when there is one;
- on a CPU machine (no GPUs) a kind has one server: a run whose kind has a server (or
  one starting) waits for it to be idle. There is one local worker at a time, started
  only when nothing is running or starting, after the idle local workers are stopped;
- a kind whose only servers are registered ones (none started here, none starting)
  waits for them: this machine starts none for it;
- with GPUs, a run that found no idle server starts one more server of its kind (one
  per run: never one for a run placed already) on ``tensor_parallel_size`` GPUs: free
  ones first, then GPUs freed by evicting idle, ready local workers of other kinds,
  least recently used first. Busy and starting workers, and workers of the run's own
  kind, are never evicted. A GPU stays held by its worker until that worker has
  stopped, even when it is set aside for eviction. So a sweep of one model and engine
  runs as many points at once as there are GPU groups, and runs of other kinds keep
  running beside them where GPUs allow;
- a run that waits for registered servers only holds nothing of this machine's, so
  later runs of other kinds go past it; any other run that must wait stops the pass
  (first come, first served);
- a run needing more GPUs than the service may use fails at once; so does, on a CPU
  machine, a run that a CPU server cannot serve (``QueuedRow.cpu_problem``) unless
  registered servers of its kind may take it;
- a run longer than the servers of its kind take fails at once, with the sums, when each
  ready server of its kind says its ``max_model_len`` (what vLLM fitted to its KV cache
  memory, or a registered server's): another server of the kind would fit no more. A
  server never takes a run longer than its ``max_model_len``;
- the two runs of a fill/prefill pair run back to back, never at once: a run whose pair
  has a run placed already waits (holding nothing, so later runs go past it), and then
  takes the server its partner ran on when that one is idle, so that the pair's ratio
  compares the two modes on one server, not two servers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from service.core.modelconfig import RequestLen


@dataclass(frozen=True)
class WorkerRow:
    """A worker as placement sees it."""

    id: str
    key: str
    external: bool = False
    ready: bool = True
    busy: bool = False
    gpus: tuple[str, ...] = ()
    last_used: float = 0.0
    # Set aside for eviction, not stopped yet: holds its GPUs, takes no runs.
    stopping: bool = False
    # The longest sequence it takes, as it said (None: not known yet), and whose limit
    # that is with what a user can change (``WorkerHandle.max_len_why``).
    max_model_len: int | None = None
    max_len_why: str = ""


@dataclass(frozen=True)
class QueuedRow:
    """A queued run as placement sees it."""

    id: str
    key: str
    tensor_parallel_size: int = 1
    pair_id: str | None = None
    # Its longest request (None: held to no server's length).
    longest: RequestLen | None = None
    # Why a server started on a CPU cannot serve it (``EngineSpec.cpu_problem``).
    cpu_problem: str | None = None


@dataclass(frozen=True)
class Decision:
    """What to do with one queued run: reuse a worker, start one on ``gpus`` after
    stopping ``evict``, or fail it with ``fail``."""

    run_id: str
    key: str
    reuse: str | None = None
    gpus: tuple[str, ...] = ()
    evict: tuple[str, ...] = ()
    fail: str | None = None


@dataclass
class _State:
    workers: dict[str, WorkerRow]
    starting: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


def place(
    queued: Sequence[QueuedRow],
    workers: Sequence[WorkerRow],
    starting: Sequence[tuple[str, Sequence[str]]],
    gpus: Sequence[str],
    busy_pairs: Collection[str] = (),
    pair_servers: Mapping[str, str] | None = None,
    stopped: list[str] | None = None,
) -> list[Decision]:
    """The decisions for this pass. ``starting``: (kind, GPUs) of runs placed earlier
    whose new worker is not up yet; ``gpus``: the GPUs the service may use (empty on a
    CPU machine); ``busy_pairs``: the pairs with a run placed and not ended;
    ``pair_servers``: the server a pair's ended run ran on; ``stopped`` gets the run that
    stopped the pass, if one did (then no later run could be placed)."""
    state = _State({w.id: w for w in workers}, [(k, tuple(g)) for k, g in starting])
    busy = set(busy_pairs)
    out: list[Decision] = []
    for run in queued:
        if run.pair_id is not None and run.pair_id in busy:
            continue  # its partner runs: it waits, holding nothing

        if gpus and run.tensor_parallel_size > len(gpus):
            out.append(Decision(
                run.id, run.key,
                fail=f"tensor_parallel_size {run.tensor_parallel_size} needs more GPUs than this "
                f"service may use ({len(gpus)}: {','.join(gpus)})",
            ))
            continue
        if run.cpu_problem is not None and not gpus and not _registered(run, state):
            out.append(Decision(
                run.id, run.key,
                fail=f"{run.cpu_problem}; this service starts its servers on this machine's CPU "
                "(it has no GPUs: DECODEBENCH_GPUS)",
            ))
            continue
        too_long = _too_long(run, state)
        if too_long is not None:
            out.append(Decision(run.id, run.key, fail=too_long))
            continue
        partner = (pair_servers or {}).get(run.pair_id) if run.pair_id else None
        decision = _place_one(run, state, gpus, partner)
        if decision is None:
            if _waits_on_registered(run, state):
                continue
            if stopped is not None:
                stopped.append(run.id)
            break
        if run.pair_id is not None:
            busy.add(run.pair_id)
        out.append(decision)
    return out


def _too_long(run: QueuedRow, state: _State) -> str | None:
    """Why the run is longer than every ready server of its kind takes, when each of them
    said its length; None while one may take it or one has not said."""
    if run.longest is None:
        return None
    limits: list[tuple[int, str]] = []
    for w in state.workers.values():
        if w.key == run.key and w.ready and not w.stopping:
            if w.max_model_len is None:
                return None
            limits.append((w.max_model_len, w.max_len_why))
    if not limits:
        return None
    limit, why = max(limits)
    return run.longest.over(limit, why)


def _fits(run: QueuedRow, worker: WorkerRow) -> bool:
    return run.longest is None or worker.max_model_len is None or run.longest.tokens <= worker.max_model_len


def _registered(run: QueuedRow, state: _State) -> bool:
    """Whether a registered server of the run's kind may take it."""
    return any(w.external and w.key == run.key and not w.stopping for w in state.workers.values())


def _waits_on_registered(run: QueuedRow, state: _State) -> bool:
    same = [w for w in state.workers.values() if w.key == run.key and not w.stopping]
    starting = any(k == run.key for k, _ in state.starting)
    return bool(same) and all(w.external for w in same) and not starting


def _place_one(run: QueuedRow, state: _State, gpus: Sequence[str],
               partner: str | None = None) -> Decision | None:
    live = [w for w in state.workers.values() if not w.stopping]
    same = [w for w in live if w.key == run.key]
    idle = [w for w in same if w.ready and not w.busy and _fits(run, w)]
    if idle:
        chosen = next((w for w in idle if w.id == partner), idle[0])
        state.workers[chosen.id] = replace(chosen, busy=True)
        return Decision(run.id, run.key, reuse=chosen.id)
    # No other server for this kind: on a CPU a kind has one; a kind served by registered
    # servers only waits for them.
    starting = any(k == run.key for k, _ in state.starting)
    if _waits_on_registered(run, state) or (not gpus and (same or starting)):
        return None
    local = [w for w in live if not w.external]
    if not gpus:
        if state.starting or any(w.busy or not w.ready for w in local):
            return None
        evict = tuple(w.id for w in local)
        chosen_gpus: tuple[str, ...] = ()
    else:
        need = run.tensor_parallel_size
        held = {g for w in state.workers.values() if not w.external for g in w.gpus}
        held |= {g for _, gs in state.starting for g in gs}
        free = [g for g in gpus if g not in held]
        freed: list[str] = []
        evict_rows: list[WorkerRow] = []
        for w in sorted(local, key=lambda w: w.last_used):
            if len(free) + len(freed) >= need:
                break
            if w.ready and not w.busy and w.key != run.key:
                evict_rows.append(w)
                freed += [g for g in w.gpus if g in gpus]
        if len(free) + len(freed) < need:
            return None
        # Free GPUs first: GPUs of an evicted worker are only taken when needed; the
        # rest stay held until that worker has stopped.
        chosen_gpus = tuple(sorted((free + freed)[:need]))
        evict = tuple(w.id for w in evict_rows)
    for worker_id in evict:
        state.workers[worker_id] = replace(state.workers[worker_id], stopping=True)
    state.starting.append((run.key, chosen_gpus))
    return Decision(run.id, run.key, gpus=chosen_gpus, evict=evict)
