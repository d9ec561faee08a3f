"""The wire: conversions between records and v1 messages, request parsing, status mapping."""
