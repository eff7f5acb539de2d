"""KV hand-off between prefill and decode workers (see ``base`` for the lifecycle)."""
