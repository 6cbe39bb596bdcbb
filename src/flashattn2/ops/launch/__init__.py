"""A call's third step: its plan launched on its tensors. The kept launches (launcher.py), the rows as the kernels
take them (layout.py), TMA descriptors (tma.py), the Triton and Gluon kernels' launches (launch_triton.py,
launch_gluon.py), the KV-cache kernels' (kvcache.py), rotary and the split merge (rotary.py, merge.py). Imports the
earlier steps (request, planning), never the last (run)."""
