"""Thin typer front ends; installed as srdd_dump.cli."""
