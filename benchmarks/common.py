"""What the benchmarks share: the environment record, results files, child processes, timing, model builders,
kernelized RMSNorm stacks and kernel-choice switches.

Every benchmark is a module of the ``benchmarks`` package, run from the repository root with ``python -m``
(``python -m benchmarks.cuda.models_bench --help``). A benchmark that starts itself again in a child process
(one process per variant) builds the command with :func:`python_m` and starts it through :func:`run_child` or with
:func:`child_env`'s environment, which names the repository root on ``PYTHONPATH``, so the child finds the package
from any working directory.

Example:
    >>> python_m("benchmarks.cuda.models_bench", "--help")[1:]
    ['-m', 'benchmarks.cuda.models_bench', '--help']
    >>> parse_shapes("8192x1024,131072x128")
    [(8192, 1024), (131072, 128)]
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING
from typing import Any

import torch


if TYPE_CHECKING:
    import kernels_core


REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _commit() -> str | None:
    """The commit measured: KERNELS_BENCH_COMMIT where the tree travelled without .git, else git's HEAD."""
    if os.environ.get("KERNELS_BENCH_COMMIT"):
        return os.environ["KERNELS_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=pathlib.Path(__file__).parent, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    props = torch.cuda.get_device_properties(0)
    return {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "liger_kernel": version("liger-kernel"),
    }


@contextlib.contextmanager
def modeling_globals_kept(prefix: str = "transformers.models.") -> Iterator[None]:
    """Undo, on exit, what the block rebound in the loaded modules whose names start with ``prefix``.

    Liger-Kernel's per-instance patch (``_apply_liger_kernel_to_instance``, what the Trainer's ``use_liger_kernel``
    calls) also rebinds names of the family's modeling module, process-wide: ``apply_rotary_pos_emb``, the RMSNorm
    and MLP classes. A benchmark that runs several variants in one process (``distributed_bench``) would otherwise
    build every later model of that family from Liger's classes, and kernelize would find Liger's functions in it.

    Example:
        >>> import sys, types
        >>> sys.modules["transformers.models.demo"] = demo = types.ModuleType("transformers.models.demo")
        >>> demo.rotate = "eager"
        >>> with modeling_globals_kept():
        ...     demo.rotate, demo.added = "patched", "new"
        >>> demo.rotate, hasattr(demo, "added")
        ('eager', False)
        >>> del sys.modules["transformers.models.demo"]
    """
    saved = [(vars(module), dict(vars(module))) for name, module in list(sys.modules.items())
             if name.startswith(prefix) and module is not None]
    try:
        yield
    finally:
        for namespace, before in saved:
            for key in [key for key in namespace if key not in before]:
                del namespace[key]
            for key, value in before.items():
                if namespace.get(key) is not value:
                    namespace[key] = value


def write_json(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def train_steps(runner, parameters, batch: torch.Tensor | Mapping[str, torch.Tensor], *, steps: int,
                warmup: int, from_host: torch.device | None = None) -> tuple[dict, object]:
    """Time AdamW (fused, lr 1e-5) training steps of ``runner(input_ids=batch, labels=batch).loss`` (or
    ``runner(**batch).loss`` for a batch of named tensors: packed rows with their position ids, say).

    The first step is timed alone (compilation and autotuning included), ``warmup - 1`` more steps follow, then
    ``steps`` timed ones with the GPU synchronised at both ends and the peak memory reset before them. Returns
    the measurements and the step function (for a profile of one more step):
    ``first_step_s``, ``seconds`` (the timed steps), ``peak_bytes``, ``host_queue_s`` (when the host finished
    queueing each timed step: a one-off stall shows there) and ``losses`` (warm-up steps, then the last step).
    On a CPU ``batch`` (a smoke test) ``peak_bytes`` is None.

    With ``from_host`` (a device), ``batch`` stays in pinned host memory and every step copies it to that device
    first, blocking, as the Trainer's data loader does (accelerate's ``send_to_device``, ``non_blocking=False``):
    the host then waits for the GPU once a step, as in a real training loop, instead of queueing steps ahead.
    """
    opt = torch.optim.AdamW(parameters, lr=1e-5, fused=True)
    inputs = {"input_ids": batch, "labels": batch} if isinstance(batch, torch.Tensor) else batch
    if from_host is not None:
        inputs = {name: tensor.cpu().pin_memory() for name, tensor in inputs.items()}
    cuda = (from_host or inputs["input_ids"].device).type == "cuda"

    def step() -> torch.Tensor:
        on_device = inputs if from_host is None else {name: t.to(from_host) for name, t in inputs.items()}
        loss = runner(**on_device).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    losses = [step().item()]
    first = time.perf_counter() - start
    losses += [step().item() for _ in range(warmup - 1)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    ends = []
    for _ in range(steps):
        loss = step()
        ends.append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    losses.append(loss.item())
    return {
        "first_step_s": first,
        "seconds": seconds,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "host_queue_s": [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)],
        "losses": losses,
    }, step


def alternating_rounds(names: tuple[str, str], *, rounds: int,
                       block: Callable[[str], float]) -> dict[str, list[float]]:
    """``block(name)`` for both ``names`` each round, the order flipped every round so that a machine's drift hits
    both alike; what each call returned (a block's tokens/s), per name, in round order.

    Example:
        >>> calls = []
        >>> alternating_rounds(("a", "b"), rounds=2, block=lambda name: calls.append(name) or len(calls))
        {'a': [1, 4], 'b': [2, 3]}
    """
    values: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            values[name].append(block(name))
    return values


# The distributed GPU tests' helpers, loaded from their file: the workers folder is no package, and its scripts
# import the file as ``_shared`` from their own folder.
_WORKERS_SHARED = REPO / "plugins-cuda" / "tests" / "distributed_workers" / "_shared.py"


@functools.cache
def distributed_workers() -> ModuleType:
    """The distributed GPU tests' helpers (``plugins-cuda/tests/distributed_workers/_shared.py``: process group with
    NVLink multicast off, FSDP2/DDP wrapping), which the multi-GPU benchmarks use too; loaded once per process."""
    spec = importlib.util.spec_from_file_location("benchmarks._distributed_workers_shared", _WORKERS_SHARED)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses and pickling look a class's module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def set_loss_chunk_rows(modifier: str) -> None:
    """Apply a ``chunk<N>`` variant modifier: the fused loss's token chunks at about N rows (a tuning override,
    kernels-triton's ``KERNELS_TRITON_LOSS_CHUNK_ROWS``, read when kernelize first loads the loss)."""
    os.environ["KERNELS_TRITON_LOSS_CHUNK_ROWS"] = modifier.removeprefix("chunk")


def profile_step(step) -> list[dict]:
    """GPU time per kernel name over one call of ``step``, largest first (the 40 largest, after a total row):
    where a variant's step time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [
        {"kernel": event.key[:120], "calls": event.count, "gpu_ms": round(event.device_time_total / 1e3, 3)}
        for event in prof.key_averages()
        if event.device_time_total > 0
    ]
    rows.sort(key=lambda row: -row["gpu_ms"])
    total = sum(row["gpu_ms"] for row in rows)
    return [{"kernel": "<all kernels>", "calls": sum(r["calls"] for r in rows), "gpu_ms": round(total, 3)}] + rows[:40]


# A profiled step's kernels by what they do, first match wins, matched against the names torch.profiler reports on
# NVIDIA GPUs (``profile_step`` keeps 120 characters of each, so C++ template names arrive cut).
PROFILE_CATEGORIES = (
    ("nccl", ("nccl",)),
    ("attention", ("sdpa", "flash", "fmha", "cudnn::fusion", "attention")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
    ("adamw", ("FusedOpti", "adam", "Adam")),
    # FSDP2's all-gather copy-in (_foreach_copy_), copy-out and reduce-scatter input; other foreach operations
    # (a foreach optimizer) land here too.
    ("fsdp2_copies", ("split_with_sizes_copy", "chunk_cat", "multi_tensor_apply")),
    ("inductor", ("triton_",)),
    ("copies", ("Memcpy", "Memset", "copy_kernel", "CatArrayBatchedCopy")),
)


def profile_by_category(kernels: list[dict]) -> dict[str, float]:
    """GPU ms per category (:data:`PROFILE_CATEGORIES`) of a :func:`profile_step` list; ``kernels`` is any other
    Triton kernel (kernelize's, Liger's: a bare name ending in ``_kernel``), ``other`` the rest (eager's
    elementwise kernels among them). NCCL runs beside the rest, so the categories add up to more than the step.

    Example:
        >>> profile_by_category([{"kernel": "<all kernels>", "calls": 3, "gpu_ms": 6.0},
        ...                      {"kernel": "nvjet_sm90_tst_256x128", "calls": 1, "gpu_ms": 4.0},
        ...                      {"kernel": "_rms_norm_fwd_kernel", "calls": 1, "gpu_ms": 1.5},
        ...                      {"kernel": "ncclDevKernel_AllGather_RING_LL", "calls": 1, "gpu_ms": 0.5}])
        {'gemm': 4.0, 'kernels': 1.5, 'nccl': 0.5}
    """
    totals: dict[str, float] = {}
    for row in kernels:
        name = row["kernel"]
        if name == "<all kernels>":
            continue
        category = next((c for c, patterns in PROFILE_CATEGORIES if any(p in name for p in patterns)), None)
        if category is None:
            category = "kernels" if re.fullmatch(r"\w+_kernel", name) or name.startswith("liger") else "other"
        totals[category] = round(totals.get(category, 0.0) + row["gpu_ms"], 3)
    return totals


def host_profile_step(step, device: torch.device, *, top: int = 30) -> dict:
    """Where one call of ``step`` spends host time: how long the host is busy issuing it (``host_ms``, the call
    returning before the GPU finishes) against the whole step (``wall_ms``, after synchronising), and the Python
    functions with the most own time (``tottime``) and the most time including callees (``cumtime``) under
    cProfile. cProfile slows Python code down, so read the shares, not the absolute times; a step whose host
    time is close to its wall time keeps the GPU waiting."""
    import cProfile
    import pstats

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    start = time.perf_counter()
    step()
    host = time.perf_counter() - start
    sync()
    wall = time.perf_counter() - start
    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    step()
    profiler.disable()
    sync()
    stats = pstats.Stats(profiler)

    def rows(key: int) -> list[dict]:
        entries = sorted(stats.stats.items(), key=lambda item: -item[1][key])[:top]
        return [{"function": f"{pathlib.Path(file).name}:{line}:{name}", "calls": calls,
                 "tottime_ms": round(1e3 * tottime, 2), "cumtime_ms": round(1e3 * cumtime, 2)}
                for (file, line, name), (_, calls, tottime, cumtime, _) in entries]

    return {"host_ms": round(1e3 * host, 2), "wall_ms": round(1e3 * wall, 2),
            "profiled_total_ms": round(1e3 * stats.total_tt, 2), "by_tottime": rows(2), "by_cumtime": rows(3)}


# CUDA runtime calls that can make the host wait for the GPU (or for the driver): where a host-bound step loses time
# that its own Python does not show.
_BLOCKING_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                     "cudaMemcpyAsync", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaStreamWaitEvent")


def trace_step(step, path: pathlib.Path, *, top: int = 25) -> dict:
    """One call of ``step`` under torch.profiler with host (every thread: autograd's engine runs the backward on
    its own) and GPU activity. The Chrome trace goes to ``path`` (gzip), and the summary returned says where the
    host's time went: the runtime calls that can block (count, total ms), the host ops with the most own time, each
    thread's busy time, and the GPU's idle time with its longest gaps and the host op running when each began.

    On a machine without CUDA, the host part alone (no runtime calls, no GPU). Profiling adds a few microseconds
    a host op: compare layouts traced alike, not with untraced timings.
    """
    import gzip

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        start = time.perf_counter()
        step()
        host = time.perf_counter() - start
        sync()
        wall = time.perf_counter() - start
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    text = raw.read_bytes()
    raw.unlink()
    path.write_bytes(gzip.compress(text))
    averages = prof.key_averages()
    blocking = sorted(({"call": e.key, "count": e.count, "ms": round(e.cpu_time_total / 1e3, 3)}
                       for e in averages if e.key in _BLOCKING_RUNTIME), key=lambda row: -row["ms"])
    own = sorted(({"op": e.key[:100], "count": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 3)}
                  for e in averages if e.self_cpu_time_total > 0), key=lambda row: -row["self_ms"])[:top]
    events = json.loads(text)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    host_ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e.get("tid")) for e in spans
                      if e.get("cat") == "cpu_op")
    threads: dict[str, float] = {}
    for first, last, _, tid in host_ops:
        threads[str(tid)] = threads.get(str(tid), 0.0) + (last - first)  # nested ops count twice: a rough busy
    # The GPU's busy intervals merged, so that overlapping streams count once; a gap is where none runs.
    gaps, busy, reach = [], 0.0, None
    for begin, end in kernels:
        if reach is not None and begin > reach:
            gaps.append((begin - reach, reach))
        start = begin if reach is None else max(begin, reach)
        busy += max(0.0, end - start)
        reach = end if reach is None else max(reach, end)
    gaps.sort(reverse=True)

    def running_at(moment: float) -> str:
        # The innermost host op (latest start) covering the moment the GPU went idle.
        covering = [op for op in host_ops if op[0] <= moment <= op[1]]
        return max(covering)[2][:100] if covering else "(no host op)"

    return {
        "host_ms": round(1e3 * host, 2), "wall_ms": round(1e3 * wall, 2),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gpu_idle_ms": round(sum(g for g, _ in gaps) / 1e3, 3),
        "gpu_longest_gaps": [{"ms": round(g / 1e3, 3), "host_op": running_at(at)} for g, at in gaps[:top]],
        "blocking_runtime_calls": blocking,
        "host_ops_by_own_time": own,
        "host_ops_ms_by_thread": {tid: round(v / 1e3, 2) for tid, v in threads.items()},
        "trace": path.name,
    }


def python_m(module: str, *args: str, torchrun: Sequence[str] | None = None) -> list[str]:
    """The command that runs ``module`` (``benchmarks.cuda.models_bench``) as ``python -m`` with ``args``, or under
    ``torch.distributed.run`` with the launcher options ``torchrun`` (``["--standalone", "--nproc_per_node", "2"]``).
    Start it with :func:`run_child` or :func:`child_env`'s environment, which finds the package from any folder."""
    launcher = [sys.executable] if torchrun is None else [sys.executable, "-m", "torch.distributed.run", *torchrun]
    return [*launcher, "-m", module, *args]


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on ``PYTHONPATH``: a child
    started with ``python -m benchmarks...`` then imports this package whatever its working directory."""
    out = dict(os.environ if env is None else env)
    paths = [path for path in out.get("PYTHONPATH", "").split(os.pathsep) if path]
    if str(REPO) not in paths:
        out["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
    return out


def child_result(cmd: list[str], variant: str) -> dict:
    """Run ``cmd`` (a benchmark's child, :func:`python_m`) and read the JSON of the last line it prints starting
    with ``RESULT ``; if it fails or prints none, ``{"variant": variant, "error": <the end of its stderr>}``, which
    is printed too.

    Example:
        >>> import sys
        >>> child_result([sys.executable, "-c", "print('RESULT {\\"x\\": 1}')"], "demo")
        {'x': 1}
    """
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"{variant}: failed\n{proc.stderr[-3000:]}", flush=True)
        return {"variant": variant, "error": proc.stderr[-3000:]}
    return json.loads(lines[-1].removeprefix("RESULT "))


def run_child(cmd: list[str], out: pathlib.Path, *, timeout: float,
              env: Mapping[str, str] | None = None) -> tuple[Any, str | None]:
    """Run one benchmark variant in its own process (``cmd``, from :func:`python_m`), which writes its JSON result
    to ``out``; ``env`` adds environment variables to the child's (:func:`child_env`).

    Returns the result (``None`` if the process wrote none) and what went wrong (``None`` if nothing): the exit
    status with the end of its stderr, or the time limit with the end of its output.
    """
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=child_env({**os.environ, **(env or {})}))
        error = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-800:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        error = f"timed out after {timeout}s; last output: {tail}"
    result = json.loads(out.read_text()) if out.exists() else None
    out.unlink(missing_ok=True)
    return result, error


def parse_side(text: str) -> tuple[str, dict[str, str]]:
    """``NAME[:VAR=VALUE,...]`` -> (name, environment changes).

    Example:
        >>> parse_side("off:KERNELS_X=0,Y=1")
        ('off', {'KERNELS_X': '0', 'Y': '1'})
    """
    name, _, assignments = text.partition(":")
    env = {}
    for item in filter(None, assignments.split(",")):
        var, sep, value = item.partition("=")
        if not sep or not var:
            raise SystemExit(f"side {text!r}: expected NAME or NAME:VAR=VALUE[,VAR=VALUE...], got {item!r}")
        env[var] = value
    return name, env


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend), or None where matplotlib is not installed:
    the charts beside a results file are optional."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"8192x1024,131072x128"`` -> ``[(8192, 1024), (131072, 128)]`` (a ``--shapes`` option)."""
    return [tuple(int(size) for size in shape.split("x")) for shape in text.split(",")]


# The Qwen3-0.6B shape (published config.json, sizes only) that the Qwen3 training, decoding and distributed
# benchmarks build; max_position_embeddings bounds nothing a benchmark runs.
QWEN3_0_6B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
# transformers' config and model classes per model family (``model_type``) the benchmarks build.
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def causal_lm(family: str, *, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
              seed: int = 0, experts: str | None = None, **config: Any) -> torch.nn.Module:
    """A randomly initialised transformers causal LM of ``family`` (a key of :data:`FAMILIES`) with the sizes in
    ``config`` and sdpa attention, its weights drawn after ``torch.manual_seed(seed)``, built on ``device`` in
    ``dtype``; ``experts`` sets a MoE model's ``experts_implementation``."""
    import transformers

    config_name, model_name = FAMILIES[family]
    built = getattr(transformers, config_name)(**config, attn_implementation="sdpa")
    if experts is not None:
        built._experts_implementation = experts
    torch.manual_seed(seed)
    with torch.device(device):
        return getattr(transformers, model_name)(built).to(dtype)


# PEFT LoRA targets per ``--peft`` case of the training benchmarks: every linear layer of the decoder ("all-linear"
# leaves lm_head out), the same plus lm_head, and QLoRA (the base layers 4-bit nf4, stored as bfloat16 so FSDP2
# shards them like the LoRA weights).
PEFT_TARGETS: dict[str, str | list[str]] = {
    "lora": "all-linear",
    "lora_lm_head": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    "qlora": "all-linear",
}


def quantized_copy(model: torch.nn.Module, output_dir: str) -> torch.nn.Module:
    """``model`` saved under ``output_dir`` and loaded again with bitsandbytes 4-bit nf4 base layers (QLoRA
    quantizes while loading; bf16 compute and quant storage) on this process's GPU."""
    if not torch.cuda.is_available():
        # bitsandbytes' 4-bit layers load onto a GPU; a CPU run gets the reason, not a loader traceback.
        raise RuntimeError("QLoRA needs CUDA: bitsandbytes loads the 4-bit base layers onto a GPU")
    from transformers import AutoModelForCausalLM
    from transformers import BitsAndBytesConfig

    path = f"{output_dir}/base"
    model.save_pretrained(path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_quant_storage=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=quant,
                                                device_map={"": torch.cuda.current_device()})


def with_lora(model: torch.nn.Module, case: str, output_dir: str) -> torch.nn.Module:
    """``model`` with PEFT LoRA adapters (r 16, alpha 32, dropout 0.05) on :data:`PEFT_TARGETS` ``[case]``; for
    ``"qlora"`` on a 4-bit copy of it (:func:`quantized_copy`, saved under ``output_dir``). The adapters' initial
    weights are seeded, so every variant of a benchmark trains the same ones."""
    import peft

    if case == "qlora":
        model = quantized_copy(model, output_dir)
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=PEFT_TARGETS[case])
    torch.manual_seed(7)
    return peft.get_peft_model(model, config)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing (non-reentrant) on a transformers model's decoder layers: their forward runs again
    in the backward instead of keeping its activations."""
    # transformers 5.x renamed gradient_checkpointing_enable (the old name warns); earlier ones have only it.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def fp8_linear_config(recipe: str, *, lm_head: bool = False) -> dict[str, Any]:
    """The kernelize ``config`` that asks for kernels-cuda's FP8 linear kernel (``recipe``: ``"rowwise"`` or
    ``"tensorwise"``) on every decoder-layer linear, and on ``lm_head`` too with ``lm_head`` (the fused loss then
    declines and the loss runs unfused): an explicit request, so kernelize raises where it cannot be honoured (no
    Hopper GPU, no torchao).

    Example:
        >>> fp8_linear_config("rowwise")
        {'kinds': {'linear': {'prefer': {'any': ['cuda.linear.float8_rowwise']}}}}
        >>> fp8_linear_config("tensorwise", lm_head=True)["kinds"]["linear"]["options"]
        {'lm_head': True}
    """
    linear: dict[str, Any] = {"prefer": {"any": [f"cuda.linear.float8_{recipe}"]}}
    if lm_head:
        linear["options"] = {"lm_head": True}
    return {"kinds": {"linear": linear}}


def require_cuda_kernels(report: Any) -> None:
    """Refuse to time a silent no-op: without installed entry points only the core's plugins load, and kernelize
    binds no CUDA kernel (``report``: ``kernels_core.get_report(model)``)."""
    if not any((entry.kernel or entry.left_to_compiler or "").startswith("cuda.") for entry in report.entries):
        raise RuntimeError(f"kernelize applied no CUDA kernel; is kernels-cuda installed?\n{report.table()}")


def bench(fn, *, rep: int = 200) -> float:
    """Median microseconds of ``fn`` under ``triton.testing.do_bench`` (L2 flushed between calls, host included)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


_FLUSH: torch.Tensor | None = None


def gpu_us(fn, *, calls=10, replays=15):
    """GPU time of ``fn`` alone: CUDA graphs of [L2 flush, fn] x calls and [L2 flush] x calls, replayed and
    subtracted, so that neither host-side launch work nor an L2-resident input shows in the result."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for with_fn in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                _FLUSH.zero_()
                if with_fn:
                    fn()
        graphs.append(graph)
    medians = []
    for graph in graphs:
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        medians.append(sorted(times)[len(times) // 2])
    return (medians[0] - medians[1]) / calls * 1e3


def triton_norms(fn):
    """``fn`` run with kernels-cuda's with-autograd size threshold at zero: the tuned RMSNorm (and residual add +
    RMSNorm) take the Triton kernel at every size."""
    from kernels_cuda import ops

    def run(*args):
        # Set and restored around each call (cheaply: the wrapper sits inside timed loops), so other rows in the
        # same process keep the measured thresholds.
        saved = ops.set_rms_norm_thresholds(min_elements_with_grad=0)
        try:
            return fn(*args)
        finally:
            ops.set_rms_norm_thresholds(min_elements_with_grad=saved.min_elements_with_grad)

    return run


def python_autograd_norms(fn):
    """``fn`` run with kernels-triton's C++ autograd extension switched off for the norms: their Python
    ``autograd.Function`` path, to time side by side with the C++ nodes in one run."""
    from kernels_triton import ops

    python_autograd = ops.python_autograd_norms()

    def run(*args):
        with python_autograd:
            return fn(*args)

    return run


def per_call_us(fn, *, calls: int = 2000, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean wall time of ``calls`` back-to-back calls, synchronised at both ends."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    results = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        results.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(results)[len(results) // 2]


def kernelized_norms(hidden: int, dtype: torch.dtype, *, mode: kernels_core.Mode, count: int) -> torch.nn.Sequential:
    """``count`` transformers RMSNorm modules with random weights, kernelized by kernels-core for ``mode``."""
    import kernels_core
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norms = torch.nn.Sequential(*(Qwen3RMSNorm(hidden, eps=1e-6) for _ in range(count))).to("cuda", dtype)
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_(1.0, 0.1)
    kernels_core.kernelize(norms, mode=mode)
    applied = kernels_core.get_report(norms).applied
    if len(applied) != count:
        raise RuntimeError(f"kernelize applied {len(applied)} of {count} RMSNorm kernels: "
                           f"{kernels_core.get_report(norms).summary()}")
    return norms


def settle_cpp_extension() -> str:
    """Wait until kernels-triton's C++ autograd nodes are built (or known unavailable) and return their status, so
    that no timed variant runs the slower Python nodes merely because it ran first on a new machine."""
    from kernels_triton import ops

    ops.cpp_autograd_extension(wait=True)
    return ops.cpp_autograd_status()
