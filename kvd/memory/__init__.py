"""Arenas: the byte regions a pool lives in (shared memory, CUDA virtual memory)."""
