"""``FillConnector``: the class vLLM instantiates, once per role.

A thin facade in the way of vLLM's own connectors: in the scheduler process it
builds a :class:`FillConnectorScheduler`, in each worker process a
:class:`FillConnectorWorker`; everything else is inherited from vLLM's
``DecodeBenchConnector``, which routes each hook to the side that owns it. The three hooks
around a forward pass also drive the worker's step clock (``connector.steps``).

Runs on vLLM 0.32 and 0.33: both call the hooks with the signatures used here (the
constructor with ``kv_cache_config``, ``handle_preemptions`` with the metadata), and
``tests/test_vllm_versions.py`` holds this class to 0.33's published sources.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnector,
)

from connector.metadata import FillConnectorMetadata
from connector.scheduler import FillConnectorScheduler
from connector.worker import FillConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["FillConnector", "FillConnectorMetadata"]


class FillConnector(DecodeBenchConnector):  # type: ignore[misc]
    """KV connector that fills prompt KV blocks with per-run values instead of prefilling."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        # Skip DecodeBenchConnector.__init__: it would build vLLM's sides, not ours.
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler: FillConnectorScheduler | None = None
        self.connector_worker: FillConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = FillConnectorScheduler(vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = FillConnectorWorker(vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: nothing is handed off, so a preempted request's in-flight output is kept.

        vLLM's default is the producer role, True for ``kv_both``: under async scheduling vLLM
        would then drop a preempted request's in-flight tokens, guarding a hand-off that this
        connector never makes.
        """
        return False

    # The step clock (``connector.steps``): vLLM calls these three around every forward pass.

    def bind_connector_metadata(self, connector_metadata: FillConnectorMetadata) -> None:
        """The step's metadata: its forward runs next."""
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None and self.connector_worker.clock is not None:
            self.connector_worker.clock.begin(getattr(connector_metadata, "step", None))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Fill this step's blocks; the fill's time is not the forward's."""
        clock = self.connector_worker.clock if self.connector_worker is not None else None
        if clock is not None:
            clock.load_begin()
        super().start_load_kv(forward_context, **kwargs)
        if clock is not None:
            clock.load_end()

    def wait_for_save(self) -> None:
        """After the step's forward (and any draft forward)."""
        super().wait_for_save()
        if self.connector_worker is not None and self.connector_worker.clock is not None:
            self.connector_worker.clock.end()

    def shutdown(self) -> None:
        """Stop background threads and send the last counters."""
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        super().shutdown()
