"""decodebench's vLLM KV connector: fills a request's KV cache instead of prefilling it.

vLLM loads it with ``kv_connector_module_path="connector"`` and
``kv_connector="FillConnector"``; fill parameters are pulled per run from the
decodebench service (see ``connector.params``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.facade import FillConnector, FillConnectorMetadata

__all__ = ["FillConnector", "FillConnectorMetadata"]


def __getattr__(name: str) -> Any:
    # vLLM looks the class up on this package once it has imported it: the facade (and
    # vLLM with it) is imported then, so the modules that need no vLLM (``params``,
    # ``report``, ``provenance``) import without it.
    if name in __all__:
        from connector import facade

        return getattr(facade, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
