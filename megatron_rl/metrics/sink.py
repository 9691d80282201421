"""One metrics sink for the whole run: stdout line, metrics.jsonl, TensorBoard. Rank-0 gated here.

Keys are namespaced (`rollout/reward_mean`, `mismatch/kl_k3`, `timing/generate`). Values are
floats; anything else (tables) goes through `log_table` / `log_figure`. Each metrics.jsonl row is
{"step", "time", "phase" ("sft" | "rl"), <metrics>}; `drop_rows_after(step)` removes the RL rows a
resumed run is about to write again, and has TensorBoard hide the RL points of those steps that
the interrupted run wrote (a purge step); a line that is not a metrics row (not UTF-8, not JSON, not
an object, a step that is not a number) is dropped with a message naming the file and line,
instead of stopping the resume. The SFT warm start's events go to their own TensorBoard
run, `tensorboard/sft`, so that purge, which hides every later step of its run, leaves them alone.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

from megatron_rl.fs import open_no_follow


class MetricsSink:
    """Writes metrics on the writer rank only; every other rank holds a no-op sink."""

    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool = True, jsonl: bool = True,
                 stdout_keys: tuple[str, ...] = ()):
        self.enabled = enabled
        self.run_dir = run_dir
        self.stdout_keys = stdout_keys
        self._tb = None
        self._tb_sft = None
        self._jsonl = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if jsonl:
            # open for the run's life (closed in close()); line-buffered, so each row reaches the file whole
            self._jsonl = open_no_follow(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    @property
    def tensorboard_dir(self) -> str | None:
        """Where the events go; None when this run writes none (log.tensorboard=false)."""
        return self._tb.get_logdir() if self._tb is not None else None

    def log(self, step: int, metrics: dict[str, float], echo: str | None = None, phase: str = "rl") -> None:
        """Record `metrics` at `step` of `phase`; print the stdout keys (prefixed by `echo`) when given."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), "phase": phase, **clean}) + "\n")
        tb = self._sft_writer() if phase == "sft" else self._tb
        if tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    tb.add_scalar(k, v, step)
        if echo is not None:
            shown = " ".join(f"{k.split('/')[-1]}={clean[k]:.4g}" for k in self.stdout_keys if k in clean)
            print(f"{echo} {shown}", flush=True)

    def _sft_writer(self):
        if self._tb is not None and self._tb_sft is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_sft = SummaryWriter(log_dir=os.path.join(self._tb.get_logdir(), "sft"))
        return self._tb_sft

    def drop_rows_after(self, step: int) -> int:
        """Rewrite metrics.jsonl without the RL rows of steps > `step` (a resume redoes them), and
        reopen the RL events with purge step `step + 1`, so TensorBoard hides the interrupted run's
        points of those steps instead of showing them beside the new ones. Returns how many rows were
        dropped. The rewrite is atomic (temp file + rename)."""
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = self._tb.get_logdir()
            self._tb.close()
            self._tb = SummaryWriter(log_dir=log_dir, purge_step=step + 1)
        if self._jsonl is None:
            return 0
        path = os.path.join(self.run_dir, "metrics.jsonl")
        self._jsonl.close()
        kept, dropped = [], 0
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        if not lines[-1]:
            lines.pop()  # the file ends with a newline; else its last line may be one a crash cut short
        for number, raw in enumerate(lines, 1):
            row, why = _parse_row(raw)
            if why is not None:  # not a row: dropped, and said where (the resume goes on)
                dropped += 1
                if number < len(lines) or not why.startswith("not JSON"):
                    print(f"{path}:{number}: {why}; dropped that line", file=sys.stderr, flush=True)
            elif row.get("phase", "rl") == "rl" and row.get("step", 0) > step:
                dropped += 1
            else:
                kept.append(raw.decode() + "\n")
        tmp = path + ".tmp"
        with open_no_follow(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._jsonl = open_no_follow(path, "a", buffering=1)  # lives as long as the sink
        return dropped

    def sync(self) -> None:
        """metrics.jsonl and the events on disk (fsync): called before a checkpoint is published, so
        the rows of the steps it holds survive a power loss (a resume never writes them again)."""
        if self._jsonl is not None:
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())
        for tb in (self._tb, self._tb_sft):
            if tb is not None:
                tb.flush()

    def log_figure(self, tag: str, figure, step: int) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_figure(tag, figure, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        for tb in (self._tb, self._tb_sft):
            if tb is not None:
                tb.close()


def _parse_row(raw: bytes) -> tuple[dict | None, str | None]:
    """(row, None) for a metrics row, else (None, why it is not one)."""
    try:
        row = json.loads(raw.decode())
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except ValueError:
        return None, "not JSON (cut short?)"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not a row (an object)"
    if type(row.get("step", 0)) not in (int, float):
        return None, f"its step is {row['step']!r}, not a number"
    return row, None
