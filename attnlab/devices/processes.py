"""Joining the processes of one run through ``jax.distributed``, and stopping when one is lost.

A process that does not answer must not leave the others waiting on a collective that will
never complete. Each process runs a watchdog thread: it counts a beat in JAX's key-value
store (held by process 0's distributed service) every second and reads the others' beats.
A process whose count has not moved for ``distributed.heartbeat_timeout_s`` seconds, or a
store that no longer answers (process 0 is gone), stops this process with one line naming
the lost process (``attnlab train: error: process 2 of 4 stopped answering ...``) and exit
status 1. JAX's own heartbeat, which ends a process with a fatal log and a stack trace, is
set to a longer timeout so that this line comes first. A process that finished its run says
so in the store, and no one waits for it any more.

Before joining, a process other than 0 waits for the coordinator's port to accept a
connection, at most ``distributed.initialization_timeout_s`` seconds; a coordinator that
never answers ends the start-up in one line. A run stopped either way keeps its newest
checkpoint and resumes on any number of processes (``attnlab.runs.workdir``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time

from attnlab.errors import ConfigError

EXIT_CODE = 1  # the run failed (``attnlab.cli``: 2 is for what cannot run at all)
BEAT_S = 1.0
PREFIX = "attnlab/alive/"
_WATCH: dict = {}


def _jax_heartbeat(timeout: int) -> int:
    """JAX's heartbeat timeout: well after the watchdog's, so its line comes first."""
    return 3 * int(timeout) + 30


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Returns once ``address`` (host:port) accepts a connection; a ``ConfigError`` after
    ``timeout`` seconds."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + float(timeout)
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"distributed.coordinator_address={address}: no coordinator answered "
                    f"within {timeout:g} s; start process 0 there first, or check the host and "
                    "port (distributed.initialization_timeout_s sets the wait)"
                ) from None
            time.sleep(0.5)


def initialize(kwargs: dict, *, initialization_timeout: int, heartbeat_timeout: int) -> None:
    """``jax.distributed.initialize(**kwargs)`` with the timeouts, then the watchdog."""
    import jax

    address = str(kwargs.get("coordinator_address") or "")
    if address and int(kwargs.get("process_id", 0)) > 0:
        wait_for_coordinator(address, initialization_timeout)
    jax.distributed.initialize(
        **kwargs,
        initialization_timeout=int(initialization_timeout),
        heartbeat_timeout_seconds=_jax_heartbeat(heartbeat_timeout),
    )
    start_watchdog(float(heartbeat_timeout), address)


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def lost_line(lost: list[int], n: int, timeout: float, address: str) -> str:
    """The line a process prints when ``lost`` (process indices; empty: the store, process
    0's service, stopped answering) went silent."""
    if lost:
        who = f"process{'es' * (len(lost) > 1)} {', '.join(map(str, lost))} of {n}"
    else:
        who = f"process 0 of {n} (the coordinator{' at ' + address if address else ''})"
    return (
        f"attnlab train: error: {who} stopped answering (silent for {timeout:g} s); this "
        "process stops too. The newest checkpoint is kept: run the same command on the "
        "processes that remain (any number) to resume"
    )


def _stop(line: str) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os.write(2, (line + "\n").encode())
    os._exit(EXIT_CODE)


def _halt(client, me: int, n: int, line: str, beats: dict) -> None:
    """Stops every process with ``line``: it goes into the store, each process that reads
    it acknowledges and stops; process 0, whose exit ends the store, waits for them first."""
    with contextlib.suppress(Exception):
        if f"{PREFIX}stop" not in beats:
            client.key_value_set(f"{PREFIX}stop", line, allow_overwrite=True)
        client.key_value_set(f"{PREFIX}ack{me}", "1", allow_overwrite=True)
    if me == 0:
        deadline = time.monotonic() + 3 * BEAT_S + 1
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                beats = dict(client.key_value_dir_get(PREFIX))
            waiting = [
                i
                for i in range(1, n)
                if f"{PREFIX}ack{i}" not in beats and beats.get(f"{PREFIX}{i}") != "done"
            ]
            if not waiting or line not in beats.get(f"{PREFIX}stop", line):
                break
            time.sleep(0.1)
        time.sleep(0.2)  # the last acknowledging process prints and exits
    _stop(beats.get(f"{PREFIX}stop", line))


def _watch(me: int, n: int, timeout: float, address: str, done: threading.Event) -> None:
    client = _client()
    count, seen, failing_since = 0, {}, None
    start = time.monotonic()
    while not done.is_set():
        now = time.monotonic()
        try:
            count += 1
            client.key_value_set(f"{PREFIX}{me}", str(count), allow_overwrite=True)
            beats = dict(client.key_value_dir_get(PREFIX))
            failing_since = None
        except Exception:
            if done.is_set():
                return
            failing_since = failing_since or now
            if now - failing_since >= timeout:
                _stop(lost_line([], n, timeout, address))
            done.wait(BEAT_S)
            continue
        if f"{PREFIX}stop" in beats and not done.is_set():
            _halt(client, me, n, beats[f"{PREFIX}stop"], beats)
        lost = []
        for i in range(n):
            value = beats.get(f"{PREFIX}{i}")
            if value == "done" or f"{PREFIX}ack{i}" in beats:
                continue
            last = seen.get(i)
            if last is None or last[0] != value:
                seen[i] = (value, now)
            elif now - max(last[1], start) >= timeout:
                lost.append(i)
        if lost and not done.is_set():
            lost = _still_silent(client, lost, beats, min(timeout, 5.0))
        if lost and not done.is_set():
            _halt(client, me, n, lost_line(lost, n, timeout, address), beats)
        done.wait(BEAT_S)


def _still_silent(client, lost, beats, grace):
    """The processes of ``lost`` that stay silent ``grace`` seconds more: one whose thread
    was only starved of the CPU for a while (a loaded machine) beats again and is spared."""
    time.sleep(grace)
    try:
        now = dict(client.key_value_dir_get(PREFIX))
    except Exception:
        return lost
    if f"{PREFIX}stop" in now:
        return lost
    return [i for i in lost if now.get(f"{PREFIX}{i}") == beats.get(f"{PREFIX}{i}")]


def start_watchdog(timeout: float, address: str = "") -> None:
    """Starts this process's watchdog (see the module docstring); once per process."""
    import jax

    if _WATCH or jax.process_count() < 2 or _client() is None:
        return
    done = threading.Event()
    me, n = jax.process_index(), jax.process_count()
    thread = threading.Thread(
        target=_watch, args=(me, n, float(timeout), address, done), daemon=True
    )
    _WATCH.update(done=done, thread=thread, me=me)
    thread.start()


def finished() -> None:
    """Tells the other processes that this one ended its run on purpose (no one waits for
    it any more) and stops the watchdog."""
    if not _WATCH:
        return
    _WATCH["done"].set()
    _WATCH["thread"].join()
    with contextlib.suppress(Exception):
        _client().key_value_set(f"{PREFIX}{_WATCH['me']}", "done", allow_overwrite=True)
