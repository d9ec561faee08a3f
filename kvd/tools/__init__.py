"""Operator tools built on the client: `kvd top` (a live view of a daemon)."""
