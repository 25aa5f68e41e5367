"""LLaMA-Factory v1 (``llamafactory`` 0.9.5): the ``kernels_core`` kernel plugin.

Importing this module registers ``KernelPlugin("kernels_core")``, so a LLaMA-Factory v1 configuration with

.. code-block:: yaml

    kernel_config:
      name: kernels_core
      mode: training                 # optional: training | inference, optionally +torch_compile
      strict: false                  # optional: raise if a matched layer gets no kernel
      config:                        # optional: a kernels-core configuration (or a TOML path)
        kinds: {rotary_embedding: {enabled: false}}

kernelizes the model LLaMA-Factory's ``ModelEngine`` loads. LLaMA-Factory 0.9.5 discovers no third-party
kernel plugins (it imports only its own ``ops/`` modules), so this import has to happen in every process that
loads the model. From the command line,

.. code-block:: bash

    python -m kernels_core.integrations.llamafactory sft config.yaml    # instead of USE_V1=1 llamafactory-cli sft
    torchrun --nproc-per-node 4 -m kernels_core.integrations.llamafactory sft config.yaml

does it; a Python script adds ``import kernels_core.integrations.llamafactory`` before it calls LLaMA-Factory.

Example:
    >>> import kernels_core.integrations.llamafactory as lf
    >>> from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin
    >>> KernelPlugin("kernels_core")["__call__"] is lf.kernelize_for_llamafactory
    True
"""

from __future__ import annotations

from ._llamafactory import OPTIONS
from ._llamafactory import PLUGIN_NAME
from ._llamafactory import kernelize_for_llamafactory
from ._llamafactory import register
from ._llamafactory import run_cli


__all__ = ["OPTIONS", "PLUGIN_NAME", "kernelize_for_llamafactory", "register", "run_cli"]

register()

if __name__ == "__main__":
    run_cli()
