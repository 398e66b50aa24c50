"""What capture needs to know about the user's model and the torch settings it runs under:
its sites at a granularity, whether a call carries a KV cache, autocast and the fp32 matmul
precision, and its input embedding."""

from __future__ import annotations

import torch
from torch import nn

from ..vocabulary import NORM
from .attention_reference import find_cache
from .config import DumpConfig
from .discovery import Site, find_operators, find_sites
from .probes import is_cache, layer_index


def sites_of(model: nn.Module, blocks: list[tuple[str, nn.Module]], config: DumpConfig
           ) -> list[Site]:
    """The sub-layer sites of the granularity: none; the attention and MLP sub-blocks and the
    norms between them (those of the block itself, not inside a sub-block: a norm's fault
    changes the input every reference of a sub-layer starts from, so only its own site sees
    it); or those and every operator inside the blocks (a module named twice is kept once)."""
    if config.granularity == "block":
        return []
    sites = find_sites(blocks, config.sublayers)
    seen = {site.name for site in sites}
    if config.granularity == "op":
        sites += [op for op in find_operators(model, blocks) if op.name not in seen]
    elif config.sublayers is None:
        sites += [op for op in find_operators(model, blocks) if op.role == NORM
                  and not any(op.name.startswith(name + ".") for name in seen)]
    return sites


def has_past(args: tuple, kwargs: dict) -> bool:
    """The call carries a KV cache: a Cache object, or a legacy tuple cache argument."""
    if any(is_cache(v) for v in (*args, *kwargs.values())):
        return True
    return any(v is not None and ("past_key_value" in k or k == "layer_past")
               for k, v in kwargs.items())


def starts_sequence(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """A call whose KV cache (a Cache object) holds no earlier tokens for the module's layer:
    the first forward of a sequence, however short (a one-token prompt is a prefill, not the
    next decode step of the sequence before)."""
    return cached_tokens(module, args, kwargs) == 0


def cached_tokens(module: nn.Module, args: tuple, kwargs: dict, read_device: bool = False
                  ) -> int | None:
    """How many earlier tokens the call's KV cache (a Cache object) holds for the module's
    layer; None when there is no cache or its length cannot be read. A static cache keeps its
    length on the device: read (a host sync) only with ``read_device``, from the call's
    ``cache_position`` or ``position_ids`` (where its first new token goes)."""
    cache = find_cache(args, kwargs)
    if cache is None:
        return None
    try:
        length = cache.get_seq_length(layer_index(module) or 0)
    except Exception:  # noqa: BLE001 (a cache class of another layout: not known)
        return None
    if isinstance(length, int) or not read_device:
        return length if isinstance(length, int) else None
    for name in ("cache_position", "position_ids"):
        where = kwargs.get(name)
        if isinstance(where, torch.Tensor) and where.numel():
            return int(where.reshape(-1, where.shape[-1])[:, 0].min())
    return None


def autocast_dtype(model: nn.Module) -> str:
    """The autocast dtype in force for the model's device type ("" when autocast is off)."""
    param = next(model.parameters(), None)
    device = param.device.type if param is not None else "cpu"
    try:
        enabled, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    except (TypeError, RuntimeError, AttributeError):  # torch < 2.4 has no device argument
        enabled, dtype = _autocast_before_2_4(device)
    return str(dtype).replace("torch.", "") if enabled else ""


def _autocast_before_2_4(device: str) -> tuple[bool, object]:
    """Autocast's switch and dtype for ``device`` through the per-device functions of torch
    < 2.4 (``torch.npu``'s from torch_npu); (False, None) where there are none."""
    if device == "cpu":
        enabled, dtype = torch.is_autocast_cpu_enabled, torch.get_autocast_cpu_dtype
    elif device == "cuda":
        enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_gpu_dtype
    else:
        module = getattr(torch, device, None)
        enabled = getattr(module, "is_autocast_enabled", None)
        dtype = getattr(module, "get_autocast_dtype", None)
    try:
        return (True, dtype()) if enabled is not None and dtype is not None and enabled() \
            else (False, None)
    except (TypeError, RuntimeError, AttributeError):
        return False, None


def float32_matmul(device_type: str = "cuda") -> str:
    """The precision fp32 matmuls run in: "highest", "high" (TF32 / HF32: a 10-bit mantissa)
    or "medium" (bf16), from torch's setting and the CUDA / NPU TF32 / HF32 switches."""
    try:
        precision = torch.get_float32_matmul_precision()
    except Exception:  # noqa: BLE001 (torch >= 2.9 raises once its new API was used)
        precision = _fp32_precision(device_type) or "highest"
    switches = []
    try:
        switches.append(bool(torch.backends.cuda.matmul.allow_tf32))
    except Exception:  # noqa: BLE001 (the same)
        switches.append(_fp32_precision(device_type) == "high")
    npu = getattr(torch, "npu", None)
    try:
        switches.append(bool(npu.matmul.allow_hf32))  # torch_npu
    except Exception:  # noqa: BLE001
        pass
    if precision == "highest" and any(switches):
        return "high"
    return precision


def _fp32_precision(device_type: str) -> str | None:
    """torch >= 2.9's per-backend setting (the device's matmul backend: oneDNN on the CPU,
    else cuBLAS; "none" defers to ``torch.backends.fp32_precision``) in the words of
    float32_matmul: "high" for tf32, "medium" for bf16, "highest" for ieee; None when unset."""
    try:
        backend = torch.backends.mkldnn if device_type == "cpu" else torch.backends.cuda
        value = backend.matmul.fp32_precision
        if value == "none":
            value = torch.backends.fp32_precision
    except Exception:  # noqa: BLE001 (an older torch)
        return None
    return {"tf32": "high", "bf16": "medium", "ieee": "highest"}.get(str(value))


def input_embedding(model: nn.Module) -> nn.Module | None:
    """The module that turns token ids into the first hidden states."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            module = get()
            if isinstance(module, nn.Module):
                return module
        except Exception:
            pass
    # nn.Embedding, or an engine's own (vLLM's VocabParallelEmbedding): the token table
    return next((m for m in model.modules() if isinstance(m, nn.Embedding) or (
        type(m).__name__.endswith("Embedding") and isinstance(
            getattr(m, "num_embeddings", None), int))), None)
