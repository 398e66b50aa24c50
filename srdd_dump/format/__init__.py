"""The dump file format: schema (shared), writer (capture side) and reader (compare side)."""
