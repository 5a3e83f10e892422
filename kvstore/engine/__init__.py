"""The store itself: the DRAM pool, the cascade to the tiers below it, layer streams, the sync facade, metrics."""
