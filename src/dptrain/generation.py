"""Text from a trained language model: `load_run(RUN).generate(prompt, ...)` and `dptrain
generate RUN --prompt TEXT`.

    run = dptrain.load_run("runs/gpt")
    run.generate("ROMEO:", max_new_tokens=200, temperature=0.8, top_k=20, seed=1)

The prompt is encoded with the run's own vocabulary (vocabulary.json; a character it never
had is refused), continued by sampling one token at a time from the model's distribution
(divided by the temperature, cut to the `top_k` most likely), and the prompt plus its
continuation is returned as text. The draws come from a generator seeded with `seed`, so the
same seed gives the same text on the same machine; temperature 0 takes the most likely token
every time (greedy, no draws).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dptrain.errors import ConfigError
from dptrain.models.gpt import sample_tokens
from dptrain.learners.tagi_learner import hrc_probabilities

NEWLINE = "\n"
"""An empty prompt starts from a newline (the start of a line of the text), where the
vocabulary has one."""


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens: expected 0 or more, got {max_new_tokens}")
    if not temperature >= 0:  # also NaN
        raise ConfigError(f"--temperature: expected 0 (greedy) or more, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k: expected 1 or more, got {top_k}")


def encode_prompt(vocabulary: Any, prompt: str, block_size: int
                  ) -> tuple[torch.Tensor, str | None]:
    """The prompt's ids (1, T), T <= block_size, and a one-line note when it had to be cut to
    its last `block_size` tokens (the model sees no more than that)."""
    if prompt == "":
        if vocabulary.kind == "char" and NEWLINE not in (vocabulary.tokens or ()):
            raise ConfigError("--prompt: empty, and this run's vocabulary has no newline to "
                              "start from; give a prompt of its characters")
        ids = vocabulary.encode(NEWLINE, where="--prompt")
    else:
        ids = vocabulary.encode(prompt, where="--prompt")
    note = None
    if len(ids) > block_size:
        note = (f"--prompt: {len(ids)} tokens is longer than the model's context of "
                f"{block_size}; it continues the last {block_size}")
        ids = ids[-block_size:]
    return ids.unsqueeze(0), note


def generate_text(model: Any, vocabulary: Any, block_size: int, prompt: str, *,
                  max_new_tokens: int, temperature: float, top_k: int | None, seed: int,
                  report: Callable[[str], None] | None = None) -> str:
    """`prompt` and `max_new_tokens` tokens sampled after it, decoded (see the module
    docstring); `report` receives the note of a cut prompt."""
    check_sampling(max_new_tokens, temperature, top_k)
    ids, note = encode_prompt(vocabulary, prompt, block_size)
    if note is not None and report is not None:
        report(note)
    device = model.device if hasattr(model, "device") else next(model.parameters()).device
    ids = ids.to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                         generator=generator, never=vocabulary.unknown_id)
    return prompt + vocabulary.decode(out[0, ids.shape[1]:])


class TagiLanguageModel:
    """A tagi-gpt network as `generate_text` samples from it: the next token's log-probability
    is the log of the hierarchical softmax's probability at the window's last position (scaled
    to sum to 1 over the vocabulary), the output's uncertainty included."""

    def __init__(self, net: Any, hrc: Any, block_size: int) -> None:
        self.net, self.hrc, self.block_size = net, hrc, block_size
        self.device = net.device

    @torch.no_grad()
    def next_log_probabilities(self, window: torch.Tensor) -> torch.Tensor:
        width = self.hrc.num_outputs
        mu, var = self.net(window)
        last = (mu[:, -width:].double(), var[:, -width:].double())
        return hrc_probabilities(self.hrc, *last, per_token=True).clamp_min(1e-300).log()

    def generate(self, ids: torch.Tensor, max_new_tokens: int, **sampling: Any) -> torch.Tensor:
        self.net.eval()
        return sample_tokens(self.next_log_probabilities, ids, self.block_size, max_new_tokens,
                             **sampling)
