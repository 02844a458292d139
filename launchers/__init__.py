"""Programs nodectl sends to nodes. Each is self-contained: it imports nothing from nodectl."""
