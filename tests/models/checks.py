"""What every sequence mixer's LM must show, checked the same way for each: changing future
tokens never changes earlier outputs, and does change later ones."""

from __future__ import annotations


def assert_never_looks_ahead(model, vocab_size: int, *, atol: float = 1e-5) -> None:
    """Tokens 25.. of two random sequences of 40 changed: outputs 0..24 equal within `atol`,
    later ones moved."""
    import torch

    ids = torch.randint(0, vocab_size, (2, 40))
    changed = ids.clone()
    changed[:, 25:] = (changed[:, 25:] + 7) % vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :25], b[:, :25], atol=atol, rtol=1e-5)
    assert (a[:, 25:] - b[:, 25:]).abs().max() > 1e-3
