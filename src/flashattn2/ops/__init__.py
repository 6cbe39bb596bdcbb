"""The host path of a call, one subpackage per step, each importing only the steps before it: request (the
arguments as one request, their checks, options, modes and spec) -> planning (which kernel, tile and load path: the
plan table) -> launch (the kernels' launches) -> run (the prepared call, the torch.library ops and autograd
Functions). _runtime.py, what every step needs of Triton's runtime (the kernels, the interpreter, the environment's
switches), lies beneath them all."""
