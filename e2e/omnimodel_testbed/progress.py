"""Numbered steps that never go quiet: the progress output of ``python -m omnimodel_testbed demo``.

Every line carries the time since the command started (``[m:ss]``). While a step runs, a line at
least every ``heartbeat`` seconds says what it is waiting for (its ``status``); once a step takes longer
than it should, one line says so and names the logs to look at. A failure names the step.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TextIO

__all__ = ["DEFAULT_HEARTBEAT", "Reporter", "StepError"]

#: Longest a running step stays silent (seconds).
DEFAULT_HEARTBEAT = 15.0


class StepError(RuntimeError):
    """A step failed or ran past its deadline; the message says what to look at."""


class Reporter:
    """Prints numbered steps of a fixed plan, with heartbeats while one runs.

    ``steps`` is the whole plan as ``(key, title)`` pairs, so a step started in another process (the
    demo runs half of its steps inside a network namespace) keeps its number. ``t0`` is the wall-clock
    start of the whole command.
    """

    def __init__(
        self,
        steps: Sequence[tuple[str, str]],
        *,
        t0: float | None = None,
        out: TextIO | None = None,
        heartbeat: float = DEFAULT_HEARTBEAT,
    ) -> None:
        self.steps = list(steps)
        self.t0 = time.time() if t0 is None else t0
        self.out = out or sys.stdout
        self.heartbeat = heartbeat
        self._lock = threading.RLock()
        self._last_output = time.monotonic()
        self._current: tuple[str, float, float, Callable[[], Sequence[str]]] | None = None
        self._warned = False
        self._status = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------- output
    def _emit(self, text: str) -> None:
        elapsed = int(time.time() - self.t0)
        stamp = f"[{elapsed // 60}:{elapsed % 60:02d}]"
        with self._lock:
            for line in text.splitlines() or [""]:
                self.out.write(f"{stamp} {line}\n")
            self.out.flush()
            self._last_output = time.monotonic()

    def say(self, text: str) -> None:
        """One or more lines under the current step."""
        self._emit("\n".join(f"    {line}" for line in text.splitlines()))

    def headline(self, text: str) -> None:
        """A line at step level (not indented)."""
        self._emit(text)

    @property
    def status(self) -> str:
        """What the running step is waiting for; the heartbeat line repeats it."""
        with self._lock:
            return self._status

    @status.setter
    def status(self, value: str) -> None:
        with self._lock:
            self._status = value

    def number(self, key: str) -> str:
        """``[k/N] title`` of a planned step."""
        keys = [k for k, _ in self.steps]
        i = keys.index(key)
        return f"[{i + 1}/{len(keys)}] {self.steps[i][1]}"

    # -------------------------------------------------------------------------------------- steps
    @contextmanager
    def step(
        self,
        key: str,
        *,
        slow_after: float,
        look_at: Callable[[], Sequence[str]] | Sequence[str] = (),
    ) -> Iterator[None]:
        """Run one step: its headline, heartbeats while it runs, a note once it is slow.

        ``look_at`` names where to look when the step is slow or fails (log paths, commands); a
        callable is evaluated only then, so it may name logs that appear during the step.
        """
        where = look_at if callable(look_at) else (lambda: list(look_at))
        self._emit(f"==> {self.number(key)}")
        with self._lock:
            self._current = (key, time.monotonic(), slow_after, where)
            self._warned = False
            self._status = ""
        self._ensure_thread()
        try:
            yield
        except StepError as err:
            raise StepError(f"step {self.number(key)} failed: {err}{self._where(where)}") from err
        except Exception as err:
            detail = "".join(traceback.format_exception_only(err)).strip()
            raise StepError(f"step {self.number(key)} failed: {detail}{self._where(where)}") from err
        finally:
            with self._lock:
                self._current = None

    @staticmethod
    def _where(where: Callable[[], Sequence[str]]) -> str:
        places = list(where())
        return "\n  look at: " + "\n           ".join(places) if places else ""

    def where(self) -> str:
        """The running step's ``look_at`` as text (for errors raised outside :meth:`step`)."""
        with self._lock:
            current = self._current
        return self._where(current[3]) if current else ""

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                current = self._current
                quiet = time.monotonic() - self._last_output
                status = self._status
                warned = self._warned
            if current is None:
                continue
            _key, started, slow_after, where = current
            elapsed = time.monotonic() - started
            if elapsed > slow_after and not warned:
                with self._lock:
                    self._warned = True
                self.say(
                    f"!! slower than expected ({elapsed:.0f}s, usually under {slow_after:.0f}s)"
                    f"{self._where(where).replace(chr(10), chr(10) + '  ')}"
                )
            elif quiet >= self.heartbeat:
                self.say(f"... still at it ({elapsed:.0f}s){': ' + status if status else ''}")

    def close(self) -> None:
        """Stop the heartbeat thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
