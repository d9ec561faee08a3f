"""The unified KV pool: layouts and presets, per-group allocators, placement, compaction, sizing."""
