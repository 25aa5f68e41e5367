"""Triton's runtime set-up on the background thread (``kernels_triton._warmup``).

Anywhere: the switch and a missing GPU keep the thread from starting; once started, the runtime steps run first,
each queued step runs once, and a failing step is logged and does not stop the ones after it (the thread's state
is reset around each test). On a GPU, in a fresh process: binding the kernels (resolving their
``kernels_triton.ops`` references, as kernelize does) runs the real steps, after which Triton's driver exists and its
cache key is computed. That importing a module starts nothing is checked in ``test_imports.py``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import requires_cuda
from kernels_triton import _warmup


@pytest.fixture
def fresh(monkeypatch):
    """``_warmup`` with no thread started, its steps recorded instead of run, and the GPU check answered yes.

    Importing the module named ``end`` records nothing and sets the returned event: a test queues it last and
    waits for it, so that it reads the record only once the thread has worked through the queue.
    """
    ran: list[str] = []
    done = threading.Event()

    def import_module(name: str) -> None:
        if name == "end":
            done.set()
        else:
            ran.append(f"import {name}")

    monkeypatch.setattr(_warmup, "_thread", None)
    monkeypatch.setattr(_warmup, "_queued", set())
    monkeypatch.setattr(_warmup, "_pending", _warmup.queue.SimpleQueue())
    monkeypatch.setattr(_warmup, "_RUNTIME", {"runtime a": lambda: ran.append("runtime a"),
                                              "runtime b": lambda: ran.append("runtime b")})
    monkeypatch.setattr(_warmup, "importlib", SimpleNamespace(import_module=import_module))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(_warmup.ENV_SWITCH, raising=False)
    return ran, done


def _drained(done: threading.Event) -> None:
    _warmup.start("end")
    assert done.wait(10), "the warm-up thread did not reach the end of its queue"


def test_no_thread_without_a_gpu(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _warmup.start("some.module") is False
    assert _warmup._thread is None


def test_switch_turns_the_thread_off(fresh, monkeypatch):
    monkeypatch.setenv(_warmup.ENV_SWITCH, "0")
    assert _warmup.start("some.module") is False
    assert _warmup._thread is None


def test_runtime_steps_first_then_each_module_once(fresh):
    ran, done = fresh
    assert _warmup.start("mod.one", "mod.two") is True
    assert _warmup.start("mod.two", "mod.three") is True   # mod.two is already queued
    _drained(done)
    assert ran == ["runtime a", "runtime b", "import mod.one", "import mod.two", "import mod.three"]
    assert _warmup._thread.daemon and _warmup._thread.name == "kernels-triton-warmup"


def test_a_failing_step_is_logged_and_the_rest_still_run(fresh, monkeypatch, caplog):
    ran, done = fresh

    def broken():
        raise OSError("no ldconfig here")

    monkeypatch.setitem(_warmup._RUNTIME, "runtime a", broken)
    with caplog.at_level(logging.DEBUG, logger=_warmup.__name__):
        _warmup.start("mod.one")
        _drained(done)
    assert ran == ["runtime b", "import mod.one"]
    assert "warm-up step 'runtime a' failed: OSError: no ldconfig here" in caplog.text


@requires_cuda
def test_binding_the_kernels_warms_tritons_runtime_on_a_gpu():
    # A fresh process: this one has long since set Triton's runtime up.
    script = textwrap.dedent("""
        import pkgutil, sys, time
        from kernels_triton import _warmup
        # What kernelize does when it binds these kernels.
        pkgutil.resolve_name("kernels_triton.ops:rms_norm")
        pkgutil.resolve_name("kernels_triton.ops:liger_fused_linear_cross_entropy")
        from triton.runtime import cache
        from triton.runtime.driver import driver
        # The runtime steps come first in the queue: once the thread has taken Liger's import, they are done.
        deadline = time.monotonic() + 60
        while not _warmup._pending.empty() or "liger_kernel.ops.fused_linear_cross_entropy" not in sys.modules:
            assert time.monotonic() < deadline, "the warm-up queue did not drain in 60 s"
            time.sleep(0.05)
        assert driver._active is not None, "Triton's driver was not created"
        assert cache.triton_key.cache_info().currsize == 1, "Triton's cache key was not computed"
        print("warm")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "warm" in proc.stdout, proc.stderr[-2000:]
