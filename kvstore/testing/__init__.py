"""For backend authors and tests: an in-memory backend, test helpers, and the backend conformance suite.

The suite, :class:`kvstore.testing.conformance.BackendTests`, needs pytest and pytest-asyncio;
import it from its module. Nothing here imports pytest. Real Redis and S3 servers on this machine
(:mod:`kvstore.testing.servers`: the tests', ``kvstore dev-servers``' and each backend spec's
``dev_server``) are imported from their module too.
"""

from kvstore.testing.helpers import listed_keys, read_chunk, read_layer, write_chunk
from kvstore.testing.memory import MemoryBackend

__all__ = ["MemoryBackend", "listed_keys", "read_chunk", "read_layer", "write_chunk"]
