"""Put on PYTHONPATH by ``srdd-dump --exec``: starts capture in every Python process."""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

try:
    from srdd_dump.capture.inject import install

    install()
except Exception as _exc:  # never stop the user's interpreter from starting
    sys.stderr is None or sys.stderr.write(
        f"srdd-dump: warning: capture unavailable in {sys.executable}: "
        f"{type(_exc).__name__}: {_exc}\n"
    )

# Chain to the sitecustomize this one shadows, if any.
_saved = sys.modules.pop("sitecustomize", None)
_path = list(sys.path)
try:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    import importlib.util

    if importlib.util.find_spec("sitecustomize") is not None:
        import sitecustomize  # noqa: F401
except Exception:
    pass
finally:
    sys.path[:] = _path
    if _saved is not None:
        sys.modules["sitecustomize"] = _saved
