"""Size the KV pool from the GPU, as vLLM does: `gpu_memory_utilization` of the card, less what is
already in use (the weights, the CUDA context, other processes) and the activations of the largest step."""
from __future__ import annotations

import torch

from kvserve.attention.batch import AttentionBatch
from kvserve.kv.nocache import NoKVStorage
from kvserve.model.decoder import CausalLM


@torch.inference_mode()
def dummy_forward(model: CausalLM, backend, device: torch.device, num_tokens: int, max_model_len: int,
                  num_logits: int) -> torch.Tensor:
    """The largest step the scheduler can make: `num_tokens` prompt tokens (as prompts of
    max_model_len) without a cache; returns the float logits of `num_logits` of them."""
    full, rest = divmod(num_tokens, max_model_len)
    lens = [max_model_len] * full + ([rest] if rest else [])
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    batch = AttentionBatch(num_decodes=0, slot_mapping=None, block_tables=None,
                           context_lens=torch.tensor(lens, device=device), query_lens=lens,
                           context_lens_list=lens, has_prefix=False)
    model.ensure_rope(max(lens))
    storage = NoKVStorage(len(model.model.layers))
    hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device), positions, batch, backend, storage)
    return model.compute_logits(hidden[:num_logits]).float()


def kv_pool_bytes(total: int, free: int, activations: int, utilization: float) -> int:
    """What the KV pool may take: `utilization` of the card's `total` bytes, less those in use
    (total - free) and the activations' peak."""
    return int(total * utilization) - (total - free) - activations


def profile_kv_memory(model: CausalLM, backend, device: torch.device, num_tokens: int, max_model_len: int,
                      num_logits: int, utilization: float) -> int:
    """Run the largest step once and measure its peak on the CUDA allocator; the pool's bytes."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    dummy_forward(model, backend, device, num_tokens, max_model_len, num_logits)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return kv_pool_bytes(total, free, activations, utilization)
