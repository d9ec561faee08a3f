"""Engine adapters over kvd.client (a real engine's own extension point)."""
