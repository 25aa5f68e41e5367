"""The cost of kernels-core itself (discovery, kernelize), on any machine."""
