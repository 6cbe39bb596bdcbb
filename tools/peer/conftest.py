"""flash_attn's own tests/test_flash_attn.py on flashattn2 (install_as_flash_attn), sampled: PEER_PER_FUNC cases of
each test function (all of those with fewer), chosen by PEER_SEED."""

import collections
import os
import random

import flashattn2

flashattn2.install_as_flash_attn()


def pytest_collection_modifyitems(config, items):
    per = int(os.environ.get("PEER_PER_FUNC", "20"))
    rng = random.Random(int(os.environ.get("PEER_SEED", "0")))
    groups = collections.defaultdict(list)
    for item in items:
        groups[item.originalname].append(item)
    keep = set()
    for name, group in sorted(groups.items()):
        chosen = group if len(group) <= per else rng.sample(group, per)
        keep.update(id(i) for i in chosen)
        print(f"peer: {name}: {len(chosen)} of {len(group)}")
    deselected = [i for i in items if id(i) not in keep]
    items[:] = [i for i in items if id(i) in keep]
    config.hook.pytest_deselected(items=deselected)
