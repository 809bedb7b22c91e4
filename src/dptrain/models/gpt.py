"""The GPTs, language models on windows of token ids (text:, tokens:): torch-gpt, GPT-2's
decoder (`GPT`), and tagi-gpt, a decoder-only TAGI transformer. Their report adds perplexity
and bits per character (or byte, or token), tokens per second and, for torch-gpt, the model
FLOPs utilisation.

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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dptrain.data.datasets.vocabulary import FILE_NAME as VOCABULARY_FILE
from dptrain.errors import ConfigError
from dptrain.models.data_spec import DataSpec
from dptrain.models.shapes import gains
from dptrain.models.spec import Family, MetricExtras, ModelOptions, ModelSpec
from dptrain.tagi import (Embedding, LayerBlock, Linear, MultiheadAttention, ReLU, RMSNorm,
                          ResNetBlock, Sequential)


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


# ------------------------------------------------------------------------ the family
def torch_gpt(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions
              ) -> nn.Module:
    """A GPT over a vocabulary of `num_outputs` tokens whose context is the data's window."""
    return GPT(GPTConfig(vocab_size=num_outputs, block_size=input_shape[0],
                         layers=options.layers, heads=options.heads, width=options.width,
                         dropout=options.dropout))


def tagi_gpt(input_shape: tuple[int, ...], num_outputs: int, options: ModelOptions
             ) -> Sequential:
    """A decoder-only TAGI transformer (docs/tagi.md, A TAGI GPT): Embedding, then per block
    RMSNorm → causal MultiheadAttention (RoPE, softmax weights) and RMSNorm → MLP (4x wide,
    ReLU), each in a residual block, a final RMSNorm and a per-position head of the
    hierarchical softmax's `num_outputs` for `options.vocab_size` tokens. No position embedding: RoPE places tokens.
    Widths, heads and blocks are torch-gpt's flags (`--width`, `--heads`, `--layers`)."""
    if options.vocab_size < 2:
        raise ConfigError(f"tagi-gpt needs the vocabulary's size (>= 2 tokens), got "
                          f"{options.vocab_size}")
    e, heads, context = options.width, options.heads, input_shape[0]
    if e % heads or (e // heads) % 2:
        raise ConfigError(f"tagi-gpt: --width {e} must be a multiple of --heads {heads} with an "
                          f"even head size (RoPE rotates pairs of features)")
    gw, gb = gains(options)

    def linear(inputs: int, outputs: int) -> Linear:
        return Linear(inputs, outputs, gain_weight=gw, gain_bias=gb, per_position=True)

    layers: list[Any] = [Embedding(options.vocab_size, e)]
    for _ in range(options.layers):
        # scores scaled by 1/sqrt(head size), as a torch transformer's: cuTAGI's unscaled
        # scores have variances in the hundreds at 16 features a head, and the network
        # learned less on tiny Shakespeare; weights by the softmax's moments, not Remax's,
        # whose ReLU floors every negative score: with Remax the validation loss rose as it
        # trained (docs/results.md, A TAGI GPT)
        layers.append(ResNetBlock(LayerBlock(
            RMSNorm(e), MultiheadAttention(e, heads, use_rope=True, max_seq_len=context,
                                           gain_weight=gw, gain_bias=gb,
                                           score_scale=1 / math.sqrt(e // heads),
                                           weights="softmax"))))
        layers.append(ResNetBlock(LayerBlock(RMSNorm(e), linear(e, 4 * e), ReLU(),
                                             linear(4 * e, e))))
    return Sequential(*layers, RMSNorm(e), linear(e, num_outputs), dtype=options.dtype)


# nanoGPT's recipe for its small character-level Shakespeare model (karpathy/nanoGPT,
# config/train_shakespeare_char.py, at the sizes of its CPU run): AdamW with beta2 0.99 (few
# tokens per step), decay on matrices only, 100 warm-up steps, cosine to lr / 10, clipping 1.
_GPT_DEFAULTS = {"width": 128, "batch_size": 12, "optimizer": "adamw", "lr": 1e-3,
                 "betas": "0.9,0.99", "weight_decay": 0.1, "schedule": "cosine",
                 "schedule_unit": "steps", "warmup": 100, "min_lr": 1e-4, "clip_grad_norm": 1.0}
# torch-gpt's sizes and batch; TAGI has no learning rate or optimizer to set. sigma_v: each
# next token is one noisy draw, so the ±1 observations of the hierarchical softmax are noisy;
# of 1, 2, 4, 8 and 12, 4 gave the lowest validation loss on tiny Shakespeare.
_TAGI_GPT_DEFAULTS = {"width": 128, "batch_size": 12, "sigma_v": 4.0}


def check_input(spec: ModelSpec, input_shape: tuple[int, ...]) -> None:
    if len(input_shape) != 1:
        raise ConfigError(f"model {spec.name} takes windows of token ids, (block-size,); the "
                          f"dataset's inputs have shape {tuple(input_shape)} (use text:PATH or "
                          f"tokens:DIR)")


def per_position_figures(unit: str) -> Callable[[dict[str, float], str], dict[str, float]]:
    """The figures of a part whose `loss` is the mean cross-entropy per position, in nats:
    perplexity (its exp) and bits per `unit` (it / ln 2); none without a finite loss."""
    def derive(means: dict[str, float], prefix: str) -> dict[str, float]:
        loss = means.get("loss")
        if loss is None or not math.isfinite(loss):
            return {}
        # exp overflows past ~709 nats: an untrained model on a huge vocabulary is infinite
        perplexity = math.exp(loss) if loss < 700 else math.inf
        return {f"{prefix}_perplexity": perplexity,
                f"{prefix}_bits_per_{unit}": loss / math.log(2)}

    return derive


def headline(summary: dict[str, Any]) -> str | None:
    """The final line's first figures: the per-token loss in nats, its perplexity and bits
    per unit; the validation part's when there is no test part."""
    part = next((p for p in ("test", "val") if summary.get(f"{p}_perplexity") is not None), None)
    if part is None:
        return None
    bits = next((k for k in summary if k.startswith(f"{part}_bits_per_")), None)
    shown = f"{part}_loss {summary[f'{part}_loss']:.4f}, perplexity " \
            f"{summary[f'{part}_perplexity']:.4g}"
    if bits is not None:
        shown += f", {summary[bits]:.4f} bits per {bits[len(f'{part}_bits_per_'):]}"
    if part == "test" and summary.get("val_loss") is not None:
        shown += f" (val_loss {summary['val_loss']:.4f})"
    elif part == "val":
        shown += " (no test part)"
    return shown


def check_options(spec: ModelSpec, options: ModelOptions) -> None:
    if options.width % options.heads:
        raise ConfigError(f"{spec.name}: width {options.width} is not a multiple of heads "
                          f"{options.heads} (each head takes width / heads of it)")


def language_metrics(data: DataSpec) -> MetricExtras:
    """Per-token loss as perplexity and bits per unit (a character, byte or token), the
    positions of a window, the vocabulary and the characters outside it met in each part in
    the report; the validation loss chooses."""
    vocabulary = data.vocabulary
    if vocabulary is None:
        return MetricExtras()
    return MetricExtras(
        derive=per_position_figures(vocabulary.unit), headline=headline,
        positions_per_sample=data.input_shape[0], monitor="loss",
        summary={"vocabulary": {"kind": vocabulary.kind, "size": vocabulary.size,
                                "file": VOCABULARY_FILE},
                 "unknown_tokens": dict(data.unknown_tokens)})


FAMILY = Family(
    name="gpt",
    models=(ModelSpec("torch-gpt", "torch", torch_gpt, "torch GPT language model (GPT-2's "
                      "decoder: --layers blocks of --heads causal attention heads, --width "
                      "wide, context --block-size)", defaults=_GPT_DEFAULTS),
            ModelSpec("tagi-gpt", "tagi", tagi_gpt, "TAGI GPT language model (--layers blocks "
                      "of RMSNorm, causal attention with RoPE over --heads heads and a ReLU "
                      "MLP, --width wide, context --block-size; a hierarchical softmax over "
                      "the vocabulary)", defaults=_TAGI_GPT_DEFAULTS,
                      options=("layers", "heads", "width", "gain_weight", "gain_bias",
                               "vocab_size"))),
    data=frozenset({"tokens"}),
    options=("layers", "heads", "width", "dropout", "gain_weight", "gain_bias", "vocab_size"),
    check_input=check_input, check_options=check_options, metrics=language_metrics,
    blocks=lambda model: model.shard_units())
