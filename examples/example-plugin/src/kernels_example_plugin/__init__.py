"""kernels-example-plugin: a third-party layer kind and kernel for kernels-core."""

__all__: list[str] = []
