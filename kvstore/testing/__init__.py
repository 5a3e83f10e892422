"""For backend authors and tests: an in-memory backend, test helpers, and the backend conformance suite.

The suite, :class:`kvstore.testing.conformance.BackendTests`, needs pytest and pytest-asyncio;
import it from its module. Nothing here imports pytest.
"""

from kvstore.testing.helpers import listed_keys, read_chunk, read_layer, write_chunk
from kvstore.testing.memory import MemoryBackend

__all__ = ["MemoryBackend", "listed_keys", "read_chunk", "read_layer", "write_chunk"]
