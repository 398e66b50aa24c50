"""srdd-dump: find the layer that breaks an LLM on an NPU.

Capture (needs torch): ``register_hook(model, DumpConfig(...))``.
Compare (numpy + h5py + pandas only): ``srdd_dump.compare`` returns typed results,
``srdd_dump.report.write_report`` renders them.
"""

from .capture.config import DumpConfig
from .version import __version__

__all__ = ["DumpConfig", "register_hook", "__version__"]


def __getattr__(name: str):
    # Capture imports torch; keep it lazy so that the compare side runs without torch.
    if name == "register_hook":
        from .capture.hooks import register_hook

        return register_hook
    raise AttributeError(name)
