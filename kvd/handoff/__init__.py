"""Moving a request's KV between daemons: tickets, the link, plans, the inbox and the outbox."""
