"""KV hand-off between prefill and decode workers (``base`` has the interface and the
lifecycle; ``README.md`` lists the parts)."""
