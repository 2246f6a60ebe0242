"""The training forward runs the output head only over the responses: same log-probs, entropies and
gradients as the full forward on every scored column."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from plexrl.engines.logprobs import scored_logprobs, token_logprobs
from plexrl.engines.torch_engine import positions


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows: left-padded prompts (widths 5, 3, 6 of 6) then responses (lengths 4, 2, 0 of 4)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (3, 10), generator=g)
    attn = torch.ones(3, 10, dtype=torch.long)
    attn[0, :1] = 0
    attn[1, :3] = 0
    scored = torch.zeros(3, 10)
    scored[0, 6:10] = 1
    scored[1, 6:8] = 1
    attn[1, 8:] = 0  # the response's padding
    attn[2, 6:] = 0  # no response at all
    ids[attn == 0] = 0
    return ids, attn, scored


def test_the_head_over_responses_only_gives_the_full_forwards_logprobs_and_gradients() -> None:
    model = _model()
    ids, attn, scored = _batch()
    full = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn)).logits
    lp_full, ent_full = token_logprobs(full, ids, 1.3)
    (lp_full * scored).sum().backward()
    grads_full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    lp, ent = scored_logprobs(model, ids, attn, 1.3, scored)
    assert lp.shape == ent.shape == ids.shape
    on = scored.bool()
    torch.testing.assert_close(lp[on], lp_full[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[on], ent_full[on], rtol=1e-5, atol=1e-5)
    assert (lp[:, :5] == 0).all()  # before the column ahead of the first scored one: not computed
    (lp * scored).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_a_scored_mask_every_column_is_computed() -> None:
    model = _model()
    ids, attn, _ = _batch()
    full = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn)).logits
    with torch.no_grad():
        for scored in (None, torch.zeros(3, 10)):
            lp, _ = scored_logprobs(model, ids, attn, 1.0, scored)
            torch.testing.assert_close(lp, token_logprobs(full, ids, 1.0)[0])
