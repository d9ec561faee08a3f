"""A daemon's state around its pool: sessions, ownership, leases, the sweep."""
