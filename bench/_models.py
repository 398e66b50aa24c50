"""Models and inputs shared by bench/perf.py and bench/msprobe_bench.py (which runs in another
Python environment, the one that has msprobe), so both time exactly the same forwards."""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))

# Qwen2-0.5B's shape (its config.json): hidden 896, 24 layers, 14 heads, 2 KV heads,
# intermediate 4864, vocabulary 151936, tied embeddings. Random weights: no download.
QWEN05 = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
MODELS = ("smollm2", "qwen05")


def build(name: str) -> torch.nn.Module:
    """The model in fp32 eval mode on the CPU."""
    if name == "smollm2":
        from smollm2 import load

        return load("float32")[0]
    if name == "qwen05":
        import transformers as tf

        torch.manual_seed(0)
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**QWEN05)).to(torch.float32).eval()
    raise ValueError(f"unknown model {name!r}; one of {MODELS}")


def vocab(model: torch.nn.Module) -> int:
    return int(model.config.vocab_size)


def prompts(model: torch.nn.Module, tokens: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` prompts of ``tokens`` random token ids (batch 1), the same for every tool."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab(model), (1, tokens), generator=g) for _ in range(n)]


def truncate(model: torch.nn.Module, layers: int) -> list:
    """Keep the first ``layers`` decoder layers; returns what ``restore`` needs."""
    inner = model.model
    saved = [inner.layers, model.config.num_hidden_layers,
             getattr(model.config, "layer_types", None)]
    inner.layers = torch.nn.ModuleList(list(inner.layers)[:layers])
    model.config.num_hidden_layers = layers
    if saved[2] is not None:
        model.config.layer_types = list(saved[2])[:layers]
    return saved


def restore(model: torch.nn.Module, saved: list) -> None:
    model.model.layers, model.config.num_hidden_layers = saved[0], saved[1]
    if saved[2] is not None:
        model.config.layer_types = saved[2]


def write_rows(path: str, rows: list[dict]) -> None:
    """A CSV of dict rows, the columns of the first one (the benches' result tables)."""
    import csv

    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def du(path: str) -> tuple[int, int]:
    """(bytes, files) under a folder."""
    size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            size += os.path.getsize(os.path.join(root, name))
            files += 1
    return size, files
