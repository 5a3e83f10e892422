"""Low-level helpers every layer may use: zero-copy byte views, blocking work off the event loop, units."""
