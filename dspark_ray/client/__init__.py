"""What a serving engine embeds (numpy and msgspec, no ray): `DrafterClient` for one worker (`drafter_client.py`),
`DrafterPool` over several (`pool.py`), where each worker serves (`endpoints.py`, `cluster_join.py`), the demo
client (`demo.py`). The names an engine writes are re-exported here."""
from ..protocol.contract import Code
from .drafter_client import ClientError, DrafterClient
from .pool import DrafterPool

__all__ = ["ClientError", "Code", "DrafterClient", "DrafterPool"]
