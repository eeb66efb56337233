"""decodebench's vLLM KV connector: fills a request's KV cache instead of prefilling it.

vLLM loads it with ``kv_connector_module_path="connector"`` and
``kv_connector="FillConnector"``; fill parameters are pulled per run from the
decodebench service (see ``connector.params``).
"""

from connector.facade import FillConnector, FillConnectorMetadata

__all__ = ["FillConnector", "FillConnectorMetadata"]
