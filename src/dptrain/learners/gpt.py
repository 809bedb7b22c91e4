"""`torch-gpt`: a decoder-only transformer language model.

    model = GPT(GPTConfig(vocab_size=66, block_size=64, layers=4, heads=4, width=128))
    logits = model(ids)                      # ids (B, T) int64 -> logits (B, T, vocab)
    model.flops_per_token()                  # training FLOPs per token, for MFU
    model.generate(ids, 100, temperature=0.8, top_k=20, generator=g)

The architecture is GPT-2's: token and learned position embeddings, blocks of pre-LayerNorm
causal self-attention (torch's `scaled_dot_product_attention`, which picks a fused kernel) and a
4x GELU MLP, each added to the residual stream, a final LayerNorm, and an output layer that
shares its weight with the token embedding. Initialisation follows GPT-2: normal(0, 0.02)
everywhere, with the projections that write into the residual stream scaled by
1/sqrt(2 * layers) so that the stream's variance does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Callable

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    layers: int = 4
    heads: int = 4
    width: int = 128
    dropout: float = 0.0
    bias: bool = False
    """Biases in the Linear layers and LayerNorms (GPT-2 has them; small models train as well
    without, a little faster)."""

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"torch-gpt: the width ({self.width}) must be a multiple of the "
                             f"number of heads ({self.heads})")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=config.bias)
        self.proj = nn.Linear(config.width, config.width, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width, bias=config.bias)
        self.proj = nn.Linear(4 * config.width, config.width, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.width, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.width, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.width)
        self.position_embedding = nn.Embedding(config.block_size, config.width)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_final = nn.LayerNorm(config.width, bias=config.bias)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one matrix, both ends
        self.apply(_init_weights)
        residual_std = INIT_STD / math.sqrt(2 * config.layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, std=residual_std)

    def shard_units(self) -> list[nn.Module]:
        """The model's blocks: the units `dptrain.learners.parallelize` wraps one by one, each
        recomputed in the backward with activation checkpointing and sharded by FSDP before the
        root (its parameters gathered only while it runs). The model applies neither."""
        return list(self.blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"torch-gpt: a sequence of {t} tokens is longer than the model's "
                             f"context of {self.config.block_size}")
        positions = torch.arange(t, device=ids.device)
        x = self.dropout(self.token_embedding(ids) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))

    def num_parameters(self) -> int:
        """Parameters, the tied output matrix counted once."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """Training FLOPs per token at the full context: 6 per parameter-token for the matrix
        products forward and backward, plus attention's scores and weighted sums, 12 * layers
        * width * context (the PaLM paper's appendix B count). Position embeddings are a
        lookup, not a product, and are left out."""
        c = self.config
        matmul_params = self.num_parameters() - self.position_embedding.weight.numel()
        return 6.0 * matmul_params + 12.0 * c.layers * c.width * c.block_size

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 never: int | None = None) -> torch.Tensor:
        """`ids` (B, T) continued by `max_new_tokens` sampled tokens, each conditioned on the
        last `block_size` tokens; temperature 0 takes the most likely token. `never`: an id
        that is not drawn (a vocabulary's unknown id, which stands for no character)."""
        was_training = self.training
        self.eval()
        try:
            return sample_tokens(lambda window: self(window)[:, -1, :].float(), ids,
                                 self.config.block_size, max_new_tokens,
                                 temperature=temperature, top_k=top_k, generator=generator,
                                 never=never)
        finally:
            self.train(was_training)


def sample_tokens(next_logits: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
                  block_size: int, max_new_tokens: int, *, temperature: float = 1.0,
                  top_k: int | None = None, generator: torch.Generator | None = None,
                  never: int | None = None) -> torch.Tensor:
    """`ids` (B, T) continued by `max_new_tokens` tokens drawn one at a time from
    softmax(`next_logits`(the last `block_size` ids) / temperature), cut to the `top_k` most
    likely; temperature 0 takes the most likely; `never` is an id not drawn. Any language
    model's loop: torch-gpt's logits, tagi-gpt's log-probabilities."""
    for _ in range(max_new_tokens):
        logits = next_logits(ids[:, -block_size:])
        if never is not None:
            logits[:, never] = float("-inf")
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=INIT_STD)
