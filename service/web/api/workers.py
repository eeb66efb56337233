"""Workers: the vLLM servers the service started, and those registered from elsewhere."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service.control.vllm_cli import serve_command
from service.core.errors import NotFound, shown
from service.core.servers import WorkerRegister
from service.storage import workers
from service.web.deps import ADMIN, DB, READ, Sched
from service.web.errors import ERROR_RESPONSES
from service.web.schemas import ClusterPublic, WorkerPublic, WorkerRegistered

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/api/workers", response_model=list[WorkerPublic], dependencies=READ)
def list_workers(engine: DB) -> list[WorkerPublic]:
    """vLLM servers the service started or was told about, newest first."""
    return [WorkerPublic.model_validate(w, from_attributes=True) for w in workers.list_workers(engine)]


@router.get("/api/cluster", response_model=ClusterPublic, dependencies=READ)
async def get_cluster(scheduler: Sched) -> ClusterPublic:
    """Where servers and load drivers run: the hosts (Ray's alive nodes with their CPUs
    and GPUs, or this machine), each with the servers and the runs' driver shards on it."""
    return ClusterPublic.model_validate(scheduler.fleet.cluster())


@router.post("/api/workers", status_code=201, response_model=WorkerRegistered, dependencies=ADMIN)
async def register_worker(body: WorkerRegister, request: Request, scheduler: Sched) -> WorkerRegistered:
    """Register a vLLM server started elsewhere; the answer holds its worker token and the
    exact ``vllm serve`` line to start it with (shown once)."""
    settings = request.app.state.settings
    worker, token = await scheduler.fleet.registered.register(body)
    control_url = body.control_url or settings.control_base_url()
    command, config = serve_command(body, control_url, token)
    scheduler.probe_now()
    public = WorkerPublic.model_validate(worker, from_attributes=True)
    return WorkerRegistered(**public.model_dump(), token=token, kv_transfer_config=config,
                            vllm_serve=command)


@router.get("/api/workers/{worker_id}", response_model=WorkerPublic, dependencies=READ)
def get_worker(worker_id: str, engine: DB) -> WorkerPublic:
    """One vLLM server: where it is, its status and why."""
    worker = workers.get_worker(engine, worker_id)
    if worker is None:
        raise NotFound(f"worker {shown(worker_id)} not found")
    return WorkerPublic.model_validate(worker, from_attributes=True)


@router.delete("/api/workers/{worker_id}", status_code=204, dependencies=ADMIN)
async def remove_worker(worker_id: str, scheduler: Sched) -> Response:
    """Remove a registered server: no more runs go to it and its token stops working;
    409 while it serves a run."""
    await scheduler.fleet.registered.deregister(worker_id)
    return Response(status_code=204)
