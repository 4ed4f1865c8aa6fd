"""transformers' ``generate()`` on a model fsdp2d sharded, ranks finishing at different steps.

Every rank runs ``model.generate`` on its own prompt. Under FSDP each forward all-gathers
on every rank, so a rank whose sequence ended must keep calling forward until all ranks
have ended; transformers does that with ``synced_gpus``, which it turns on by itself
(``synced_gpus=None``, the default) when ``is_fsdp_managed_module(model)`` is true, i.e. when
the model carries ``_is_fsdp_managed_module``, as torch's ``fully_shard`` and fsdp2d's set
it. Without it the rank that finished first returns while the others wait in an all-gather:
a hang (the pool's timeout turns it into a failure).

Where each rank stops is forced by a logits processor (the same code on every rank and in
the one-process reference): EOS is forbidden until ``STOP[rank]`` new tokens, then forced,
so ranks stop after 2, 5 and 8 new tokens and the last one at ``max_new_tokens``; greedy
decoding, so the output is a pure function of the model and the prompt.
"""

from __future__ import annotations

import copy

import torch

from .pool import get_mesh

VOCAB, EOS, PROMPT, MAX_NEW = 64, 0, 5, 12
STOP = (2, 5, 8, MAX_NEW + 1)  # new tokens before EOS, per rank; the last rank never stops early


class ForceEOSAfter:
    """Forbid EOS before ``n`` new tokens, force it at the ``n``-th (a transformers logits
    processor: ``(input_ids (B, T), scores (B, V)) -> scores``)."""

    def __init__(self, prompt_len: int, n: int) -> None:
        self.prompt_len, self.n = prompt_len, n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        if input_ids.shape[1] - self.prompt_len < self.n:
            scores[:, EOS] = float("-inf")
        else:
            scores[:, :EOS] = scores[:, EOS + 1:] = float("-inf")
        return scores


def _model() -> torch.nn.Module:
    """A tiny transformers Llama (2 layers, GQA 4/2 heads), built here: no hub."""
    import transformers as T

    torch.manual_seed(1234)
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=PROMPT + MAX_NEW,
                        eos_token_id=EOS, pad_token_id=EOS, bos_token_id=1)
    return T.LlamaForCausalLM(cfg).eval()


def _generate(model: torch.nn.Module, prompt: torch.Tensor, stop: int, **kwargs) -> list[int]:
    from transformers import LogitsProcessorList

    out = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False,
                         logits_processor=LogitsProcessorList([ForceEOSAfter(PROMPT, stop)]), **kwargs)
    return out[0, PROMPT:].tolist()


def generate_ragged() -> dict:
    """fsdp2d shards the model per layer and root over all 4 ranks; each rank generates
    from its own prompt; the same prompts on the unsharded model in this process."""
    import torch.distributed as dist
    from transformers.integrations.fsdp import is_fsdp_managed_module

    import fsdp2d

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model()
    ref = copy.deepcopy(model)
    mesh = get_mesh((dist.get_world_size(),), ("dp",))
    for layer in model.model.layers:
        fsdp2d.fully_shard(layer, mesh=mesh)
    fsdp2d.fully_shard(model, mesh=mesh)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        tokens = _generate(model, prompt, STOP[rank])  # synced_gpus left to transformers
        ref_tokens = _generate(ref, prompt, STOP[rank], synced_gpus=False)
    return {"managed": is_fsdp_managed_module(model), "tokens": tokens, "ref_tokens": ref_tokens,
            "forwards": len(forwards)}
