"""A TAGI network that is collapsed from its first step, for the tests of contract 10
(`--model tests/_collapsing_model.py:dead_relus`).

Which seeds of a real network collapse depends on the CPU's float summation order (a seed
that collapses on one machine learns on another), so a test built on such a seed passes or
fails with the machine. This network is in the collapsed state by construction: every unit of
its hidden ReLU layer is dead for every input, the state a collapsing run reaches in its first
steps (docs/tagi.md, Collapsed runs). The hidden layer's bias means start at `DEAD_BIAS`, far
below what the weights can add (|w·x| <= |w| |x|: at most 1.07 x 34 on the normalised 28x28
digits of these tests, 4.8 measured), so every pre-activation is negative, the ReLU outputs
exactly 0 with J = 0, and no innovation ever reaches that layer (TAGI's backward multiplies by
J): it stays dead. The head sees zeros for every sample and can only learn the labels' base
rate, so its predictions do not depend on the input (their spread over the test set is 0).
"""

from __future__ import annotations

import math

from dptrain.tagi import Linear, ReLU, Sequential

DEAD_BIAS = -1e3
"""Initial bias mean of every hidden unit (its variance is 1e-6)."""
HIDDEN = 16


def dead_relus(input_shape: tuple[int, ...], num_outputs: int) -> Sequential:
    hidden = Linear(math.prod(input_shape), HIDDEN)
    net = Sequential(hidden, ReLU(), Linear(HIDDEN, num_outputs))
    hidden.mu_b.fill_(DEAD_BIAS)  # live views of the network's parameters
    hidden.var_b.fill_(1e-6)
    return net
