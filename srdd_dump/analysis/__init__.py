"""Per-layer statistics (numpy only) and the rules that turn them into a verdict."""
