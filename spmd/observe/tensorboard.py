"""TensorBoard scalars beside the JSONL, fed by the same records (spmd.observe.metrics.MetricsLog).

Written with tensorboardX (the optional extra `tensorboard`): pure Python over protobuf, with no
TensorFlow or PyTorch behind it. Every number of a record that has a `step` becomes the scalar
"<kind>/<field>", e.g. train/loss, train/mfu, eval/loss, profile/comm_fraction; None (unknown,
such as MFU on a CPU) is left out rather than written as a number.
"""

from __future__ import annotations

from typing import Any

from spmd.errors import UsageError


class ScalarWriter:
    """Event files in `logdir` (created if needed), flushed after every record."""

    def __init__(self, logdir: str) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise UsageError(
                f"--tensorboard {logdir} needs the tensorboardX package; install it with "
                f"pip install -e '.[tensorboard]' or drop --tensorboard"
            ) from None
        self._writer = SummaryWriter(logdir)

    def write(self, kind: str, fields: dict[str, Any]) -> None:
        step = fields.get("step")
        if not isinstance(step, int):
            return
        for key, value in fields.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(f"{kind}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
