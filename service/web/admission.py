"""Admission: what a submitted run, sweep point or capacity search's probe is checked
against before it is stored, each refusal a 422 with what to change. The route modules of
runs, sweeps and capacity searches all admit through here."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import Request
from sqlalchemy import Engine

from service.control import hub
from service.core.capacity import (
    MIN_PROBE_PROMPTS,
    PROBE_WAVES,
    CapacityCreate,
    probe_prompts,
)
from service.core.errors import Invalid
from service.core.modelconfig import MaxLen
from service.core.spec import RunSpec
from service.storage import workers

# What a run's output token costs the service's memory at the summary's peak: its gap, as a
# sample holds it and as the summary's arrays copy it (measured: 90 B at 2 M tokens).
RUN_BYTES_PER_TOKEN = 90


def check_backend(request: Request, spec: RunSpec) -> None:
    """A 422 for what the service's backend cannot do: what only the Ray backend can, asked
    of a service without one; a shape vLLM's CPU build cannot serve (``Shape.cpu``) or the
    machine's memory cannot hold (``shapes.cpu_memory_problem``), asked of
    a service that starts its servers on CPUs, unless a registered server serves it."""
    if spec.driver_nodes > 1 and not request.app.state.settings.ray_address:
        raise Invalid(f"driver_nodes {spec.driver_nodes} spreads the load drivers over several nodes: "
                      "that needs a Ray cluster (DECODEBENCH_RAY_ADDRESS); this service runs them "
                      "on its own machine, where driver_nodes must be 1")
    fleet = request.app.state.scheduler.fleet
    problem = spec.shape_cpu_problem(fleet.cpu_memory_bytes())
    if problem is not None and fleet.on_cpu() and spec.model not in _registered_lengths(request):
        raise Invalid(f"{problem}. This service starts its servers on CPUs (no GPUs: DECODEBENCH_GPUS); "
                      "the shape stays for a service with GPUs, a CPU machine with the memory "
                      "(DECODEBENCH_CPU_MEMORY_GIB says how much the service's servers have), "
                      "or a registered server")


def check_size(request: Request, spec: RunSpec) -> None:
    """A 422 for a run asking more output tokens than ``max_run_output_tokens``: the service
    holds every request's gaps in memory while it measures and summarises a run."""
    limit = request.app.state.settings.max_run_output_tokens
    requests = spec.prompt_budget()
    tokens = requests * spec.output_len
    if tokens <= limit:
        return
    named = "stop.max_prompts" if requests != spec.num_prompts else "num_prompts"
    raise Invalid(f"{named} x output_len is {requests:,} x {spec.output_len:,} = {tokens:,} output tokens; "
                  f"{over_limit(limit, tokens)}. Split it into runs of fewer requests, or raise the limit "
                  "where the memory is there")


def over_limit(limit: int, tokens: int) -> str:
    """Why a run of ``tokens`` output tokens, over ``limit``, is refused: the words of every
    refusal by ``max_run_output_tokens`` (a run's, a sweep point's, a capacity search's)."""
    return (f"a run may ask for at most {limit:,} (DECODEBENCH_MAX_RUN_OUTPUT_TOKENS): the service holds "
            f"every request's token gaps in memory while it measures and summarises a run, about "
            f"{RUN_BYTES_PER_TOKEN} bytes a token ({tokens * RUN_BYTES_PER_TOKEN / 1e9:.1f} GB for this one)")


def check_model(request: Request, engine: Engine, model: str) -> None:
    """A 422 now for a model no worker could load (``service.control.hub``), rather than a failed
    run once a worker was started for it; a model a registered server serves is its own."""
    if any(w.external and w.model == model for w in workers.active_workers(engine)):
        return
    problem = hub.model_problem(model, request.app.state.settings.hub_check)
    if problem is not None:
        raise Invalid(problem)


def check_fits(request: Request, engine: Engine, specs: Sequence[RunSpec]) -> None:
    """A 422 now for a run longer than its model takes: a registered server's, as its
    /v1/models said; a hub model's, read from its cached config (``RunSpec`` checks local
    directories and the tiny model itself)."""
    served = _registered_lengths(request)
    for spec in specs:
        if spec.model in served and (problem := _registered_problem(spec, served[spec.model])):
            raise Invalid(f"model {spec.model!r}: {problem}")
    if request.app.state.settings.hub_check == "off":
        return
    registered = {w.model for w in workers.active_workers(engine) if w.external}
    limits: dict[str, MaxLen | None] = {}
    for spec in specs:
        if spec.model in registered:  # a registered server's length is its own
            continue
        if spec.model not in limits:
            limits[spec.model] = hub.cached_max_len(spec.model)
        if (problem := spec.length_problem(limits[spec.model])) is not None:
            raise Invalid(f"model {spec.model!r}: {problem}")


def _registered_lengths(request: Request) -> dict[str, list[tuple[str, int | None]]]:
    """Per model that registered servers serve: each server's URL and longest sequence."""
    out: dict[str, list[tuple[str, int | None]]] = {}
    for handle in list(request.app.state.scheduler.fleet.workers.values()):
        if handle.external:
            out.setdefault(handle.served_model, []).append((handle.url, handle.max_model_len))
    return out


def _registered_problem(spec: RunSpec, servers: Sequence[tuple[str, int | None]]) -> str | None:
    """Why the run would not fit the registered servers of its model: any of them may take
    it, so it must fit the shortest that said its length."""
    known = [(length, url) for url, length in servers if length is not None]
    if not known:
        return None
    length, url = min(known)
    return spec.length_problem(MaxLen(length, f"max_model_len of the registered server {url}"),
                               judge_engine=False)


def check_search_size(request: Request, body: CapacityCreate) -> None:
    """A 422 for a search whose largest run would ask more output tokens than
    ``max_run_output_tokens`` (``check_size``'s rule for one run): the probe at its
    ceiling, and with a measured prefill side the run at its ``max_rate``. Refused rather than
    capped: the ceiling is part of the question (a search that reaches it answers "at least"
    it), so the caller picks the lower one, which the refusal names."""
    limit = request.app.state.settings.max_run_output_tokens
    ceiling, output_len = body.ceiling(), body.base.output_len
    requests = probe_prompts(ceiling)
    if requests * output_len > limit:
        asked = (f"max_concurrency {ceiling}" if body.max_concurrency is not None
                 else f"the default ceiling {ceiling} (no max_concurrency given)")
        fits = limit // output_len // PROBE_WAVES  # probe_prompts(c) <= limit // output_len
        fix = (f"Give max_concurrency at most {fits:,}, a shorter output_len"
               if fits * PROBE_WAVES >= MIN_PROBE_PROMPTS
               else f"Even the first probe sends {MIN_PROBE_PROMPTS} requests: lower output_len to at most "
                    f"{limit // MIN_PROBE_PROMPTS:,}")
        raise Invalid(f"the probe at {asked} sends {requests:,} requests: {requests:,} x {output_len:,} = "
                      f"{requests * output_len:,} output tokens; {over_limit(limit, requests * output_len)}. "
                      f"{fix}, or raise the limit where the memory is there")
    if body.prefill is not None:
        asked_rate = body.prefill.max_rate
        requests = body.prefill.prompts_at(asked_rate)
        if requests > limit:  # one output token each
            raise Invalid(f"the prefill run at max_rate {asked_rate:g}/s sends {requests:,} requests of one "
                          f"output token (for duration_s {body.prefill.duration_s:g}); "
                          f"{over_limit(limit, requests)}. Lower max_rate or duration_s, or raise the limit "
                          "where the memory is there")
