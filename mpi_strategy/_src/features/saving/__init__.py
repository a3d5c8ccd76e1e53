"""A save called on every rank writes once per filesystem (write points)."""
