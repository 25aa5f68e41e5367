"""kernelize and kernelized forwards keep no process-wide state: other threads compute exactly what they would alone.

Each test runs the racing work for many iterations with a short interpreter switch interval (so threads interleave
between most bytecodes, not every 5 ms) and compares every result with the same computation done with no other
thread running: dropout masks drawn from the global generator while another model is kernelized, and packed and
unpacked forwards of two kernelized models running at once.
"""

from __future__ import annotations

import sys
import threading
import time

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import tiny_causal_lm


pytest.importorskip("transformers")

# Each test stops within this many seconds even where nothing goes wrong (the loops are otherwise sized to take a
# few seconds on a 2-core machine).
_DEADLINE_S = 20.0


@pytest.fixture
def interleaved():
    """Switch threads every 10 µs for the test's duration (the default, 5 ms, hides most races)."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(previous)


def _run_together(*targets) -> None:
    """Start one thread per target and re-raise the first exception any of them raised."""
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _dropout_model() -> torch.nn.Module:
    # A user's model training with dropout; it draws its masks from the process-wide generator.
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 32),
                               torch.nn.Dropout(0.3)).train()


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_kernelize_leaves_another_threads_global_random_stream_alone(ref_pm, interleaved, device):
    # The kernelized model has attention dropout, so its decoder-layer probe runs dropout in training behaviour
    # (and must see the same masks for the layer and the template) while the other thread draws its own. On a GPU
    # both draw from the CUDA generator (the probe used to seed and restore it too).
    kernelized = tiny_causal_lm("llama", attention_dropout=0.5).to(device)
    training = _dropout_model().to(device)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).to(device)
    seeds = range(40)

    def step(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.no_grad():
            return training(x)

    expected = [step(seed) for seed in seeds]  # nothing else running
    rounds, done = 12, threading.Event()
    mismatches: list[int] = []
    verdicts: list[set[str | None]] = []
    steps = [0]

    def kernelize_repeatedly():
        try:
            for _ in range(rounds):
                kernels_core.kernelize(kernelized, mode=Mode.TRAINING, plugin_manager=ref_pm)
                entries = kernels_core.get_report(kernelized).entries
                verdicts.append({e.kernel for e in entries if e.kind == "residual_rms_norm"})
                kernels_core.unkernelize(kernelized)
        finally:
            done.set()

    def train():
        deadline = time.monotonic() + _DEADLINE_S
        while not done.is_set() and time.monotonic() < deadline:
            seed = seeds[steps[0] % len(seeds)]
            if not torch.equal(step(seed), expected[seed]):
                mismatches.append(seed)
            steps[0] += 1

    _run_together(kernelize_repeatedly, train)
    assert steps[0] >= rounds, "the training thread barely ran while kernelize did; nothing was tested"
    assert not mismatches, (f"{len(mismatches)} of {steps[0]} seeded dropout steps drew other masks while another "
                            f"thread ran kernelize (seeds {mismatches[:10]})")
    # The probe's own runs must not see the other thread's draws either: the layer and the template, probed with
    # the same masks, always agree.
    assert verdicts == [{"ref.residual_rms_norm"}] * rounds, verdicts


def test_packed_and_unpacked_forwards_of_two_kernelized_models_in_parallel_threads(pm, interleaved):
    # Each row holds two documents whose position ids restart at 0; with no attention mask and no cache
    # transformers builds a block-diagonal mask from them. The other model's caller passes no position ids (the
    # model derives 0..S-1 and its causal-mask kernel skips transformers' packing check): that fact must never
    # reach the packed call.
    ids = torch.randint(3, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    packed = torch.tensor([list(range(8)) * 2] * 2)
    calls = {"packed": {"position_ids": packed}, "unpacked": {}}
    models = {"qwen3": tiny_causal_lm("qwen3", attn_implementation="sdpa").eval(),
              "llama": tiny_causal_lm("llama", attn_implementation="sdpa").eval()}
    expected = {}
    with torch.no_grad():
        for family, model in models.items():
            for call, kwargs in calls.items():
                expected[family, call] = model(input_ids=ids, use_cache=False, **kwargs).logits
    assert not torch.allclose(expected["qwen3", "packed"], expected["qwen3", "unpacked"], atol=1e-3), \
        "packing must change the logits, or a lost block mask goes unseen"
    for model in models.values():
        kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
        entry = next(e for e in kernels_core.get_report(model).entries if e.kind == "causal_mask")
        assert entry.kernel == "any.causal_mask.sdpa_is_causal", entry

    iterations, wrong = 400, []
    deadline, late = time.monotonic() + _DEADLINE_S, threading.Event()
    # The barrier's action runs once per iteration, while both threads wait: both see the same ``late``.
    barrier = threading.Barrier(2, action=lambda: late.set() if time.monotonic() > deadline else None, timeout=60)

    def run(family: str, order: tuple[str, str]):
        # The two threads make opposite calls in every iteration (one packed, one unpacked), starting together.
        model = models[family]
        with torch.no_grad():
            for i in range(iterations):
                barrier.wait()
                if late.is_set():
                    return
                call = order[i % 2]
                logits = model(input_ids=ids, use_cache=False, **calls[call]).logits
                if not torch.allclose(logits, expected[family, call], rtol=1e-4, atol=1e-5):
                    wrong.append((family, call, i))

    _run_together(lambda: run("qwen3", ("packed", "unpacked")), lambda: run("llama", ("unpacked", "packed")))
    assert not wrong, (f"{len(wrong)} forwards differ from the same model's eager output while the other model ran "
                       f"in another thread: {wrong[:10]}")


def test_forwards_built_at_once_in_two_threads_get_their_own_synthetic_modules(pm, monkeypatch):
    # torch.compile finds a rerouted forward's globals through the module its ``__name__`` names in sys.modules:
    # two namespaces under one name would make one model's compiled forward guard on the other's globals. Both
    # threads are held inside the build (where the causal-mask adapter is called) until the other is there too.
    from kernels_core import _forward

    monkeypatch.setattr(_forward, "_REROUTED_NAMESPACES", {})
    barrier, waited = threading.Barrier(2, timeout=30), set()
    real_load_ref = _forward.load_ref

    def meeting(adapter):
        def adapt(*args, **kwargs):
            if threading.get_ident() not in waited:
                waited.add(threading.get_ident())
                barrier.wait()
            return adapter(*args, **kwargs)
        return adapt

    def load_ref(ref):
        loaded = real_load_ref(ref)
        return meeting(loaded) if ref.endswith(":adapt_causal_mask") else loaded

    monkeypatch.setattr(_forward, "load_ref", load_ref)
    models = [tiny_causal_lm(family, attn_implementation="sdpa").eval() for family in ("qwen3", "llama")]
    _run_together(*(lambda model=model: kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
                    for model in models))
    assert len(waited) == 2, "both builds must have met inside the build, or the race was not set up"
    namespaces = list(_forward._REROUTED_NAMESPACES.values())
    names = [namespace["__name__"] for namespace in namespaces]
    assert len(set(names)) == len(names), f"two rerouted namespaces share a module name: {sorted(names)}"
    assert all(sys.modules[name].__dict__ is namespace for name, namespace in zip(names, namespaces, strict=True))
