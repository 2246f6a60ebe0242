"""Rows that share a prompt share its forward (plexrl/engines/prefix.py): the same log-probs, entropies and
gradients as the plain forward, with each distinct prompt computed once."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from plexrl.engines.logprobs import scored_logprobs, token_logprobs
from plexrl.engines.prefix import prefix_groups
from plexrl.engines.torch_engine import positions


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seven rows over a 6-column prompt area: prompt A (width 4) x 3 samples, prompt B (width 6) x 3, and
    one row of its own (width 2); responses of different lengths (one empty) right-padded to 5 columns.
    Rows of one prompt are not adjacent."""
    g = torch.Generator().manual_seed(3)
    P, R = 6, 5
    prompts = {0: torch.randint(3, 97, (4,), generator=g), 1: torch.randint(3, 97, (6,), generator=g)}
    lone = torch.randint(3, 97, (2,), generator=g)
    which = [0, 1, 0, 1, 2, 0, 1]
    lengths = [5, 3, 0, 5, 4, 1, 2]
    ids = torch.zeros(len(which), P + R, dtype=torch.long)
    attn = torch.zeros_like(ids)
    scored = torch.zeros(len(which), P + R)
    for i, (w, n) in enumerate(zip(which, lengths, strict=True)):
        p = prompts.get(w, lone)
        ids[i, P - len(p) : P], attn[i, P - len(p) : P] = p, 1
        ids[i, P : P + n] = torch.randint(3, 97, (n,), generator=g)
        attn[i, P : P + n], scored[i, P : P + n] = 1, 1
    return ids, attn, scored


def test_rows_are_grouped_by_their_prompt_tokens_and_padding() -> None:
    ids, attn, _ = _batch()
    first, inverse = prefix_groups(ids, attn, 6)  # type: ignore[misc]
    assert len(first) == 3
    assert inverse[0] == inverse[2] == inverse[5] and inverse[1] == inverse[3] == inverse[6]
    assert len({int(inverse[0]), int(inverse[1]), int(inverse[4])}) == 3
    assert [int(inverse[int(f)]) for f in first] == list(range(3))  # each group's first row is in it
    assert prefix_groups(ids[[0, 1, 4]], attn[[0, 1, 4]], 6) is None  # nothing shared: the plain forward


def test_a_shared_prompt_forward_gives_the_plain_forwards_logprobs_and_gradients_once_per_prompt() -> None:
    model = _model()
    ids, attn, scored = _batch()
    full = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn)).logits
    lp_full, ent_full = token_logprobs(full, ids, 1.3)
    (lp_full * scored).sum().backward()
    grads_full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    seen: list[tuple[int, ...]] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: seen.append(tuple(args[0].shape)))
    lp, ent = scored_logprobs(model, ids, attn, 1.3, scored, use_cache=False)
    hook.remove()
    assert seen == [(3, 6), (7, 5)]  # the three distinct prompts once, then every row's response columns
    on = scored.bool()
    torch.testing.assert_close(lp[on], lp_full[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[on], ent_full[on], rtol=1e-5, atol=1e-5)
    (lp * scored).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_with_gradient_checkpointing_the_plain_forward_runs() -> None:
    model = _model()
    model.gradient_checkpointing_enable()
    model.train()
    ids, attn, scored = _batch()
    seen: list[tuple[int, ...]] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: seen.append(tuple(args[0].shape)))
    scored_logprobs(model, ids, attn, 1.0, scored, use_cache=False)
    hook.remove()
    assert seen == [(7, 11)]
