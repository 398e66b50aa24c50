"""Capture side (the only part that imports torch): hooks, block discovery, --exec injection."""
