"""Unix-socket plumbing shared by the daemon's local servers: the accept loop, fd passing."""
