"""The plugins of one process. Plugins import none of this: their surface is :mod:`kernels_core.plugin`.

- :mod:`._hookspec`: the hooks a plugin implements and the plugin API version;
- :mod:`._loading`: which plugins load (entry points, the environment's allow and block lists, reserved names, API
  versions) and collecting what they declare, each hook implementation isolated (:mod:`._isolation`) and the
  declarations checked across plugins (:mod:`._cross_check`);
- :mod:`._declarations`: what the loaded plugins declare, as kernelize and the listings query it;
- :mod:`._diagnostics`: what went wrong with them, said so that their users can act, and what fell back in this
  process (:mod:`._fallbacks`);
- :mod:`._records`: what the core records about a plugin (:class:`~._records.PluginInfo`, the one
  :class:`~._records.Fault`);
- :mod:`._manager`: :class:`~kernels_core.KernelsPluginManager`, which holds a loader and answers from its
  declarations.
"""
