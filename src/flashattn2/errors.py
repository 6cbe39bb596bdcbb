"""The exceptions flashattn2 raises for bad arguments, catchable the Python way and flash_attn's way.

flash_attn checks its arguments in C++ (TORCH_CHECK), so a bad shape, dtype or value reaches its
caller as a RuntimeError, and code written for flash_attn catches RuntimeError. Python code
catches ValueError and TypeError. flashattn2's argument errors are both:

- ArgumentError (a ValueError and a RuntimeError): a bad shape, value, device or combination;
- ArgumentTypeError (a TypeError and a RuntimeError): an argument of the wrong type or dtype;
- NotImplementedError (Python's, itself a RuntimeError): a valid call that flashattn2 does not
  support (a head dim above 256, an option with no kernel, an unsupported GPU).

Each message names the argument. Errors that are not about a call's arguments (a kernel that
fails to compile, CUDA running out of memory) are whatever torch and Triton raise.
"""


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value, shape, device or combination (a ValueError, and a RuntimeError as flash_attn's are)."""


class ArgumentTypeError(TypeError, RuntimeError):
    """An argument of the wrong type or dtype (a TypeError, and a RuntimeError as flash_attn's are)."""
