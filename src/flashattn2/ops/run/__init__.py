"""A call's last step: the prepared call of its spec (call.py: checked and planned once per spec), its launches
(attention.py), and the torch.library ops and autograd Functions the API calls (registry.py). Imports the earlier
steps; none of them imports this one."""
