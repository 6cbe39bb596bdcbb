"""Launchers, validation, configuration and torch.library registration of the kernels."""
