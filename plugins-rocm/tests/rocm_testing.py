"""Simulated devices shared by the tests: names and ``gcnArchName`` strings as ROCm reports them."""

from __future__ import annotations


__all__ = ["H100", "MI50", "MI250X", "MI300X", "MI355X", "RX7900"]

# (name, gcnArchName as ROCm reports it), or (name, compute capability) for the NVIDIA one.
MI300X = ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-")
MI250X = ("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-")
MI355X = ("AMD Instinct MI355X", "gfx950:sramecc+:xnack-")
RX7900 = ("Radeon RX 7900 XTX", "gfx1100")
MI50 = ("AMD Instinct MI50", "gfx906:sramecc+:xnack-")
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
