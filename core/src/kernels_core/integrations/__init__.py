"""One-line switches for the tools people train with.

Each integration lives in its own module and imports its framework only when used, so importing this package
costs nothing:

- ``kernels_core.integrations.transformers``: ``KernelizeCallback`` for transformers' ``Trainer`` and TRL's
  trainers, which are ``Trainer`` subclasses.
- ``kernels_core.integrations.llamafactory``: the LLaMA-Factory v1 kernel plugin.

Example:
    >>> import kernels_core.integrations
    >>> import sys
    >>> "transformers.trainer" in sys.modules and "trl" in sys.modules
    False
"""

__all__: list[str] = []
