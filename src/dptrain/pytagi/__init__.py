"""pytagi 0.2.1's Python surface on dptrain's TAGI engine: a pytagi program runs with only its
imports changed (docs/tutorials/from_pytagi.md)::

    import dptrain.pytagi as pytagi                 # was: import pytagi
    from dptrain.pytagi.nn import Linear, OutputUpdater, ReLU, Sequential   # was: pytagi.nn

    net = Sequential(Linear(1, 50), ReLU(), Linear(50, 1))
    updater = OutputUpdater(net.device)
    m_pred, v_pred = net(x)                          # flat numpy arrays in and out, as pytagi
    updater.update(net.output_z_buffer, mu_obs=y, var_obs=var_y,
                   delta_states=net.input_delta_z_buffer)
    net.backward(); net.step()

This package is an adapter: it converts at the edge (numpy <-> torch, flat <-> (B, N), pytagi's
`state_dict` keys) and calls `dptrain.tagi`, the torch-native API; it has no TAGI math of its
own. The helpers pytagi implements in C++ (`Utils`: label coding for the hierarchical softmax,
rolling windows, the MNIST and CIFAR readers) are numpy here, checked against the wheel's
outputs.
"""

from __future__ import annotations

from dptrain.pytagi import cuda, metric
from dptrain.pytagi.metric import HRCSoftmaxMetric
from dptrain.pytagi.tagi_utils import HRCSoftmax, Normalizer, Utils, exponential_scheduler
from dptrain.tagi import manual_seed

is_cuda_available = cuda.is_available
"""Called by pytagi 0.2.1's heteroscedastic example, though its own package lacks it."""

__version__ = "0.2.1"
"""The pytagi version whose surface this package follows."""

__all__ = ["HRCSoftmax", "HRCSoftmaxMetric", "Normalizer", "Utils", "cuda",
           "exponential_scheduler", "is_cuda_available", "manual_seed", "metric"]
