"""For backend authors and tests: an in-memory backend and the backend conformance suite."""
