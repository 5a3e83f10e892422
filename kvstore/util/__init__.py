"""Low-level helpers every layer may use: zero-copy byte views and blocking work off the event loop."""
