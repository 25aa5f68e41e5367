"""The plugins of one process: loading them (:mod:`._loading`), what they declare (:mod:`._declarations`), what
went wrong with them (:mod:`._diagnostics`), and the manager that holds the three (:mod:`._manager`).

The hook specifications a plugin implements are in :mod:`._hookspec`; each declaration hook's implementations are
called in isolation from one another (:mod:`._isolation`), and the declarations of all plugins are checked against
one another (:mod:`._cross_check`). Plugins import none of this: their surface is :mod:`kernels_core.plugin`.
"""
