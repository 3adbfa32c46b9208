"""Progress display: a tqdm bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys

import jax


class Progress:
    """A tqdm bar on a terminal, plain log lines otherwise (prefixed by a trial's label)."""

    def __init__(self, start, total, enabled, hide=()):
        self.bar, self.last, self.hide = None, [], tuple(hide)
        self.quiet = jax.process_index() != 0  # one process speaks for a multi-host run
        if enabled and sys.stderr.isatty() and not self.quiet:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, n, records=()):
        """Advances by ``n`` steps and shows ``records``, a list of (label, record) pairs."""
        if self.bar is not None:
            self.bar.update(n)
            self.last = list(records) or self.last
            if records:
                self.bar.set_postfix(
                    {
                        k: f"{v:.4g}"
                        for k, v in records[0][1].items()
                        if k in ("train_loss", "eval_loss")
                    }
                )
            return
        if not self.quiet:
            _print(records, self.hide)

    def close(self):
        """Closes the bar and prints the last records (the bar showed only the losses)."""
        if self.bar is not None:
            self.bar.close()
            _print(self.last, self.hide)
            self.bar = None


def _print(records, hide=()):
    for label, record in records:
        fields = " ".join(
            f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in record.items()
            if k not in hide
        )
        print(f"[{label}] {fields}" if label else fields, flush=True)
