"""The srdd-compare console script: what the command's process sets before the command's
imports load numpy (cli/compare.py), then the command."""

from __future__ import annotations

from srdd_dump.runtime.blas import one_blas_thread_from_load


def main() -> None:
    one_blas_thread_from_load()  # numpy's BLAS at one thread: before cli/compare.py loads it
    from srdd_dump.cli.compare import main as command

    command()


if __name__ == "__main__":
    main()
