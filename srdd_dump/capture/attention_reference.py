"""The attention sub-layer recomputed from its own input on the host, for the probe rows only
(docs/method.md, "Reference attention"), in float32 (float64 for a float64 model:
host_weights.reference_dtype; the rotary angles always in float64).

The reference is srdd-dump's own attention, not the model's code: the projections' weights
(q, k, v, o; q/k norms where the model has them), the rotary table rebuilt from the rotary
module's inverse frequencies and the positions the layer was given, the scale from the model
config (1/sqrt(head_dim), or the config's own query scalar), the causal and padding mask from
the model call's 2-D attention mask, each query head reading KV head ``h // (heads /
kv_heads)``, softmax in the reference's dtype. A kernel bug in any of those (softmax
precision, a scale applied twice, a rotary offset or a mask off by one at decode, a wrong GQA
head mapping, a clamp inside a projection) moves the device's output away from it; the keys
and values of earlier steps are read from the KV cache as the device stored them.

Only the Hugging Face layout is recognised (``q_proj``/``k_proj``/``v_proj`` or a fused
``qkv_proj``, and ``o_proj``; rotary ``inv_freq`` tables in the rotate-half convention);
another layout, a sliding-window cache, logit soft-capping or attention sinks: no reference
(``AttentionLayout.why_not``), reported in the dump's coverage.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from .host import HELD_ELSEWHERE, weight_held_elsewhere
from .host_weights import F64, HOST, HostWeights, reference_dtype
from .probes import cache_in, cache_layer, layer_index

# host multiply-adds one reference may take (the keys and values of the rows before
# the last probe row dominate); a longer call is not checked, and the coverage says so
BUDGET = 4e9
CACHE_KEYS = ("past_key_values", "past_key_value", "cache", "layer_past")
# the rotary table the model passed must agree with the rebuilt one at a prefill to this
# relative distance, or the model's rotary convention is not the one recognised here (another
# convention differs by O(1); a table rounded to bf16 by 4e-3 passes, and is then found)
ROTARY_AGREEMENT = 0.05


class AttentionLayout(NamedTuple):
    """How to recompute one attention module, or why it cannot be."""

    projections: tuple  # (q, k, v) modules, or (qkv,) fused; o last: (q, k, v, o) / (qkv, o)
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int | None  # sliding window of this layer (keys further back are masked)
    rotary: tuple[nn.Module, str] | None  # (module, attribute) of the rotary inverse
    # frequencies, read at each call (a dynamic or long-context rope updates them); None: none
    rotary_scaling: float
    layer: int | None  # its KV-cache layer
    rope_off: bool = False  # a layer that declares it uses no rotary (SmolLM3's use_rope)


def _config_value(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def rotary_of(module: nn.Module, model: nn.Module, layer_type: str | None,
              found: dict | None = None) -> tuple[tuple[nn.Module, str], float] | None:
    """((rotary module, attribute of its inverse frequencies), attention scaling) of the
    attention's rotary table: its own rotary module's or the model's; a model with one table
    per layer type (Gemma 3: sliding and full attention) holds them as
    ``{layer_type}_inv_freq`` (transformers 5) or in a ``*_local`` module (4.5x). ``found``
    keeps the model's answers between the calls of one model's attentions (its walk over
    every module of the model, for each of 30 layers, was a tenth of a plain generation)."""
    prefixes = ((f"{layer_type}_",) if layer_type else ()) + ("",)
    # transformers 4.5x's Gemma 3 keeps the sliding layers' table in a second module
    # (``rotary_emb_local``): a sliding attention looks there first
    sliding = layer_type == "sliding_attention" or getattr(module, "is_sliding", False) is True
    table = _rotary_in(module, prefixes, sliding)
    if table is not None:
        return table
    key = (id(model), prefixes, sliding)
    if found is None or key not in found:
        table = _rotary_in(model, prefixes, sliding)
        if found is None:
            return table
        found[key] = table
    return found[key]


def _rotary_in(owner: nn.Module, prefixes: tuple[str, ...], sliding: bool
               ) -> tuple[tuple[nn.Module, str], float] | None:
    named = list(owner.named_modules())
    if sliding:
        named.sort(key=lambda item: "local" not in item[0].rsplit(".", 1)[-1])
    for _, m in named:
        for prefix in prefixes:
            table = getattr(m, f"{prefix}inv_freq", None)
            if isinstance(table, torch.Tensor):
                scaling = getattr(m, f"{prefix}attention_scaling", 1.0)
                return (m, f"{prefix}inv_freq"), float(scaling or 1.0)
    return None


def inv_freq(layout: AttentionLayout) -> torch.Tensor | None:
    """The rotary inverse frequencies as they are now, float64 on the host."""
    if layout.rotary is None:
        return None
    owner, name = layout.rotary
    return getattr(owner, name).detach().to(HOST, F64)


# attributes of attention variants the reference does not model: Llama 4's L2 q/k norm,
# temperature tuning and chunked attention
UNMODELLED = ("qk_norm", "attn_temperature_tuning", "attention_chunk_size", "sinks")


def attention_layout(module: nn.Module, model: nn.Module, found: dict | None = None
                     ) -> AttentionLayout | str:
    """The layout of an attention module of the Hugging Face kind; a string says why not
    (``found``: rotary_of's answers for the model, kept between its attentions)."""
    children = dict(module.named_children())
    o = children.get("o_proj")
    if all(n in children for n in ("q_proj", "k_proj", "v_proj")):
        projections = (children["q_proj"], children["k_proj"], children["v_proj"], o)
    elif "qkv_proj" in children:
        projections = (children["qkv_proj"], o)
    else:
        return "no q/k/v projections by name"
    if o is None:  # OPT's and BART's out_proj: their attention scales q itself, BART's may
        # attend another sequence (cross-attention): not modelled
        return "no o_proj output projection (an out_proj layout is not modelled)"
    if any(p is not None and weight_held_elsewhere(p) for p in projections):
        return HELD_ELSEWHERE
    if not all(isinstance(p, nn.Linear) and p.weight.is_floating_point()
               for p in projections):
        return "projections that are not floating-point torch Linear modules"
    config = getattr(module, "config", None) or getattr(model, "config", None)
    if config is None:
        return "no model config"
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    if _config_value(config, "attn_logit_softcapping") or any(
            getattr(module, name, None) not in (None, False) for name in UNMODELLED):
        return "logit soft-capping, attention sinks, chunked attention or an L2 q/k norm"
    heads = _config_value(config, "num_attention_heads")
    kv_heads = _config_value(config, "num_key_value_heads") or heads
    if not heads:
        return "no head count in the config"
    head_dim = int(getattr(module, "head_dim", 0) or _config_value(config, "head_dim")
                   or config.hidden_size // heads)
    scalar = _config_value(config, "query_pre_attn_scalar")
    scale = _config_value(config, "attention_multiplier")
    scale = float(scale) if scale is not None else (float(scalar or head_dim) ** -0.5)
    layer = layer_index(module)
    window = None
    types = _config_value(config, "layer_types")
    layer_type = getattr(module, "layer_type", None) or (
        types[layer] if types and layer is not None and layer < len(types) else None)
    if "sliding_window" in vars(module):  # the module's own (None: a full-attention layer)
        window = module.sliding_window if getattr(module, "is_sliding", True) else None
        window = int(window) if window else None
    elif _config_value(config, "sliding_window") and (
            layer_type == "sliding_attention"
            or (not types and _config_value(config, "use_sliding_window") is not False)):
        window = int(config.sliding_window)
    width = projections[0].out_features
    if width != (heads + (2 * kv_heads if len(projections) == 2 else 0)) * head_dim or (
            len(projections) == 4 and projections[1].out_features != kv_heads * head_dim):
        return "projections of another width than the config's heads (sharded?)"
    rotary, scaling = rotary_of(module, model, layer_type, found) or (None, 1.0)
    rope_off = getattr(module, "use_rope", True) in (False, 0)  # SmolLM3's no-rope layers
    if rope_off:
        rotary = None
    if rotary is not None and 2 * getattr(*rotary).numel() > head_dim:
        return "a rotary table wider than a head"
    if heads % kv_heads:
        return "query heads that are not a multiple of the KV heads"
    return AttentionLayout(
        projections, getattr(module, "q_norm", None), getattr(module, "k_norm", None),
        int(heads), int(kv_heads), head_dim, scale, window, rotary, scaling, layer, rope_off)




def _norm(module: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """A per-head norm (Qwen3's q_norm / k_norm): RMS norm with its weight, in x's dtype."""
    if module is None:
        return x
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return y
    weight = weight.detach().to(HOST, x.dtype)
    # Gemma's norms scale by (1 + weight)
    return y * (1.0 + weight) if type(module).__name__.startswith("Gemma") else y * weight


def rotary_table(layout: AttentionLayout, positions: torch.Tensor,
                 dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin) of the positions, (..., rotary width), rotate-half layout, in ``dtype``
    (the angles in float64: in float32 they would be off by ~1e-4 at position 4,000)."""
    table = inv_freq(layout)
    if table is None:
        return None
    freqs = positions.to(F64)[..., None] * table
    emb = torch.cat([freqs, freqs], dim=-1)
    return ((emb.cos() * layout.rotary_scaling).to(dtype),
            (emb.sin() * layout.rotary_scaling).to(dtype))


def _rotate(x: torch.Tensor, table) -> torch.Tensor:
    """x (..., heads, head_dim) rotated by table (..., width) on its first ``width`` dims."""
    if table is None:
        return x
    cos, sin = (t.unsqueeze(-2) for t in table)
    width = cos.shape[-1]
    part, rest = x[..., :width], x[..., width:]
    half = width // 2
    turned = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
    return torch.cat([part * cos + turned * sin, rest], dim=-1)


def _qkv(layout: AttentionLayout, x: torch.Tensor, weights: HostWeights
         ) -> tuple[torch.Tensor, ...]:
    """Projected queries, keys, values of rows x (n, hidden): (n, heads, head_dim) each."""
    h, kv, d = layout.heads, layout.kv_heads, layout.head_dim
    if len(layout.projections) == 2:
        q, k, v = weights.linear(layout.projections[0], x).split([h * d, kv * d, kv * d],
                                                                  dim=-1)
    else:
        q, k, v = (weights.linear(p, x) for p in layout.projections[:3])
    q = _norm(layout.q_norm, q.reshape(-1, h, d))
    k = _norm(layout.k_norm, k.reshape(-1, kv, d))
    return q, k, v.reshape(-1, kv, d)


class PastKV(NamedTuple):
    """One layer's keys and values of the tokens before a call, as its KV cache holds them."""

    keys: torch.Tensor  # (batch, kv_heads, held, head_dim): positions start .. length - 1
    values: torch.Tensor
    start: int  # the first position held (a sliding-window cache drops the oldest)
    length: int  # tokens before the call


def find_cache(args: tuple, kwargs: dict) -> Any:
    """The KV cache object of a call, or None."""
    cache = cache_in(args, kwargs)
    if cache is None:
        cache = next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)
    return cache


def past_kv(cache: Any, layer: int | None, seq: int = 0, copy: bool = False
            ) -> PastKV | None | str:
    """The past of cache layer ``layer``: read before the call (``seq`` 0; ``copy``: the
    tensors cloned, as the call may update them in place) or after a call of ``seq`` tokens.
    None without a cache; a string: a cache this cannot read."""
    if cache is None:
        return None
    if layer is None:
        return "a KV cache without a layer index"
    keys, values = cache_layer(cache, layer)
    if isinstance(keys, str):
        return "a KV cache layout srdd-dump does not know"
    try:
        length = int(cache.get_seq_length(layer)) - seq
    except Exception:  # noqa: BLE001 (a cache class of another layout)
        return "a KV cache layout srdd-dump does not know"
    if keys is None and length <= 0:
        return None  # a layer not filled yet: no past
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape != values.shape:
        return "a KV cache layout srdd-dump does not know"
    if length < 0:
        return "a KV cache shorter than the call"
    held = keys.shape[-2]
    if held >= length + seq:  # everything held (a static cache: its first rows)
        keys, values, start = keys[..., :length, :], values[..., :length, :], 0
    else:  # a sliding window: the last ``held`` tokens, the call's own last
        n = max(0, held - seq)
        keys, values, start = keys[..., :n, :], values[..., :n, :], length - n
    if copy:
        keys, values = keys.detach().clone(), values.detach().clone()
    return PastKV(keys, values, start, length)


def reference_rows(layout: AttentionLayout, x: torch.Tensor, rows: list[tuple[int, int]],
                   positions: torch.Tensor, past: PastKV | None, key_mask: torch.Tensor | None,
                   device_out: torch.Tensor, weights: HostWeights) -> torch.Tensor | str:
    """The reference attention output of ``rows`` ((batch index, row) pairs of ``x``, the
    module's hidden-state input (batch, seq, hidden)): (len(rows), hidden). ``positions``:
    the rotary position of every row (batch or 1, seq); ``past``: the keys and values of the
    tokens before the call (``past_kv``); ``key_mask``: the
    model call's 2-D mask (batch, past + seq), nonzero where a key is attended. A query row
    that may attend no key (padding) takes the device's own row (``device_out``, (len(rows),
    hidden)): not judged."""
    batch, seq, _ = x.shape
    start = past.start if past is not None else 0
    past_keys = past.keys if past is not None else None
    past_values = past.values if past is not None else None
    past = past.length if past is not None else 0
    if past and start > (0 if layout.window is None else max(0, past - layout.window + 1)):
        return "a sliding-window KV cache that no longer holds keys the window reads"
    last = max(i for _, i in rows)
    cost = batch * (last + 1) * x.shape[-1] * 2 * layout.kv_heads * layout.head_dim
    if cost > BUDGET:
        return "a call too long for the host budget"
    group = layout.heads // max(1, layout.kv_heads)
    dtype = reference_dtype(x)
    out = device_out.detach().to(HOST, dtype).clone()
    o_proj = layout.projections[-1]
    for b in sorted({b for b, _ in rows}):
        mine = [(n, i) for n, (bb, i) in enumerate(rows) if bb == b]
        upto = max(i for _, i in mine) + 1
        pos = positions[min(b, positions.shape[0] - 1)].to(HOST)
        q, k, v = _qkv(layout, x[b, :upto].detach().to(HOST, dtype), weights)
        k = _rotate(k, rotary_table(layout, pos[:upto], dtype))
        if past:  # the held past (positions start .. past - 1)
            keys = past_keys[b].detach().to(HOST, dtype).transpose(0, 1)
            values = past_values[b].detach().to(HOST, dtype).transpose(0, 1)
            k, v = torch.cat([keys, k]), torch.cat([values, v])
        index = torch.tensor([i for _, i in mine])
        qr = _rotate(q[index], rotary_table(layout, pos[index], dtype))  # (m, heads, d)
        kh = k.repeat_interleave(group, dim=1)  # (keys, heads, d)
        vh = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,khd->hmk", qr, kh) * layout.scale
        key_at = torch.arange(start, past + upto)
        allowed = key_at[None, :] <= (past + index)[:, None]
        if layout.window is not None:
            allowed &= key_at[None, :] > (past + index)[:, None] - layout.window
        if key_mask is not None and key_mask.shape[-1] >= past + upto:
            attended = key_mask[b, start:past + upto].to(HOST) != 0
            allowed &= attended[None, :]
        live = allowed.any(dim=1)
        scores = scores.masked_fill(~allowed[None], -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        heads = torch.einsum("hmk,khd->mhd", probs, vh).reshape(len(mine), -1)
        ref = weights.linear(o_proj, heads)
        for (n, _), row, ok in zip(mine, ref, live.tolist()):
            if ok:
                out[n] = row
    return out


def one_query_keys(mask: Any) -> torch.Tensor | None:
    """The keys a one-token call attends, (batch, keys), read from its 4-D mask (batch, 1 or
    heads, 1, keys; what generate passes a model with a static cache at a decode step): a
    boolean mask as it is, an additive float one where it is 0. None for any other mask."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] != 1:
        return None
    row = mask[:, 0, 0, :].detach()
    if row.dtype == torch.bool:
        return row
    return row == 0 if row.is_floating_point() else None


def first_call_padding(mask: Any) -> torch.Tensor | None:
    """The 2-D padding mask (batch, queries) of a first call (no cached tokens) given a 4-D mask
    (batch, 1 or heads, queries, keys; a static cache's prefill: keys the whole buffer) that is
    causal with key padding and nothing else: each row attends itself unless it is padding,
    and every row that does attends exactly the unpadded keys at or before it. None for any
    other mask (a past in it, a sliding window, packed sequences' block-diagonal masks: the
    reference would attend keys the model does not)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] < 2:
        return None
    q, k = mask.shape[-2], mask.shape[-1]
    if k < q:
        return None
    allowed = mask[:, 0].detach()
    if allowed.dtype != torch.bool:
        if not allowed.is_floating_point():
            return None
        allowed = allowed == 0
    if k > q and bool(allowed[:, :, q:].any()):
        return None
    keys = torch.diagonal(allowed[:, :, :q], dim1=-2, dim2=-1)  # (batch, q)
    causal = torch.ones(q, q, dtype=torch.bool, device=allowed.device).tril()
    expected = causal[None] & keys[:, None, :]
    rows = keys[:, :, None].expand_as(expected)  # the padded query rows are not checked
    if not torch.equal(allowed[:, :, :q][rows], expected[rows]):
        return None
    return keys


def row_positions(kwargs: dict, seq: int, cache: PastKV | None) -> torch.Tensor:
    """The rotary position of every row of the call (batch or 1, seq): the ``position_ids``
    the layer was given, else its ``cache_position``, else the rows after the cached past."""
    given = kwargs.get("position_ids")
    if isinstance(given, torch.Tensor) and given.shape[-1] == seq:
        return given.detach().reshape(-1, seq).to(HOST)
    given = kwargs.get("cache_position")
    if isinstance(given, torch.Tensor) and given.numel() == seq:
        return given.detach().reshape(1, seq).to(HOST)
    past = 0 if cache is None else cache.length
    return torch.arange(past, past + seq).reshape(1, seq)


def rotary_agrees(layout: AttentionLayout, table: Any, positions: torch.Tensor) -> bool:
    """Whether the (cos, sin) the model passed its attention is the rebuilt table of the same
    positions (checked at a prefill: a model of another rotary convention, interleaved or
    per-length, gets no reference rather than a false alarm). True when there is nothing to
    check."""
    if table is None:
        return True  # nothing passed to compare with
    if layout.rotary is None:
        # a table passed to an attention without one: unused only where the layer says so
        return layout.rope_off
    if not (isinstance(table, (tuple, list)) and len(table) == 2
            and all(isinstance(t, torch.Tensor) and not t.is_complex() for t in table)):
        return False  # another form (Llama 4's complex freqs_cis)
    theirs = table[0].detach().to(HOST, F64)
    ours = rotary_table(layout, positions)[0]
    if theirs.shape[-1] != ours.shape[-1] or theirs.shape[-2] != ours.shape[-2]:
        return False
    theirs = theirs.reshape(-1, *ours.shape[-2:])
    ours = ours.reshape(-1, *ours.shape[-2:])
    if theirs.shape[0] not in (1, ours.shape[0]) and ours.shape[0] != 1:
        return False
    gap = (theirs - ours).norm() / max(float(ours.norm()), 1e-30)
    return float(gap) <= ROTARY_AGREEMENT


def attention_layouts(model: nn.Module, modules: list[nn.Module]
                      ) -> dict[int, AttentionLayout | str]:
    """id(module) -> its layout (or why none) for each attention module of ``modules``; a
    module whose config cannot be read gets the error as its reason."""
    out: dict[int, AttentionLayout | str] = {}
    found: dict = {}
    for m in modules:
        try:
            out[id(m)] = attention_layout(m, model, found)
        except Exception as exc:  # noqa: BLE001 (a config of another shape: never fatal)
            out[id(m)] = f"{type(exc).__name__}: {exc}"
    return out
