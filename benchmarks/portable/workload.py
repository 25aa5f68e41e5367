"""One training workload, measured in a process of its own: the shared half of ``benchmarks.portable.memory``.

Peak memory is read, never estimated. On CPU the kernel's resident-set high-water mark (``VmHWM``) is reset
just before the first training step (``/proc/self/clear_refs``), so the peak covers the training steps
only; where that is unavailable (macOS) ``ru_maxrss`` covers the whole process. On CUDA it is
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


__all__ = ["SHAPES", "Shape", "build_model", "make_batch", "peak_tracker", "train"]


@dataclass(frozen=True)
class Shape:
    """A Qwen3 model shape and the batch it trains on."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    batch: int
    seq_len: int
    dtype: str
    vocab_size: int = 151_936  # the real Qwen3 tokenizer's
    tie_word_embeddings: bool = True
    lr: float = 1e-3


SHAPES = {
    # Small enough for a few steps on a 2-core laptop CPU; the vocabulary (and so the loss) is full size.
    "demo": Shape(128, 384, 2, 4, 2, 32, batch=4, seq_len=256, dtype="float32"),
    # Qwen3-0.6B (tied embeddings), as in the CUDA issue.
    "qwen3-0.6b": Shape(1024, 3072, 28, 16, 8, 128, batch=4, seq_len=2048, dtype="bfloat16", lr=1e-5),
}


def build_model(shape: Shape, *, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ``Qwen3ForCausalLM`` of ``shape``, in training mode, on ``device``."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=max(shape.seq_len, 512),
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=getattr(torch, shape.dtype))
    return model.train()


def make_batch(shape: Shape, *, device: torch.device, step: int) -> dict[str, torch.Tensor]:
    """Random tokens; the first eighth of each row is a prompt whose labels are ignored, as in fine-tuning."""
    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len), generator=generator)
    labels = input_ids.clone()
    labels[:, : shape.seq_len // 8] = -100
    return {"input_ids": input_ids.to(device), "labels": labels.to(device)}


class peak_tracker:  # noqa: N801 - used like a function
    """Peak memory of the enclosed block, in bytes (see the module docstring for how it is read)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self.method = ""

    def __enter__(self) -> peak_tracker:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "torch.cuda.max_memory_allocated"
        elif _reset_hwm():
            self.method = "VmHWM (reset before step 1)"
        else:
            self.method = "ru_maxrss (whole process)"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method.startswith("VmHWM"):
            self.peak = _status_bytes("VmHWM")
        else:
            scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def resident_bytes() -> int:
    """Current resident set of this process (0 where unknown)."""
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") > 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    model: torch.nn.Module,
    shape: Shape,
    *,
    device: torch.device,
    steps: int,
    on_first_backward: Callable[[torch.nn.Module], None] | None = None,
) -> dict[str, object]:
    """Train ``steps`` AdamW steps; return losses, step times and the training peak memory."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr)
    batches = [make_batch(shape, device=device, step=i) for i in range(steps)]
    losses, times = [], []
    baseline = resident_bytes() if device.type != "cuda" else torch.cuda.memory_allocated(device)
    with peak_tracker(device) as tracker:
        for step, batch in enumerate(batches):
            _sync(device)
            start = time.perf_counter()
            loss = model(**batch).loss
            loss.backward()
            if step == 0 and on_first_backward is not None:
                on_first_backward(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    return {
        "losses": losses,
        "step_seconds": times,
        "peak_bytes": tracker.peak,
        "baseline_bytes": baseline,
        "peak_method": tracker.method,
        "pid": os.getpid(),
    }
