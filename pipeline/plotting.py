"""matplotlib without a display, and a figure as PNG bytes with no timestamp in them (so the same
figure is the same file): what the report's figures and the MQAR probe's draw with."""

from __future__ import annotations

import io


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig) -> bytes:
    """`fig` as PNG bytes (closed after)."""
    plt = pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
