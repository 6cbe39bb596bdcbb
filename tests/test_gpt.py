"""flashattn2.models.gpt: KV-cache generation equals recomputing the whole sequence, a few
training steps lower the loss, and a training step and a decode step compile with
torch.compile(fullgraph=True) to the eager results."""

import pytest
import torch

from conftest import DEVICE, ON_GPU
from flashattn2.models.gpt import GPT, GPTConfig

SMALL = dict(vocab_size=61, block_size=64, n_layer=2, n_head=4, n_embd=64)
if ON_GPU:
    SMALL.update(block_size=512, n_embd=256)


def model_of(**kwargs):
    torch.manual_seed(7)
    return GPT(GPTConfig(**{**SMALL, **kwargs})).to(DEVICE)


def greedy_by_recompute(model, idx, steps):
    for _ in range(steps):
        logits, _ = model(idx)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(), id="mha"),
        pytest.param(dict(n_kv_head=2, rotary_dim=16), id="gqa-rotary"),
        pytest.param(dict(attention="naive"), id="naive"),
    ],
)
def test_generate_with_kv_cache_equals_recompute(kwargs):
    model = model_of(**kwargs).eval()
    prompt = torch.randint(0, SMALL["vocab_size"], (2, 9), device=DEVICE)
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=7, temperature=0)
        recomputed = greedy_by_recompute(model, prompt, 7)
    assert torch.equal(cached, recomputed), (cached, recomputed)


def test_training_lowers_the_loss():
    model = model_of()
    data = torch.arange(40, device=DEVICE).remainder(SMALL["vocab_size"]).repeat(4, 1)  # a pattern to learn
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        _, loss = model(data[:, :-1], targets=data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_compile_fullgraph_train_and_decode_steps():
    """fullgraph (inductor on the GPU; aot_eager on the CPU, where inductor's C++ build of the model costs minutes
    and tests/test_torch_integration.py compiles the attention op with inductor): the training step's loss and
    gradients and a decode step's logits equal eager (the attention and the KV-cache kernels are torch.library
    ops), and decoding does not compile a graph per token."""
    torch._dynamo.reset()
    model = model_of(n_kv_head=2)
    x = torch.randint(0, SMALL["vocab_size"], (2, 17), device=DEVICE)

    def train_step(idx):
        _, loss = model(idx[:, :-1], targets=idx[:, 1:])
        return loss

    eager_loss = train_step(x)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    backend = "inductor" if ON_GPU else "aot_eager"
    loss = torch.compile(train_step, backend=backend, fullgraph=True)(x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-4)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)

    model.eval()
    torch._dynamo.utils.counters.clear()
    compiled_step = torch.compile(model.decode_step, backend=backend, fullgraph=True)
    with torch.no_grad():
        _, params = model.prefill(x[:, :8], max_seqlen=16)
        _, params_eager = model.prefill(x[:, :8], max_seqlen=16)
        for t in range(8, 13):
            logits = compiled_step(x[:, t : t + 1], params)
            eager = model.decode_step(x[:, t : t + 1], params_eager)
            params.seqlen_offset += 1
            params_eager.seqlen_offset += 1
            torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
    # the first token's graph specializes seqlen_offset (MHA tests it > 0), the second makes it
    # dynamic; the positions and cache lengths are tensors: no graph per token
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_bad_configs():
    with pytest.raises(ValueError, match="attention"):
        GPT(GPTConfig(**SMALL, attention="xformers"))
    with pytest.raises(ValueError, match="num_heads_kv"):
        GPT(GPTConfig(**{**SMALL, "n_kv_head": 3}))
    with pytest.raises(ValueError, match="divisible"):
        GPT(GPTConfig(**{**SMALL, "n_embd": 66}))
