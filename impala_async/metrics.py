"""metrics.jsonl (one JSON object per report interval) and the live one-line console display."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class Progress:
    """One status line: redrawn in place on a terminal, one line per report otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._open = False

    def show(self, r: dict) -> None:
        ret = r.get("episode_return_mean")
        text = (f"{r['wall_s']:7.1f}s  steps {r['env_steps']:>10,}  sps {r['sps']:>8,.0f}  "
                f"return {'-' if ret is None else f'{ret:8.1f}'}  updates {r['learner_steps']:>7,}  "
                f"lag {r['policy_lag_avg'] if r['policy_lag_avg'] is not None else '-':>5}  "
                f"rejected {r['trajectories_rejected']}  dropped {r['trajectories_dropped']}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
