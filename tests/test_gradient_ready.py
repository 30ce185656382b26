"""When each gradient is ready in the backward (`worker/gradient_ready.py`): the clock the
scaling model sends DDP's buckets by."""

from __future__ import annotations

import torch

from ddp_template.worker.gradient_ready import (
    SAMPLED_BACKWARDS,
    SKIPPED_BACKWARDS,
    GradientReadyTimes,
)


def test_the_last_layer_is_ready_first_and_the_record_stops_after_its_sample() -> None:
    """A deep stack's last layer gets its gradient early in the backward, its first layer
    at the end; the shares come in DDP's order (the reverse of `parameters()`). After the
    sampled backwards the hooks come off: a long training keeps a list of fixed length."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(6)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    ready = GradientReadyTimes()
    ready.attach(model)
    x = torch.randn(512, 256)
    for _ in range(SKIPPED_BACKWARDS + SAMPLED_BACKWARDS + 5):
        ready.backward_starts()
        model(x).square().mean().backward()
        ready.backward_ends()
    shares = ready.fractions()
    assert shares is not None
    assert len(shares) == len(list(model.parameters()))
    assert all(0 <= share <= 1 for share in shares)
    # DDP's order: the last layer's bias and weight first, the first layer's last.
    assert shares[0] < shares[-1] and shares[1] < shares[-2]
    assert all(len(recorded) == SAMPLED_BACKWARDS for recorded in ready._shares)
    assert not ready._handles


def test_a_parameter_never_timed_leaves_no_record() -> None:
    """No backward measured (or a gradient that never came): no shares, not a guess."""
    model = torch.nn.Linear(4, 4)
    ready = GradientReadyTimes()
    ready.attach(model)
    assert ready.fractions() is None
    ready.detach()
    assert not ready._handles
